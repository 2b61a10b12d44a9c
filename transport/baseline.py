"""The comparison point: the same exchange with torch.distributed point-to-point
(`batch_isend_irecv`; gloo on CPU, nccl on GPU). It needs a process group, set up once per
process here, which is exactly the collective initialisation M2N does without."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class TorchP2PExchange:
    def __init__(self, rank: int, world_size: int, master: str, port: int, backend: str = "gloo",
                 timeout_s: float = 60.0) -> None:
        self.rank = rank
        dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        """Post every send and receive at once and wait for all of them."""
        ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs.items()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def close(self) -> None:
        dist.destroy_process_group()
