"""RDMA that fails early and well: the locked-memory check against what wiring registers
(monkeypatched RLIMIT_MEMLOCK, a fake /proc), the NIC nearest the GPU (a fake sysfs tree), and
what an endpoint does with both. No verbs device needed; none of it has run on RDMA hardware."""

from __future__ import annotations

import functools
import logging
import mmap
import os
import resource
from pathlib import Path

import pytest

from transport import Endpoint, EndpointSpec, rdma
from transport import rdma_host as rh
from transport import rdma_port as rp
from transport.backends import BackendSet
from transport.errors import BackendUnavailable
from transport.selection import Capabilities, choose
from transport.shm import slot_stride

from tests.transport.test_rdma_port import FakeContext, fake_devices

SECRET = b"s" * 32
KIB, MIB = 1 << 10, 1 << 20
# A Qwen3-235B attention rank's channel as gpu-review.md puts it: ~23 MB of slots, 64 channels.
QWEN_SLOT, QWEN_PEERS = 23 * MIB // 2, 32


# -- a fake /proc and RLIMIT_MEMLOCK ---------------------------------------------------------
def fake_proc(root: Path, cap_eff: int = 0, vm_pin_kb: int = 0, uid_map: str = "0 0 4294967295") -> None:
    proc = root / "proc/self"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "status").write_text(f"Name:\tpython\nVmLck:\t       0 kB\nVmPin:\t{vm_pin_kb:8d} kB\n"
                                 f"CapInh:\t0000000000000000\nCapEff:\t{cap_eff:016x}\n")
    (proc / "uid_map").write_text(f"{uid_map}\n")


@pytest.fixture
def memlock(tmp_path, monkeypatch):
    """Set the process's RLIMIT_MEMLOCK (soft, hard) as getrlimit reports it, and a /proc without
    CAP_IPC_LOCK under rdma_host.ROOT."""
    real = resource.getrlimit

    def limit(soft, hard=None):
        hard = soft if hard is None else hard
        monkeypatch.setattr(resource, "getrlimit",
                            lambda which: (soft, hard) if which == resource.RLIMIT_MEMLOCK else real(which))

    fake_proc(tmp_path)
    monkeypatch.setattr(rh, "ROOT", tmp_path)
    limit(64 * KIB)  # Docker's default
    return limit


