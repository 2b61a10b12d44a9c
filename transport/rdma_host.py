"""What the host around a verbs device settles before any queue pair exists: whether the
locked-memory limit lets this process register what its channels will, and which verbs
device sits nearest the GPU this process computes on. Plain reads of /proc and /sys under
a root that tests replace with a tree of their own; nothing here imports pyverbs.

Locked memory. `ibv_reg_mr` pins a region's pages and the kernel counts them against the
process's RLIMIT_MEMLOCK soft limit (rdma-core's ib_umem_get: the pages already pinned, VmPin
in /proc/self/status, plus the new ones may not pass the limit unless the process holds
CAP_IPC_LOCK); past it the registration fails with ENOMEM. The 64-byte loopback probe
passes under any limit, so the bytes the endpoint's channels will register are checked
here, before wiring. CAP_IPC_LOCK is read from CapEff (bit 14), never inferred from uid 0:
root in a container lacks it unless it is added (Docker's default set leaves it out), and
the kernel asks for it in the initial user namespace, so inside another one (uid_map not
the identity) the bit is not trusted.

NIC choice. Each verbs device's PCI path is where /sys/class/infiniband/<dev>/device
points (/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/...); the GPU's is where
/sys/bus/pci/devices/<its address> points. Nearest first: the longest common path (a PCIe
switch in common; then the same root complex, nothing but the host bridge in common), then
the same NUMA node (/sys/bus/pci/devices/<addr>/numa_node), then the verbs list's order.
In NCCL's words: PIX/PXB, then PHB, then NODE, then SYS. The GPU's address comes from
torch's device properties; without CUDA (or with one candidate) the list's order stands.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path("/")
CAP_IPC_LOCK = 14  # linux/capability.h
PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
ROOT_COMPLEX = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
MEMLOCK_FIX = ("run with `ulimit -l unlimited` (set before `ray start`: workers inherit it; "
               "docker run --ulimit memlock=-1; in Kubernetes add the IPC_LOCK capability to the container)")


def size_text(nbytes: int, exact: bool = True) -> str:
    """"1.5 GiB (1610612736 bytes)"; without `exact`, "1.5 GiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}" + (f" ({nbytes} bytes)" if exact else "")
    return f"{nbytes} bytes"


# -- locked memory ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LockedMemory:
    soft: int | None  # RLIMIT_MEMLOCK's soft limit in bytes (what the kernel checks); None: unlimited
    hard: int | None  # its hard limit; None: unlimited
    pinned: int  # bytes this process has pinned already (VmPin)
    ipc_lock: bool  # CAP_IPC_LOCK holds: the limit does not apply


def locked_memory(root: Path | None = None) -> LockedMemory:
    """This process's locked-memory limit, what it has pinned, and whether the limit applies
    (`root`: where /proc is found; default ROOT)."""
    root = ROOT if root is None else root
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    status = _status_fields(root / "proc/self/status")
    pinned = int(status.get("VmPin", "0 kB").split()[0]) * 1024
    try:
        ipc_lock = bool(int(status.get("CapEff", "0"), 16) >> CAP_IPC_LOCK & 1)
    except ValueError:
        ipc_lock = False
    ipc_lock = ipc_lock and _initial_user_namespace(root)
    unlimited = resource.RLIM_INFINITY
    return LockedMemory(None if soft == unlimited else soft, None if hard == unlimited else hard, pinned, ipc_lock)


def memlock_shortfall(need: int, what: str, mem: LockedMemory) -> str:
    """"" where `need` more bytes can be pinned; else the reason, naming the limit, the bytes
    (`what` says what registers them) and the fix."""
    if mem.ipc_lock or mem.soft is None or mem.pinned + need <= mem.soft:
        return ""
    pinned = f", {size_text(mem.pinned)} of it pinned already" if mem.pinned else ""
    hard = "" if mem.hard is not None and mem.hard < mem.pinned + need else \
        " (the hard limit allows it: raising the soft limit is enough)"
    return (f"RLIMIT_MEMLOCK is {size_text(mem.soft)}{pinned}, but {what} registers {size_text(need)} with the "
            f"NIC: ibv_reg_mr would fail with ENOMEM at wiring. Fix: {MEMLOCK_FIX}{hard}")


def _status_fields(path: Path) -> dict[str, str]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _initial_user_namespace(root: Path) -> bool:
    try:
        fields = (root / "proc/self/uid_map").read_text().split()
    except OSError:
        return True  # a kernel without user namespaces
    return fields == ["0", "0", "4294967295"]


