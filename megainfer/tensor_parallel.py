"""A tensor-parallel node's process groups: one for control, one for activations.

Control tensors (a step's schedule, a micro-batch's header, the free memory the ranks agree
on) are small host integers: they travel over a gloo group. Activations (partial attention
outputs, expert inputs and partial outputs) stay on the compute device: on GPUs they travel
over NCCL, on CPUs over the same gloo group. Nothing on the CPU ever enters an NCCL
collective and no device tensor enters gloo, so a follower waiting for its next step waits
in gloo, where NCCL's watchdog cannot kill it while its leader re-wires.

Every collective first checks that its tensor lives where its backend can take it and raises
`CollectiveDeviceError` naming the collective, the tensor's device and the group's, so a
misplaced tensor fails the same way on a CPU rehearsal as it would on a GPU cluster.

One group per process (a node actor is one rank of one node), set by `join` and read by the
layers through `current()`, as vLLM's parallel state does.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megainfer.errors import ConfigError


class CollectiveDeviceError(RuntimeError):
    """A tensor was handed to a collective whose backend cannot take its device."""


class TensorParallelGroup:
    def __init__(self, rank: int, size: int, device: torch.device, data_group=None) -> None:
        """`data_group`: the activations' group (NCCL on GPUs); None uses the default (gloo)
        group, which is the control group."""
        self.rank, self.size = rank, size
        self.device = torch.device(device)
        self.data_group = data_group
        self.data_backend = "nccl" if self.device.type == "cuda" else "gloo"

    # -- control: host int64 over gloo --------------------------------------------------------
    def broadcast_control(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._check_control("broadcast_control", tensor)
        dist.broadcast(tensor, src=src)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. free memory, so all ranks size alike)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._check_control("min_over_ranks", t)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # -- activations: the compute device's backend --------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._check_data("all_reduce", tensor)
        dist.all_reduce(tensor, group=self.data_group)

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> None:
        self._check_data("reduce", tensor)
        dist.reduce(tensor, dst=dst, group=self.data_group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._check_data("broadcast", tensor)
        dist.broadcast(tensor, src=src, group=self.data_group)

    def _check_control(self, op: str, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise CollectiveDeviceError(f"{op}: control tensors travel over gloo and must be on the CPU, got one "
                                        f"on {tensor.device} (send activations with all_reduce/broadcast/reduce)")

    def _check_data(self, op: str, tensor: torch.Tensor) -> None:
        if tensor.device != self.device and not (tensor.device.type == self.device.type == "cuda"
                                                 and self.device.index is None):
            raise CollectiveDeviceError(f"{op}: activations travel over {self.data_backend} on {self.device}, got a "
                                        f"tensor on {tensor.device} (control values go through "
                                        f"broadcast_control/min_over_ranks)")


_current: TensorParallelGroup | None = None


def join(master: str, rank: int, size: int, device: str, timeout_s: float) -> TensorParallelGroup:
    """Join this node's group (rendezvous at `master`, host:port); the control group is gloo,
    the activations' group NCCL where `device` is CUDA."""
    global _current
    if _current is not None:
        raise ConfigError("this process already belongs to a tensor-parallel group")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=size, timeout=timeout)
    torch_device = torch.device(device)
    data_group = dist.new_group(backend="nccl", timeout=timeout) if torch_device.type == "cuda" else None
    _current = TensorParallelGroup(rank, size, torch_device, data_group)
    return _current


def current() -> TensorParallelGroup:
    if _current is None:
        raise ConfigError("tensor parallelism needs the node's group: call megainfer.tensor_parallel.join first")
    return _current


def leave() -> None:
    """Destroy this process's groups (tests that form groups in threads or reuse a process)."""
    global _current
    if _current is not None and dist.is_initialized():
        dist.destroy_process_group()
    _current = None
