"""The writes in flight of one NIXL agent (transport/nixl_agent.py): posted, completed by
whoever looks first, released, and drained at teardown.

NIXL's UCX backend sends a WRITE's notification only when the initiator sees the write
complete: inside `transfer` where the write completes at once (UCX's shared memory and cma
on one host), otherwise from the `check_xfer_state` that first finds it done (UCX over TCP
or RDMA; measured here with UCX_TLS=tcp: no notification until checked). A posted write is
therefore completed by whoever looks first: the sender's next call on any channel of the
agent (`writing` looks at its own slot, the agent's pump at every write at most every
COMPLETE_EVERY_S), or the completer thread, which looks every COMPLETER_NAP_S while writes
are in flight and sleeps otherwise, so a message moves while its sender computes. A write
found failed is released and its channel told (`NixlOutbound.fail`); the channel raises it
on its next call.

Every call here holds the agent's lock (shared with it: the same RLock guards every call
into NIXL and the state below).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from transport.errors import PeerClosed

__all__ = ["COMPLETER_NAP_S", "COMPLETE_EVERY_S", "DRAIN_S", "NixlWrites"]

COMPLETER_NAP_S = 100e-6  # the completer thread's nap between looks while writes are in flight
COMPLETE_EVERY_S = 50e-6  # `complete_if_due` looks at the writes in flight at most this often (~0.7 us a write)
DRAIN_S = 1.0  # how long `drain` waits for writes in flight (the agent is abandoned after that)


class NixlWrites:
    """The WRITEs an agent posted and NIXL has not settled, keyed by (channel, slot)."""

    def __init__(self, api, lock: threading.RLock, agent_name: str) -> None:
        self.api = api  # NIXL's agent; None once the owner tore it down (nothing here may keep it alive)
        self._lock = lock
        self._wake = threading.Condition(lock)  # the completer's: writes in flight, or stopping
        self._name = agent_name
        self._writes: dict[tuple[object, int], object] = {}  # (channel, slot) -> its write's handle, in flight
        self._stuck: list = []  # handles whose state NIXL could not tell: never released (the agent is abandoned)
        self._completer: threading.Thread | None = None
        self._looked = 0.0  # time.monotonic() of complete_if_due's last look
        self._given_up = False  # a drain timed out: the agent will be abandoned, nothing waits again
        self._stopped = False  # the agent is closed: nothing is posted or looked at again

    # -- posting ------------------------------------------------------------------------------
    def write_prepared(self, channel, slot: int, local, remote, indices: np.ndarray, note: bytes) -> None:
        """Post one WRITE of the prepared blocks `indices` (the same in both lists) with a
        notification; returns once posted (see `_post`)."""
        with self._lock:
            try:
                handle = self._open().make_prepped_xfer("WRITE", local, indices, remote, indices, note)
            except Exception as exc:  # nixl's own error types: the peer is unknown or gone
                raise PeerClosed(f"nixl: cannot write to {channel.peer} ({type(exc).__name__}: {exc})") from None
            self._post(channel, slot, handle)

    def write(self, channel, slot: int, local: tuple[int, int, int], remote: tuple[int, int, int], remote_type: str,
              note: bytes) -> None:
        """Post one WRITE of local host memory (addr, len, device) to the peer's (addr, len,
        device) of `remote_type` (DRAM or VRAM), descriptors made for this call (a payload
        lying anywhere in a registered send buffer); returns once posted."""
        with self._lock:
            api = self._open()
            try:
                handle = api.initialize_xfer("WRITE", api.get_xfer_descs([local], "DRAM"),
                                             api.get_xfer_descs([remote], remote_type), channel.peer_agent, note)
            except Exception as exc:  # nixl's own error types: the peer is unknown or gone
                raise PeerClosed(f"nixl: cannot write to {channel.peer} ({type(exc).__name__}: {exc})") from None
            self._post(channel, slot, handle)

    def _open(self):
        if self._stopped:
            raise PeerClosed(f"nixl: agent {self._name} is closed")
        return self.api

    def _post(self, channel, slot: int, handle) -> None:
        """Start `handle`. Done at once (its notification then sent): released. In flight:
        kept for whoever completes it first (the completer thread is woken)."""
        try:
            state = self.api.transfer(handle)
        except Exception as exc:  # nixl's own error types
            state = f"ERR ({type(exc).__name__}: {exc})"
        if state == "DONE":
            self._release(handle)
        elif state == "PROC":
            self._writes[(channel, slot)] = handle
            if self._completer is None:
                self._completer = threading.Thread(target=self._complete_loop, name=f"nixl-complete-{self._name}",
                                                   daemon=True)
                self._completer.start()
            if len(self._writes) == 1:  # the completer sleeps without a timeout only when none is in flight
                self._wake.notify()
        else:
            self._release(handle)
            raise PeerClosed(f"nixl: a write to {channel.peer} failed to post ({state})")

    # -- completing ---------------------------------------------------------------------------
    def writing(self, channel, slot: int) -> bool:
        """True while `channel`'s write into `slot` is in flight (completing it if it is done)."""
        with self._lock:
            handle = self._writes.get((channel, slot))
            if handle is None:
                return False
            return self._stopped or not self._look(channel, slot, handle)

    def in_flight(self, channel=None) -> int:
        """Writes in flight (of `channel`, or of every channel)."""
        with self._lock:
            return sum(1 for owner, _ in self._writes if channel is None or owner is channel)

    def complete(self) -> int:
        """Completes every write that is done; returns how many are still in flight."""
        with self._lock:
            return self._complete()

    def complete_if_due(self) -> None:
        """`complete`, at most every COMPLETE_EVERY_S (every channel's poll pumps the agent)."""
        with self._lock:
            if self._writes:
                now = time.monotonic()
                if now - self._looked >= COMPLETE_EVERY_S:
                    self._looked = now
                    self._complete()

    def _complete(self) -> int:
        for (channel, slot), handle in list(self._writes.items()):
            self._look(channel, slot, handle)
        return len(self._writes)

    def _look(self, channel, slot: int, handle) -> bool:
        """Checks one write (which sends its notification once done); True once it is over:
        done and released, or failed, released and its channel told."""
        try:
            state = self.api.check_xfer_state(handle)
        except Exception as exc:  # nixl's own error types; NIXL may not have settled the request
            del self._writes[(channel, slot)]
            self._stuck.append(handle)
            channel.fail(PeerClosed(f"nixl: a write to {channel.peer} failed ({type(exc).__name__}: {exc})"))
            return True
        if state == "PROC":
            return False
        del self._writes[(channel, slot)]
        self._release(handle)
        if state != "DONE":
            channel.fail(PeerClosed(f"nixl: a write to {channel.peer} failed (the peer or its link is gone)"))
        return True

    def _release(self, handle) -> None:
        """Releases a write NIXL has settled (done or failed); one NIXL will not release (still
        active in UCX) is kept, never freed."""
        try:
            self.api.release_xfer_handle(handle)
        except Exception:  # nixl's own error types: still active in UCX
            self._stuck.append(handle)

    def release(self, handle) -> None:
        """Releases a handle its caller made and saw complete (transport/bench_floor.py)."""
        with self._lock:
            self._release(handle)

    def _complete_loop(self) -> None:
        """The completer thread: looks at the writes in flight every COMPLETER_NAP_S while
        there are any, sleeps otherwise, ends when the agent closes."""
        with self._lock:
            while not self._stopped:
                if not self._writes:
                    self._wake.wait()
                    continue
                self._complete()
                self._wake.wait(COMPLETER_NAP_S)

    # -- teardown -----------------------------------------------------------------------------
    def drain(self, channel=None) -> bool:
        """Waits up to DRAIN_S (once per agent) for the writes in flight (of `channel`, or all)
        to complete; True when none is left."""
        deadline = time.monotonic() + (0.0 if self._given_up else DRAIN_S)
        while True:
            with self._lock:
                if not self._stopped:
                    self._complete()
                if not any(channel is None or owner is channel for owner, _ in self._writes):
                    return True
            if time.monotonic() >= deadline:
                self._given_up = True  # a link is down: later drains of this agent do not wait again
                return False
            time.sleep(0.001)

    def stop(self) -> None:
        """The agent closes: nothing is posted or looked at again, and the completer ends.
        Called under the agent's lock, as the agent marks itself closed."""
        with self._lock:
            self._stopped = True
            self._wake.notify_all()

    def settle(self) -> bool:
        """After `stop`: waits up to 5 s for the completer thread to end; True when NIXL has
        nothing of this agent's left in flight (no write, no unreleased handle, no completer)."""
        completer = self._completer
        if completer is not None and completer is not threading.current_thread():
            completer.join(5.0)
        return not (self._writes or self._stuck or (completer is not None and completer.is_alive()))

    def unsettled(self) -> int:
        """Writes NIXL may still be working on: in flight, or never released."""
        return len(self._writes) + len(self._stuck)
