"""The streams of one API request's n completions read as one, in the order their deltas arrive.

A backend gives each engine request a stream of its own (`RequestStream`); a request with
n > 1 is n engine requests whose deltas interleave on the client's one stream. Each stream
hands its deltas, tagged with its index, to one queue that a thread reads.
"""

from __future__ import annotations

import queue
from functools import partial

from megainfer.messages import RequestDelta
from megainfer.server.backend import RequestStream


class FanIn:
    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._merged: queue.SimpleQueue[tuple[int, RequestDelta]] = queue.SimpleQueue()
        for index, stream in enumerate(streams):
            stream.listen(partial(self._put, index))  # deltas already queued come first

    def _put(self, index: int, delta: RequestDelta) -> None:
        self._merged.put((index, delta))  # unbounded: never blocks the delivering thread

    def get(self, timeout: float) -> tuple[int, RequestDelta] | None:
        """(index of the stream, its next delta), or None when nothing came for `timeout` seconds."""
        try:
            return self._merged.get(timeout=timeout)
        except queue.Empty:
            return None
