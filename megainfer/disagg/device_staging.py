"""Activations between the compute device and the host memory the transport reads and writes.

On CUDA, a tensor leaves the GPU on a copy stream that first waits on an event recorded on
the compute stream (so it copies exactly what the kernels launched so far produced), into a
pinned host buffer; the host reads that buffer only after the copy's own event completed
(`HostCopy.landed`/`wait`), so the compute stream and the rest of the device never stop. A
message enters the GPU by a host memcpy out of the transport slot into a pinned buffer (the
slot can be released at once) and one non-blocking host-to-device copy on the compute stream,
which kernels launched after it on that stream see in order. A pinned buffer is written again
only after the copy that last used it completed (its event), so nothing is read half-written.

On the CPU the same calls elide the device copies: `to_host` returns the tensors themselves,
`landing` a reused host buffer per slot and `upload` that buffer itself.

Pinned buffers, one per micro-batch slot and direction, are reserved up front at the size of
the largest message the slot can carry (`StagingBytes`, computed in staging_sizes.py), so no
step allocates pinned memory (slow). A message larger than the reservation still goes
through: its buffer grows to fit (aligned), with a warning, as a guard; a buffer reserved
with 0 bytes grows in the first steps, as they need it.

`ComputeTimer` measures device time between two points of the host's program: CUDA events on
the compute stream, read once per step; on the CPU, where the host runs the kernels itself,
wall time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megainfer.disagg.staging_sizes import ALIGN, StagingBytes, aligned_layout

logger = logging.getLogger(__name__)

# Landing slices kept per slot on the CPU (one per round length seen): a decode round's length
# varies over a few dozen values, a prefill's more; past this many, the slot starts over.
LANDING_SLICES_KEPT = 512


@dataclass
class HostCopy:
    """Tensors on their way to the host: `parts` are valid once `event` completed (None: already)."""

    parts: list[torch.Tensor]
    event: torch.cuda.Event | None = None

    def landed(self) -> bool:
        """True once the copy completed; never waits."""
        return self.event is None or self.event.query()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, after waiting for this copy only (not for the device)."""
        if self.event is not None:
            self.event.synchronize()
        return self.parts