# -- NIC choice ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    pci: str  # its PCI address as sysfs spells it ("0000:3d:00.0"); "" where there is none
    why_none: str = ""  # why not, where ""


def cuda_gpu(device: int | None = None) -> Gpu:
    """The PCI address of this process's CUDA device (`device`, default the current one)."""
    try:
        import torch
    except ImportError:
        return Gpu("", "torch is not installed")
    if not torch.cuda.is_available():
        return Gpu("", "CUDA is not available")
    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    except Exception as exc:  # noqa: BLE001 - a driver that fails here must not stop the transport
        return Gpu("", f"cannot read the GPU's properties ({exc})")
    ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if not all(isinstance(i, int) for i in ids):
        return Gpu("", f"torch {torch.__version__} does not report the GPU's PCI address")
    domain, bus, dev = ids
    return Gpu(f"{domain:04x}:{bus:02x}:{dev:02x}.0")  # NVIDIA GPUs are function 0


@dataclass(frozen=True)
class Place:
    """Where a PCI device sits: its path from the root complex down, and its NUMA node."""

    path: tuple[str, ...]  # ("pci0000:3a", "0000:3a:00.0", ..., the device itself); () if unknown
    numa: int | None  # None: unknown (sysfs says -1, or nothing)


def place_of(link: Path) -> Place:
    """The place of the PCI device a sysfs link (or directory) resolves to."""
    parts = Path(os.path.realpath(link)).parts
    start = next((i for i, p in enumerate(parts) if ROOT_COMPLEX.match(p)), None)
    if start is None:
        return Place((), None)
    path = [parts[start]]
    for part in parts[start + 1:]:
        if not PCI_ADDRESS.match(part):
            break
        path.append(part)
    return Place(tuple(path), _numa(link / "numa_node"))


def _numa(path: Path) -> int | None:
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a[:-1], b[:-1]):  # the devices themselves are never shared
        if x != y:
            break
        n += 1
    return n


def _nearness(gpu_name: str, gpu: Place, nic: Place) -> tuple[tuple[int, int], str]:
    """(sort key, words) of one device against the GPU: lower keys are nearer; a device without a
    PCI path (soft RoCE, say) comes after every one that has one."""
    if not nic.path:
        return (1, 1), "no PCI path in sysfs (a virtual device?)"
    common = _common(gpu.path, nic.path)
    same_numa = gpu.numa is not None and gpu.numa == nic.numa
    if common >= 2:
        words = f"behind the same PCIe switch as GPU {gpu_name} (bridge {nic.path[common - 1]})"
    elif common == 1:
        words = f"under GPU {gpu_name}'s root complex {nic.path[0]}, no PCIe switch in common"
    elif same_numa:
        words = f"on GPU {gpu_name}'s NUMA node {gpu.numa}, under another root complex"
    else:
        nodes = f"NUMA node {nic.numa if nic.numa is not None else '?'}, GPU on " \
                f"{gpu.numa if gpu.numa is not None else '?'}"
        words = f"far from GPU {gpu_name} (no PCIe path in common; {nodes})"
    return (-common, 0 if same_numa else 1), words


def nearest_first(devices: list, gpu: Gpu | None = None, root: Path | None = None,
                  locate_gpu: Callable[[], Gpu] = cuda_gpu) -> list[tuple[object, str]]:
    """`devices` (anything with a `.name`), nearest `gpu` first (default: this process's CUDA
    device, looked up only when there is a choice to make), each with why it sits where it does.
    `root`: where /sys is found (default ROOT)."""
    root = ROOT if root is None else root
    if len(devices) <= 1:
        return [(d, "the only candidate device") for d in devices]
    gpu = locate_gpu() if gpu is None else gpu
    if not gpu.pci:
        return [(d, f"first in the verbs device list ({gpu.why_none}: the NIC is not chosen by locality)")
                for d in devices]
    gpu_place = place_of(root / "sys/bus/pci/devices" / gpu.pci)
    if not gpu_place.path:
        return [(d, f"first in the verbs device list (sysfs has no PCI path for GPU {gpu.pci})") for d in devices]
    ranked = []
    for i, dev in enumerate(devices):
        key, words = _nearness(gpu.pci, gpu_place, place_of(root / "sys/class/infiniband" / dev.name / "device"))
        ranked.append((key, i, dev, words))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [(dev, words) for _, _, dev, words in ranked]
