"""A node's tensor-parallel group: its rendezvous address and joining it (never across nodes)."""

from __future__ import annotations

from megainfer import tensor_parallel
from megainfer.tensor_parallel import TensorParallelGroup

# A follower rank waits for its leader's next step in the control group's broadcast. Long
# enough for a re-wire (every endpoint re-opened and re-connected, PEER_TIMEOUT_S each way,
# plus a restarted expert node reloading its weights); a dead rank is found by the health
# checks within seconds, and this only bounds how long its group's survivors hang.
TP_GROUP_TIMEOUT_S = 300.0


def tp_master_address(host: str) -> str:
    """A free TCP port on `host` (this node's address) for a tensor-parallel group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def join_tp_group(master: str, rank: int, world_size: int, device: str) -> TensorParallelGroup:
    """The node's own group: gloo for control, NCCL for activations on GPUs."""
    return tensor_parallel.join(master, rank, world_size, device, TP_GROUP_TIMEOUT_S)