class PinnedBuffer:
    """Page-locked host bytes that the DMA engines read and write, reserved for the largest
    message; grows (aligned) only for a larger one."""

    def __init__(self, name: str, reserve_bytes: int = 0) -> None:
        self.name = name
        self.reserved = reserve_bytes
        self.data = _pinned(reserve_bytes)
        self.last_use: torch.cuda.Event | None = None  # the copy that last read or wrote `data`

    def claim(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` bytes, once the copy that last used the buffer completed."""
        if self.last_use is not None:
            self.last_use.synchronize()  # already complete in steady state: the slot's last use was a layer ago
            self.last_use = None
        if nbytes > self.data.numel():
            size = -(-nbytes // ALIGN) * ALIGN
            if self.reserved:
                logger.warning("pinned staging %s grows to %.1f MiB: a %d-byte message outgrew the %d bytes reserved "
                               "for the largest one", self.name, size / 2 ** 20, nbytes, self.reserved)
            else:
                logger.info("pinned staging %s grows to %.1f MiB", self.name, size / 2 ** 20)
            self.data = _pinned(size)
        return self.data[:nbytes]


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=nbytes > 0)


class DeviceStaging:
    """Stream-ordered copies between `device` and pinned host buffers, one per slot (micro-batch)
    and direction; on a CPU device every method is a no-copy identity."""

    def __init__(self, device: torch.device | str, slots: int, reserve: StagingBytes | int = 0) -> None:
        """`reserve`: pinned bytes per slot and direction, reserved now (an int: both directions)."""
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        if isinstance(reserve, int):
            reserve = StagingBytes(reserve, reserve)
        self.reserve = reserve
        self.device_outbound: list[torch.Tensor] = []
        self._outgrown = False  # a message outgrew the device send buffer (said once)
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.outbound = [PinnedBuffer(f"to host #{i}", reserve.to_host) for i in range(slots)]
            self.inbound = [PinnedBuffer(f"to device #{i}", reserve.to_device) for i in range(slots)]
        else:  # where rounds are gathered on the CPU: one buffer per slot, grown as needed
            self._landing = [torch.empty(reserve.to_device, dtype=torch.uint8) for _ in range(slots)]
            # Each slot's landing slices by length, made once: a round then lands in the same tensor
            # object as the last round of its size did, so views of it can be kept (`RecordViews`).
            self._landing_slices: list[dict[int, torch.Tensor]] = [{} for _ in range(slots)]

    def send_buffers(self) -> list[torch.Tensor]:
        """The pinned buffers payloads leave from (for the link to register); none on the CPU.
        A buffer that grows past its reservation is a new one, sent from through the
        transport's staging instead."""
        return [buffer.data for buffer in self.outbound] if self.on_cuda else []

    def device_send_buffers(self, link) -> list[torch.Tensor]:
        """Device buffers a round may leave from where `link`'s adapter reads GPU memory
        (GPUDirect RDMA; `to_host(..., device_first=True)`): one per slot, of the outbound
        reservation's size and never grown (a registration covers it for good), made and
        registered with `link` at the first call; none on the CPU or without a reservation."""
        if self.on_cuda and not self.device_outbound and self.reserve.to_host:
            self.device_outbound = [torch.empty(self.reserve.to_host, dtype=torch.uint8, device=self.device)
                                    for _ in self.outbound]
            for buffer in self.device_outbound:
                link.register(buffer)
        return self.device_outbound

    def to_host(self, tensors: Sequence[torch.Tensor], slot: int, device_first: bool = False) -> HostCopy:
        """Copy `tensors` (as the compute stream's launched work leaves them) to slot `slot`'s
        pinned buffer on the copy stream; with `device_first`, the first of them into the slot's
        device send buffer instead (a device-to-device copy on the same stream, under the same
        event: the link's adapter reads it from there), where it fits. The returned views stay
        valid until the next `to_host` on the same slot."""
        if not self.on_cuda:
            return HostCopy(list(tensors))
        flats = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]  # contiguous: on the compute stream
        kept = self._kept_on_device(flats[0].numel(), slot) if device_first and flats else None
        on_device = [] if kept is None else [kept]
        offsets, total = aligned_layout([f.numel() for f in flats[len(on_device):]])
        host = self.outbound[slot].claim(total)
        targets = on_device + [host[b:b + f.numel()] for f, b in zip(flats[len(on_device):], offsets)]
        produced = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(produced)
            for flat, target in zip(flats, targets):
                target.copy_(flat, non_blocking=True)
                # The allocator may hand this memory to the compute stream again only after the copy read it.
                flat.record_stream(self.copy_stream)
            copied = self.copy_stream.record_event()
        self.outbound[slot].last_use = copied
        return HostCopy([target.view(t.dtype).view(t.shape) for t, target in zip(tensors, targets)], copied)

    def _kept_on_device(self, nbytes: int, slot: int) -> torch.Tensor | None:
        """The first `nbytes` of slot `slot`'s device send buffer, or None (through the host,
        said once) where there is none or the message outgrew it."""
        if self.device_outbound and nbytes <= self.device_outbound[slot].numel():
            return self.device_outbound[slot][:nbytes]
        if not self._outgrown:
            self._outgrown = True
            logger.warning("a %d-byte round outgrew the %d-byte device send buffer: it and any other such leave "
                           "from pinned host memory (raise the staging reservation)", nbytes,
                           self.device_outbound[slot].numel() if self.device_outbound else 0)
        return None

    def landing(self, nbytes: int, slot: int) -> torch.Tensor:
        """Host bytes for slot `slot`'s arriving round to be gathered into (a transport round
        copies its payloads there end to end), then `upload`ed: the pinned buffer on CUDA, once
        the copy that last read it completed; a reused host buffer on the CPU."""
        if self.on_cuda:
            return self.inbound[slot].claim(nbytes)
        slices = self._landing_slices[slot]
        if (landed := slices.get(nbytes)) is not None:
            return landed
        if nbytes > self._landing[slot].numel():
            self._landing[slot] = torch.empty(-(-nbytes // ALIGN) * ALIGN, dtype=torch.uint8)
            slices.clear()  # slices of the old buffer
        if len(slices) >= LANDING_SLICES_KEPT:  # a bound on what sizes that come and go keep
            slices.clear()
        landed = slices[nbytes] = self._landing[slot][:nbytes]
        return landed

    def upload(self, host: torch.Tensor, slot: int) -> torch.Tensor:
        """`landing`'s bytes on the device, ordered on the compute stream (on the CPU: `host`
        itself, valid until slot `slot` lands its next round)."""
        if not self.on_cuda:
            return host
        on_device = host.to(self.device, non_blocking=True)
        self.inbound[slot].last_use = torch.cuda.current_stream(self.device).record_event()
        return on_device


class ComputeTimer:
    """Device time spent between `start()` and `stop()` calls, summed; `collect()` (once per
    step) returns it in seconds and starts again. On CUDA each interval is a pair of timing
    events on the compute stream, read only in `collect`, which waits for the last one."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # reused step after step
        self._used = 0
        self._started = 0.0
        self._seconds = 0.0

    def start(self) -> None:
        if not self.on_cuda:
            self._started = time.perf_counter()
            return
        if self._used == len(self._events):
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self._events[self._used][0].record(torch.cuda.current_stream(self.device))

    def stop(self) -> None:
        if not self.on_cuda:
            self._seconds += time.perf_counter() - self._started
            return
        self._events[self._used][1].record(torch.cuda.current_stream(self.device))
        self._used += 1

    def collect(self) -> float:
        if self.on_cuda and self._used:
            self._events[self._used - 1][1].synchronize()  # stream order: every earlier pair is done too
            self._seconds += sum(begin.elapsed_time(end) for begin, end in self._events[:self._used]) / 1e3
            self._used = 0
        seconds, self._seconds = self._seconds, 0.0
        return seconds
