"""CUDA tensors over M2N without device-wide synchronisation.

Sending: a side stream waits on the producer's event (recorded on the producing stream),
copies the tensor into pinned staging memory, and only that copy's event is waited on
before the bytes are written into the peer's slot. The producing stream and the rest of
the device keep running.

Receiving: the payload is copied from the slot into pinned staging (a host copy), the slot
is released at once, and the host-to-device copy is enqueued on the consuming stream:
kernels the consumer launches after it on that stream see the data, and the host never
waits for the device. A staging buffer is reused only after its copy's event completed.
"""

from __future__ import annotations

import torch

from transport.endpoint import Endpoint


class StreamOrderedSender:
    def __init__(self, endpoint: Endpoint, max_bytes: int, device: torch.device | str | None = None) -> None:
        self.endpoint = endpoint
        self.device = torch.device(device or "cuda")
        self.stream = torch.cuda.Stream(self.device)
        self.staging = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)

    def send(self, peer: str, tensor: torch.Tensor, event: torch.cuda.Event | None = None, **header) -> None:
        """Send `tensor` once `event` (default: now, on the current stream) has fired."""
        if not tensor.is_cuda:
            self.endpoint.send(peer, tensor, **header)
            return
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        if flat.numel() > self.staging.numel():
            raise ValueError(f"tensor of {flat.numel()} bytes exceeds the {self.staging.numel()}-byte staging buffer")
        if event is None:
            event = torch.cuda.current_stream(tensor.device).record_event()
        host = self.staging[:flat.numel()]
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(event)
            host.copy_(flat, non_blocking=True)
            copied = self.stream.record_event()
        copied.synchronize()  # this copy only: the producer's stream and the device run on
        self.endpoint.send(peer, host, **header)


class StreamOrderedReceiver:
    def __init__(self, endpoint: Endpoint, max_bytes: int, device: torch.device | str | None = None,
                 buffers: int = 2) -> None:
        self.endpoint = endpoint
        self.device = torch.device(device or "cuda")
        self.staging = [torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
        self.events: list[torch.cuda.Event | None] = [None] * buffers
        self.next = 0

    def recv(self, peer: str | None = None, *, dtype: torch.dtype = torch.uint8, shape=None,
             stream: torch.cuda.Stream | None = None, **match) -> tuple[object, torch.Tensor]:
        """(header, device tensor) with the device copy ordered on `stream` (default: current)."""
        msg = self.endpoint.recv(peer, **match)
        i = self.next
        self.next = (i + 1) % len(self.staging)
        if self.events[i] is not None:
            self.events[i].synchronize()  # the previous copy out of this buffer only
        n = len(msg.data)
        host = self.staging[i][:n]
        if n:
            host.copy_(msg.tensor())
        header = msg.header
        msg.release()  # the bytes are in staging: the sender may reuse its slot now
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            out = host.to(self.device, non_blocking=True)
            self.events[i] = stream.record_event()
        out = out.view(dtype)
        return header, (out.view(shape) if shape is not None else out)
