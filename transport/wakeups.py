"""What wakes an endpoint that waits, and how it waits for it.

An endpoint waits on one selector: its doorbell (shm peers ring it), its tcp connections'
data and credits, and every control connection (which says something only when it drops).
Each watched socket carries the handler its readiness calls, so this module knows sockets
and deadlines, never channels. A wait spins for `spin_s` first, then sleeps on the selector
in steps of at most MAX_SLEEP_S; peers that signal nothing a selector sees (rdma
completions, nixl notifications) are polled, napping POLLED_NAP_S between looks.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Callable

__all__ = ["MAX_SLEEP_S", "POLLED_NAP_S", "POLLED_SPIN_S", "Wakeups"]

# Longest single sleep: a safety net should a wakeup ever be lost (see transport/shm.py).
MAX_SLEEP_S = 0.05
# Peers that signal nothing a selector sees (rdma completions, nixl notifications) are polled,
# napping POLLED_NAP_S between looks. rdma spins at least POLLED_SPIN_S first: its queues
# progress only while polled. NIXL has a progress thread of its own (transport/nixl.py).
POLLED_SPIN_S = 0.002
POLLED_NAP_S = 0.0002


class Wakeups:
    """An endpoint's selector over its doorbell and connections, and its waits: `block`
    sleeps until something wakes it or a deadline passes, `look` handles what is ready now."""

    def __init__(self, spin_us: float) -> None:
        self._spin_us = spin_us
        self.spin_s = spin_us * 1e-6  # busy-poll this long before sleeping (longer for rdma peers)
        self.max_sleep: float | None = None  # the longest nap while waiting (set by `pace` for polled peers)
        self._selector = selectors.DefaultSelector()

    def pace(self, kinds: set[str]) -> None:
        """How to wait, given the backends of the channels now connected: RDMA completions and
        NIXL notifications do not wake a selector, so with such peers wake often and poll them
        (rdma after a longer spin)."""
        self.max_sleep = POLLED_NAP_S if kinds & {"rdma", "nixl"} else None
        self.spin_s = self._spin_us * 1e-6
        if "rdma" in kinds:
            self.spin_s = max(self.spin_s, POLLED_SPIN_S)

    def watch(self, sock: socket.socket, handler: Callable[[socket.socket], None]) -> None:
        """`handler(sock)` runs whenever `sock` is readable during a wait or a look. A socket
        already watched (one serving both directions of a pair) keeps its first handler."""
        try:
            self._selector.register(sock, selectors.EVENT_READ, handler)
        except KeyError:
            pass

    def unwatch(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):  # not watched (any more), or closed
            pass

    def reset(self) -> None:
        """Forget every watched socket (the channels are going)."""
        self._selector.close()
        self._selector = selectors.DefaultSelector()

    def look(self) -> None:
        """Handles what is ready now, without waiting (notices peers whose connection dropped)."""
        self._handle(self._selector.select(timeout=0))

    def block(self, deadline: float, ready: Callable[[], bool], asleep) -> bool:
        """Sleep until a wakeup (doorbell, socket data, a peer's connection dropping) or the
        deadline; returns ready()'s True if the awaited thing happened before sleeping.

        Shared-memory peers ring only a side that says it is asleep: set the asleep words of
        `asleep`'s shm channels, re-check `ready()` (a message or slot may have landed just
        before), and only then sleep."""
        sleepers = [ch for ch in asleep if ch.kind == "shm"]
        for ch in sleepers:
            ch.set_asleep(True)
        try:
            if ready():
                return True
            self._wait(deadline)
            return False
        finally:
            for ch in sleepers:
                ch.set_asleep(False)

    def _wait(self, deadline: float) -> None:
        timeout = max(0.0, deadline - time.monotonic())
        if self.max_sleep is not None:
            # Polled peers (rdma, nixl): epoll counts whole milliseconds, so a 200 us nap there is
            # 1 ms; look at the sockets without waiting, then nap with nanosleep.
            events = self._selector.select(timeout=0)
            if not events:
                time.sleep(min(timeout, self.max_sleep))
        else:
            events = self._selector.select(timeout=min(timeout, MAX_SLEEP_S))
        self._handle(events)

    @staticmethod
    def _handle(events) -> None:
        for key, _ in events:
            key.data(key.fileobj)