def test_locked_memory_reads_the_limit_what_is_pinned_and_the_capability(tmp_path, memlock):
    memlock(64 * KIB, 8 * MIB)
    assert rh.locked_memory() == rh.LockedMemory(64 * KIB, 8 * MIB, 0, False)
    fake_proc(tmp_path, cap_eff=1 << rh.CAP_IPC_LOCK, vm_pin_kb=12)
    assert rh.locked_memory() == rh.LockedMemory(64 * KIB, 8 * MIB, 12 * KIB, True)
    # CAP_IPC_LOCK inside a user namespace is not the kernel's (it asks in the initial one)
    fake_proc(tmp_path, cap_eff=1 << rh.CAP_IPC_LOCK, uid_map="0 1000 1")
    assert rh.locked_memory().ipc_lock is False
    # root without IPC_LOCK (Docker's default set) is limited like anyone
    fake_proc(tmp_path, cap_eff=0x00000000a80425fb)
    assert rh.locked_memory().ipc_lock is False
    memlock(resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert rh.locked_memory() == rh.LockedMemory(None, None, 0, False)


def test_shortfall_names_the_limit_the_bytes_and_the_fix():
    mem = rh.LockedMemory(64 * KIB, 64 * KIB, 0, False)
    assert rh.memlock_shortfall(64 * KIB, "wiring", mem) == ""
    reason = rh.memlock_shortfall(64 * KIB + 1, "wiring 2 peers", mem)
    assert reason.startswith("RLIMIT_MEMLOCK is 64.0 KiB (65536 bytes), but wiring 2 peers registers 64.0 KiB "
                             "(65537 bytes) with the NIC: ibv_reg_mr would fail with ENOMEM at wiring.")
    assert "ulimit -l unlimited" in reason and "IPC_LOCK" in reason and "hard limit" not in reason
    pinned = rh.LockedMemory(64 * KIB, None, 60 * KIB, False)  # what this process pinned already counts
    reason = rh.memlock_shortfall(8 * KIB, "x", pinned)
    assert "60.0 KiB (61440 bytes) of it pinned already" in reason
    assert "the hard limit allows it: raising the soft limit is enough" in reason
    assert rh.memlock_shortfall(1 << 40, "x", rh.LockedMemory(None, None, 0, False)) == ""  # unlimited
    assert rh.memlock_shortfall(1 << 40, "x", rh.LockedMemory(64 * KIB, 64 * KIB, 0, True)) == ""  # IPC_LOCK


def test_wiring_counts_the_pages_each_channel_registers():
    wiring = rdma.Wiring(peers=QWEN_PEERS, slot_bytes=QWEN_SLOT, peer_slot_bytes=1 * MIB, num_slots=2)
    inbound = rdma.region_bytes(slot_stride(QWEN_SLOT), 2)  # what _QueuePair maps and registers
    assert inbound <= rdma.pinned_bytes(QWEN_SLOT, 2) < inbound + mmap.PAGESIZE
    assert rdma.pinned_bytes(QWEN_SLOT, 2) % mmap.PAGESIZE == 0
    assert wiring.bytes == QWEN_PEERS * (rdma.pinned_bytes(QWEN_SLOT, 2) + rdma.pinned_bytes(1 * MIB, 2))
    assert wiring.bytes > 700 * MIB  # far past any default limit, while the loopback needs two pages
    assert wiring.describe().startswith("wiring 32 peer(s) (64 channels: 2 slots each, 23.0 MiB per inbound")


# -- the probe ----------------------------------------------------------------------------------
def probe_with(**kw):
    return rdma.probe({}, list_devices=fake_devices("mlx5_0"), open_ctx=lambda n: FakeContext("connectx_roce"), **kw)


def test_probe_refuses_what_the_limit_cannot_register_before_the_loopback(memlock):
    looped = []
    wiring = rdma.Wiring(QWEN_PEERS, QWEN_SLOT, QWEN_SLOT, 2)
    result = probe_with(wiring=wiring, loopback=lambda ctx, c: looped.append(c) or "")
    assert not result.ok and not looped  # the 64-byte loopback would have passed
    assert result.reason.startswith("RLIMIT_MEMLOCK is 64.0 KiB (65536 bytes), but wiring 32 peer(s)")
    assert f"({wiring.bytes} bytes) with the NIC" in result.reason and "ulimit -l unlimited" in result.reason
    assert (result.device, result.port) == ("mlx5_0", 1)  # what was found stays in the result
    memlock(resource.RLIM_INFINITY)
    assert probe_with(wiring=wiring, loopback=lambda ctx, c: looped.append(c) or "").ok and looped
    assert probe_with(loopback=lambda ctx, c: "").ok  # no wiring stated: the loopback alone, as before


# -- an endpoint: auto falls back, a requested rdma fails at start -----------------------------------
@pytest.fixture
def rdma_probe_passes(monkeypatch):
    """rdma.probe over a fake ACTIVE RoCE port whose loopback passes: what decides is the limit."""
    monkeypatch.setattr(rdma, "probe", functools.partial(rdma.probe, list_devices=fake_devices("mlx5_0"),
                                                         open_ctx=lambda n: FakeContext("connectx_roce"),
                                                         loopback=lambda ctx, c: ""))


def test_requested_rdma_fails_at_start_when_wiring_would_pass_the_limit(memlock, rdma_probe_passes):
    with pytest.raises(BackendUnavailable, match=r"^backend 'rdma' requested but unavailable: RLIMIT_MEMLOCK is "
                                                 r"64.0 KiB .* wiring 32 peer\(s\) .*ulimit -l unlimited"):
        Endpoint(EndpointSpec("a0", SECRET, backend="rdma", slot_bytes=QWEN_SLOT, expected_peers=QWEN_PEERS))
    memlock(resource.RLIM_INFINITY)
    ep = Endpoint(EndpointSpec("a0", SECRET, backend="rdma", slot_bytes=QWEN_SLOT, expected_peers=QWEN_PEERS))
    assert ep.backends.capabilities.rdma
    ep.close()


def test_auto_falls_back_saying_which_limit_how_many_bytes_and_the_fix(memlock, rdma_probe_passes, caplog):
    caplog.set_level(logging.INFO, logger="transport.backends")
    with Endpoint(EndpointSpec("a0", SECRET, slot_bytes=QWEN_SLOT, expected_peers=QWEN_PEERS)) as ep:
        caps = ep.backends.capabilities
    assert not caps.rdma and caps.rdma_reason.startswith("RLIMIT_MEMLOCK is 64.0 KiB")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "endpoint a0: rdma unavailable on port 1 of mlx5_0, so auto uses nixl or tcp" in \
        warned[0]
    assert "RLIMIT_MEMLOCK is 64.0 KiB" in warned[0] and "ulimit -l unlimited" in warned[0] and "bytes)" in warned[0]
    # the pair's choice (logged by both ends) carries the same reason
    peer = Capabilities("h2", shm=False, rdma=True, nixl=False)
    choice = choose("auto", "auto", caps, peer, "a0", "e0")
    assert choice.backend == "tcp" and "not rdma: a0: RLIMIT_MEMLOCK is 64.0 KiB" in choice.reason


def test_connect_checks_again_for_more_peers_than_the_start_did(memlock, rdma_probe_passes):
    # built without a peer count (the probe then checks the loopback only), connected to many
    spec = EndpointSpec("a0", SECRET, backend="rdma", slot_bytes=QWEN_SLOT, timeout_s=0.5)
    with Endpoint(spec) as ep:
        assert ep.backends.capabilities.rdma
        peers = {f"e{i}": f"127.0.0.1:{9 + i}" for i in range(QWEN_PEERS)}
        with pytest.raises(BackendUnavailable, match="RLIMIT_MEMLOCK is 64.0 KiB .* wiring 32 peer"):
            ep.connect(peers)  # before dialing anyone: no queue pair, no timeout


def test_auto_withdraws_rdma_at_connect_when_the_peers_do_not_fit(memlock, rdma_probe_passes, caplog):
    backends = BackendSet("a1", "auto", 4 * KIB, 2, None)
    try:
        backends.expect_peers(1)  # 2 channels of 3 pages each: fits in 64 KiB
        assert backends.capabilities.rdma
        caplog.set_level(logging.WARNING, logger="transport.backends")
        backends.expect_peers(QWEN_PEERS)
        assert not backends.capabilities.rdma and "wiring 32 peer(s)" in backends.capabilities.rdma_reason
        assert any("RLIMIT_MEMLOCK" in r.getMessage() for r in caplog.records)
    finally:
        backends.close()


# -- the NIC nearest the GPU, over a fake sysfs tree --------------------------------------------------
# Socket 0 (NUMA 0): root complex pci0000:16 with a PCIe switch (upstream 0000:17:00.0) holding
# GPU 0 and mlx5_0; root complex pci0000:30 holding GPU 1 and mlx5_1 on root ports of their own.
# Socket 1 (NUMA 1): GPU 2 under pci0000:b0, mlx5_2 under pci0000:c0; rxe0 is virtual.
GPU0 = ("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:00.0", "0000:19:00.0")
NIC0 = ("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:08.0", "0000:1a:00.0")
GPU1 = ("pci0000:30", "0000:30:02.0", "0000:31:00.0")
NIC1 = ("pci0000:30", "0000:30:04.0", "0000:32:00.0")
GPU2 = ("pci0000:b0", "0000:b0:02.0", "0000:b1:00.0")
NIC2 = ("pci0000:c0", "0000:c0:02.0", "0000:c1:00.0")


def add_pci(root: Path, path: tuple[str, ...], numa: int) -> Path:
    where = root / "sys/devices" / Path(*path)
    where.mkdir(parents=True)
    (where / "numa_node").write_text(f"{numa}\n")
    link = root / "sys/bus/pci/devices" / path[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(where, link.parent))  # sysfs's links are relative
    return where


def add_nic(root: Path, name: str, path: tuple[str, ...] | None, numa: int = -1) -> None:
    entry = root / "sys/class/infiniband" / name
    entry.mkdir(parents=True)
    if path is not None:
        (entry / "device").symlink_to(os.path.relpath(add_pci(root, path, numa), entry))


@pytest.fixture
def sysfs(tmp_path) -> Path:
    for gpu, numa in ((GPU0, 0), (GPU1, 0), (GPU2, 1)):
        add_pci(tmp_path, gpu, numa)
    for name, path, numa in (("mlx5_0", NIC0, 0), ("mlx5_1", NIC1, 0), ("mlx5_2", NIC2, 1)):
        add_nic(tmp_path, name, path, numa)
    add_nic(tmp_path, "rxe0", None)
    return tmp_path


DEVICES = [rp.DeviceInfo(n) for n in ("rxe0", "mlx5_2", "mlx5_1", "mlx5_0")]  # the verbs list's order


def order(root, gpu: str):
    return [(d.name, why) for d, why in rh.nearest_first(DEVICES, rh.Gpu(gpu), root)]


def test_the_nic_behind_the_gpus_switch_comes_first(sysfs):
    ranked = order(sysfs, GPU0[-1])
    assert [n for n, _ in ranked] == ["mlx5_0", "mlx5_1", "mlx5_2", "rxe0"]
    assert ranked[0][1] == "behind the same PCIe switch as GPU 0000:19:00.0 (bridge 0000:17:00.0)"
    assert ranked[1][1] == "on GPU 0000:19:00.0's NUMA node 0, under another root complex"
    assert ranked[2][1] == "far from GPU 0000:19:00.0 (no PCIe path in common; NUMA node 1, GPU on 0)"
    assert ranked[3][1] == "no PCI path in sysfs (a virtual device?)"


def test_then_the_same_root_complex_then_the_same_numa_node(sysfs):
    ranked = order(sysfs, GPU1[-1])
    assert ranked[0] == ("mlx5_1", "under GPU 0000:31:00.0's root complex pci0000:30, no PCIe switch in common")
    assert [n for n, _ in ranked] == ["mlx5_1", "mlx5_0", "mlx5_2", "rxe0"]
    assert [n for n, _ in order(sysfs, GPU2[-1])][:1] == ["mlx5_2"]  # same NUMA node, other root complex


def test_without_a_gpu_the_verbs_list_order_stands_and_says_why(sysfs):
    ranked = rh.nearest_first(DEVICES, rh.Gpu("", "CUDA is not available"), sysfs)
    assert [d.name for d, _ in ranked] == ["rxe0", "mlx5_2", "mlx5_1", "mlx5_0"]
    assert ranked[0][1] == "first in the verbs device list (CUDA is not available: the NIC is not chosen by locality)"
    unknown = rh.nearest_first(DEVICES, rh.Gpu("0000:99:00.0"), sysfs)
    assert [d.name for d, _ in unknown] == [d.name for d in DEVICES]
    assert "sysfs has no PCI path for GPU 0000:99:00.0" in unknown[0][1]


def test_one_candidate_needs_no_gpu_lookup(sysfs):
    def no_lookup():
        raise AssertionError("the GPU was looked up with nothing to choose")

    assert rh.nearest_first(DEVICES[:1], root=sysfs, locate_gpu=no_lookup) == [(DEVICES[0], "the only candidate device")]


def test_cuda_gpu_on_this_machine():
    gpu = rh.cuda_gpu()
    if gpu.pci:
        assert rh.PCI_ADDRESS.match(gpu.pci)
    else:
        assert gpu.why_none  # this CPU machine: "CUDA is not available"


def test_probe_takes_the_nearest_active_nic_and_logs_why(sysfs):
    tables = {"mlx5_0": "roce_down", "mlx5_1": "connectx_roce", "mlx5_2": "connectx_roce", "rxe0": "connectx_roce"}
    locate = functools.partial(rh.nearest_first, gpu=rh.Gpu(GPU0[-1]), root=sysfs)
    result = rdma.probe({}, list_devices=lambda: DEVICES, open_ctx=lambda n: FakeContext(tables[n]),
                        loopback=lambda ctx, c: "", locate=locate)
    # mlx5_0 shares GPU 0's switch but its port is down: the next nearest, saying what it passed over
    assert (result.ok, result.device) == (True, "mlx5_1")
    assert result.device_reason == ("on GPU 0000:19:00.0's NUMA node 0, under another root complex; "
                                    "passed over: port 1 of mlx5_0 is DOWN")
    tables["mlx5_0"] = "connectx_roce"
    best = rdma.probe({}, list_devices=lambda: DEVICES, open_ctx=lambda n: FakeContext(tables[n]),
                      loopback=lambda ctx, c: "", locate=locate)
    assert best.device == "mlx5_0" and best.device_reason.startswith("behind the same PCIe switch")


def test_rdma_devices_narrow_the_choice_and_the_environment_overrides_them(sysfs):
    tables = dict.fromkeys(("mlx5_0", "mlx5_1", "mlx5_2", "rxe0"), "connectx_roce")
    locate = functools.partial(rh.nearest_first, gpu=rh.Gpu(GPU0[-1]), root=sysfs)
    kw = dict(list_devices=lambda: DEVICES, open_ctx=lambda n: FakeContext(tables[n]), loopback=lambda ctx, c: "",
              locate=locate)
    assert rdma.probe({}, allowed=("mlx5_2", "mlx5_1", "mlx5_9"), **kw).device == "mlx5_1"  # nearest allowed
    none = rdma.probe({}, allowed=("mlx5_9",), **kw)
    assert none.reason == "rdma_devices (mlx5_9) names no verbs device here (devices: rxe0, mlx5_2, mlx5_1, mlx5_0)"
    named = rdma.probe({rp.ENV_DEVICE: "mlx5_2"}, allowed=("mlx5_1",), **kw)
    assert (named.device, named.device_reason) == ("mlx5_2", "MEGAINFER_RDMA_DEVICE names it")
