"""Device tensors over M2N without device-wide synchronisation.

Sending: a side stream waits on the producer's event (recorded on the producing stream),
makes the tensor contiguous and copies it into pinned staging memory there, and only that
copy's event is waited on before the bytes are written into the peer's slot. The producing
stream and the rest of the device keep running.

Receiving: the payload is copied from the slot into pinned staging (a host copy), the slot
is released at once, and the host-to-device copy is enqueued on the consuming stream:
kernels the consumer launches after it on that stream see the data, and the host never
waits for the device. A staging buffer is reused only after its copy's event completed.

Host tensors pass through unchanged (a CPU tensor is sent as it is; a receiver for a CPU
device returns the payload copied out of the slot), so the same calls serve CPU peers.
Pinned memory and the side stream are made on first use, so nothing here needs CUDA until
a CUDA tensor is sent or received.
"""

from __future__ import annotations

import torch

from transport.endpoint import Endpoint
from transport.errors import PayloadTooLarge


class StreamOrderedSender:
    def __init__(self, endpoint: Endpoint, max_bytes: int, device: torch.device | str | None = None) -> None:
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.device = torch.device(device or "cuda")
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None  # pinned, max_bytes

    def send(self, peer: str, tensor: torch.Tensor, event: torch.cuda.Event | None = None, **header) -> None:
        """Send `tensor` once `event` (default: now, on the current stream) has fired."""
        if not tensor.is_cuda:
            self.endpoint.send(peer, tensor.contiguous(), **header)
            return
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_bytes:
            raise PayloadTooLarge(f"tensor of {nbytes} bytes exceeds the {self.max_bytes}-byte staging buffer")
        if event is None:
            event = torch.cuda.current_stream(tensor.device).record_event()
        stream, host = self._side_stream(tensor.device), self._pinned()[:nbytes]
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            # After the wait: a non-contiguous tensor is gathered from what the producer finished.
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            host.copy_(flat, non_blocking=True)
            copied = stream.record_event()
        copied.synchronize()  # this copy only: the producer's stream and the device run on
        self.endpoint.send(peer, host, **header)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pinned(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.max_bytes, dtype=torch.uint8, pin_memory=True)
        return self._staging


class StreamOrderedReceiver:
    def __init__(self, endpoint: Endpoint, max_bytes: int, device: torch.device | str | None = None,
                 buffers: int = 2) -> None:
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.device = torch.device(device or "cuda")
        self.buffers = buffers
        self._staging: list[torch.Tensor] = []  # pinned, made on the first CUDA receive
        self._events: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0

    def recv(self, peer: str | None = None, *, dtype: torch.dtype = torch.uint8, shape=None,
             stream: torch.cuda.Stream | None = None, **match) -> tuple[object, torch.Tensor]:
        """(header, tensor on this receiver's device); on CUDA the copy to the device is ordered
        on `stream` (default: current). The transport slot is released before this returns."""
        msg = self.endpoint.recv(peer, **match)
        header = msg.header
        try:
            n = len(msg.data)
            if n > self.max_bytes:
                raise PayloadTooLarge(f"message of {n} bytes from {msg.peer} exceeds the {self.max_bytes}-byte "
                                      f"staging buffer")
            out = self._to_device(msg.tensor(), stream) if self.device.type == "cuda" else msg.tensor().clone()
        finally:
            msg.release()  # the bytes are in staging (or copied out): the sender may reuse its slot
        out = out.view(dtype)
        return header, (out.view(shape) if shape is not None else out)

    def _to_device(self, payload: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.Tensor:
        if not self._staging:
            self._staging = [torch.empty(self.max_bytes, dtype=torch.uint8, pin_memory=True)
                             for _ in range(self.buffers)]
        i = self._next
        self._next = (i + 1) % self.buffers
        if self._events[i] is not None:
            self._events[i].synchronize()  # the previous copy out of this buffer only
        host = self._staging[i][:payload.numel()]
        host.copy_(payload)
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            out = host.to(self.device, non_blocking=True)
            self._events[i] = stream.record_event()
        return out
