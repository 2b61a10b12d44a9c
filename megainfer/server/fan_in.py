"""The streams of one API request's n completions read as one, in the order their deltas arrive.

A backend gives each engine request a stream of its own (`RequestStream`); a request with
n > 1 is n engine requests whose deltas interleave on the client's one stream. Each stream's
wake puts its index on one queue; the reading thread pops that stream's next delta.
"""

from __future__ import annotations

import queue
import time
from functools import partial

from megainfer.messages import RequestDelta
from megainfer.server.backend import RequestStream


class FanIn:
    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._merged: queue.SimpleQueue[int] = queue.SimpleQueue()  # unbounded: never blocks the delivering thread
        for index, stream in enumerate(streams):
            stream.listen(partial(self._merged.put, index))  # deltas already queued come first

    def get(self, timeout: float) -> tuple[int, RequestDelta] | None:
        """(index of the stream, its next delta), or None when nothing came for `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                index = self._merged.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return None
            delta = self.streams[index].pop()
            if delta is not None:  # else a delta announced twice (`RequestStream.listen`)
                return index, delta
