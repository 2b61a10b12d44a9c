"""A message's payload as bytes, both ways: what a send takes (`as_bytes`: any bytes-like,
numpy array or CPU tensor as a flat byte view, no copy) and what a receive hands out
(`Message`: the header and a view of the payload in its slot, until released)."""

from __future__ import annotations

from transport.wire import Header

__all__ = ["Message", "as_bytes"]


class Message:
    """A received message: its header and a zero-copy view of the payload in the slot.
    The view is valid until `release()`; after that the sender may overwrite the slot."""

    __slots__ = ("peer", "header", "data", "_channel", "_slot", "_released")

    def __init__(self, peer: str, header: Header, data: memoryview, channel, slot: int) -> None:
        self.peer = peer
        self.header = header
        self.data = data
        self._channel = channel
        self._slot = slot
        self._released = False

    def tensor(self, dtype=None, shape=None):
        """The payload as a torch tensor sharing the slot's memory (no copy)."""
        import torch

        dtype = dtype or torch.uint8
        if not len(self.data):
            t = torch.empty(0, dtype=dtype)
        else:
            t = torch.frombuffer(self.data, dtype=dtype)
        return t.view(shape) if shape is not None else t

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._channel.release(self._slot)

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def as_bytes(payload) -> memoryview:
    """bytes-like, numpy array or CPU torch tensor -> a flat byte view (no copy)."""
    if isinstance(payload, (bytes, bytearray)):
        return memoryview(payload)
    if hasattr(payload, "is_cuda"):  # a torch tensor
        if payload.is_cuda:
            raise TypeError("CUDA tensors are staged through pinned host memory by the caller (megainfer's "
                            "disagg/device_staging.py), or registered for RDMA (transport/rdma.py)")
        if not payload.is_contiguous():
            raise ValueError("tensor payloads must be contiguous (call .contiguous())")
        payload = payload.detach().view(-1).view(dtype=__import__("torch").uint8).numpy()
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
