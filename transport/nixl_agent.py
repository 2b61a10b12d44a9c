"""An endpoint's NIXL agent: every call into NIXL goes through here, under one lock.

One agent per endpoint (transport/backends.py makes it under a lock the first time a peer
pair chooses nixl, and a fresh one for every re-handshake). The endpoint's thread, the
acceptor's handshake threads and this agent's completer thread all call it, so each call
into NIXL, and the state here and in its writes, is taken under `NixlAgent._lock` (NIXL's own
strict sync mode guards NIXL's insides; the lock guards the writes in flight and the teardown).

Writes in flight are `NixlAgent.writes` (transport/nixl_writes.py): posted by the channels,
completed by whoever looks first (the sender, a pump, the completer thread), drained at
teardown.

Teardown (`close`), in this order, because each step frees something a UCX request in
flight may still use (the likely cause, found by reading NIXL's and UCX's teardown, of the
SIGSEGV inside NIXL that a reconnect after a cut link met in about one full-suite run in two
on an AMD host; never reproduced here): wait up to nixl_writes.DRAIN_S for every write in flight
to complete, and release the handles; release the prepared descriptor lists; remove the
remote agents (their rkeys and UCX endpoints); deregister the memory; drop the agent, whose
UCX worker closes its sockets as it goes; only then may the registered memory be freed (a
`weakref.finalize` on NIXL's agent holds it until the agent is gone: a peer's write still
arriving over TCP lands in memory that is still there). A write that does not complete
within it (its link is down) was never cancelled in UCX (UCX cannot cancel an RDMA
write; freeing its request leaves it running on freed rkeys and memory handles): the agent
is then abandoned whole, kept with its memory in `_ABANDONED` for the life of the process,
and the endpoint goes on with a fresh one.
"""

from __future__ import annotations

import logging
import secrets
import struct
import threading
import weakref
from collections import deque

import numpy as np

from transport import nixl_writes
from transport.errors import BackendUnavailable, HandshakeError, PeerClosed
from transport.nixl_writes import NixlWrites
from transport.wire_rules import broke

logger = logging.getLogger(__name__)

NOTIF_DATA, NOTIF_CREDIT = b"D", b"C"
CREDIT_SLOT = struct.Struct("<H")
PROGRESS_THREAD_DELAY_US = 100  # the progress thread's nap between polls of the UCX worker
_ABANDONED: list["NixlAgent"] = []  # agents closed with writes in flight: never freed (see the module docstring)


def api():
    """NIXL's Python module: the `nixl` meta package where installed, else the CUDA 12 build."""
    try:
        import nixl._api as module
    except ImportError:
        import nixl_cu12._api as module
    return module


_CONSTRUCTING = threading.Lock()


def _new_agent(name: str):
    """A NIXL agent with UCX and a progress thread that naps PROGRESS_THREAD_DELAY_US between
    polls. NIXL's Python wrapper hard-codes a delay of 0, a busy-spinning thread: measured on
    this 2-core host a notification then took 6 ms (p50), against 80 us with the nap. The
    wrapper builds its config object and hands it to the binding's agent constructor; that
    one call is intercepted to set the delay."""
    module = api()
    binding = module.nixlBind
    make_agent = binding.nixlAgent

    def with_delay(agent_name, config):
        config.pthrDelay = PROGRESS_THREAD_DELAY_US
        return make_agent(agent_name, config)

    # Strict sync: NIXL guards its own state; NixlAgent._lock guards ours.
    config = module.nixl_agent_config(enable_prog_thread=True, backends=[],  # UCX added below, with its parameters
                                      sync_mode=module.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _CONSTRUCTING:
        binding.nixlAgent = with_delay
        try:
            agent = module.nixl_agent(name, config)
        finally:
            binding.nixlAgent = make_agent
    # No UCX peer-error mode: with it UCX keeps shared memory out of active messages (shm has
    # no peer failure handler), so on one host every notification went over TCP loopback
    # (7.6 us a notification against 2.2 us here). A failed peer is ours to notice: the
    # control connection closes (PeerClosed) and every wait has a deadline (PeerTimeout).
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def available() -> tuple[bool, str]:
    """(True, "") where NIXL imports with a UCX plugin; otherwise (False, the reason)."""
    try:
        api()
    except ImportError:
        return False, 'NIXL is not installed (pip install -e ".[nixl]", which installs nixl-cu12)'
    except OSError as exc:  # a shared library the wheel needs is missing
        return False, f"NIXL does not load ({exc})"
    return True, ""


class NixlAgent:
    """This endpoint's agent: registers regions, knows its peers' agents, sorts notifications
    into per-peer queues (data for inbound channels, credits for outbound ones); its writes in
    flight are `writes`."""

    def __init__(self, endpoint_name: str) -> None:
        ok, reason = available()
        if not ok:
            raise BackendUnavailable(f"nixl: {reason}")
        # Agent names must be unique among the agents that meet: an endpoint name plus a token.
        self.name = f"{endpoint_name}.{secrets.token_hex(4)}"
        try:
            self.agent = _new_agent(self.name)
        except RuntimeError as exc:
            raise BackendUnavailable(f"nixl: cannot start an agent with the UCX backend ({exc})") from None
        if "UCX" not in self.agent.backends:
            raise BackendUnavailable("nixl: the UCX plugin is missing from this NIXL installation")
        self.data: dict[str, deque[bytes]] = {}
        self.credits: dict[str, list[int]] = {}
        self.violations: dict[str, str] = {}  # peer agent -> what its malformed notification was
        self._lock = threading.RLock()  # every call into NIXL, and all the state below and in `writes`
        self.writes = NixlWrites(self.agent, self._lock, self.name)
        self._channels: dict[str, int] = {}  # peer agent -> open channels using it (in and out share one)
        self._loaded: set[str] = set()  # peer agents whose full metadata is loaded (removed only at close)
        self._sources: list[tuple[int, int, object]] = []  # registered send buffers: (start, end, the buffer)
        self._registered: list = []  # descriptor lists of registered memory, deregistered at close
        self._memory: list = []  # the registered tensors: freed only once NIXL's agent is gone
        self._dlists: list = []  # prepared descriptor lists, released at close
        self._closed = False

    # -- set-up (handshake threads) ---------------------------------------------------------
    def _open(self):
        """NIXL's agent; raises where this one is closed (a handshake that outlived connect())."""
        if self._closed:
            raise PeerClosed(f"nixl: agent {self.name} is closed")
        return self.agent

    def add_peer(self, metadata_hex: str, regions_hex: str = "") -> str:
        """Learn a peer's agent from its full metadata the first time; after that only load
        `regions_hex` (partial metadata of newly registered regions, no connection info):
        loading full metadata again re-creates the UCX endpoints and cancels what is in
        flight on them (seen as "UCX AM send failed ... Request canceled" and lost
        notifications)."""
        with self._lock:
            try:
                name, full = self._split(metadata_hex)
                if name not in self._loaded:
                    self._open().add_remote_agent(full)
                    self._loaded.add(name)
                elif regions_hex:
                    self._open().add_remote_agent(bytes.fromhex(regions_hex))
            except ValueError as exc:
                raise HandshakeError(f"nixl: malformed agent metadata ({exc})") from None
            except PeerClosed as exc:
                raise HandshakeError(str(exc)) from None
            self.data.setdefault(name, deque())
            self.credits.setdefault(name, [])
            self._channels[name] = self._channels.get(name, 0) + 1
            return name

    @staticmethod
    def _split(metadata: str) -> tuple[str, bytes]:
        """'name:hex' (see `metadata`) -> (the agent's name, its metadata)."""
        name, sep, body = metadata.partition(":")
        if not sep or not name:
            raise ValueError("no agent name before the metadata")
        return name, bytes.fromhex(body)

    def register_source(self, buffer) -> None:
        """Registers a host buffer messages are sent from (a contiguous CPU torch tensor kept
        alive here), so a send whose payload lies in it is written from it directly, without
        the staging copy."""
        with self._lock:
            start = buffer.data_ptr()
            if any(s <= start < e for s, e, _ in self._sources):
                return
            self.register(buffer)
            self._sources.append((start, start + buffer.numel() * buffer.element_size(), buffer))

    def source_of(self, address: int, length: int) -> bool:
        """True when [address, address + length) lies in a registered send buffer."""
        return any(s <= address and address + length <= e for s, e, _ in self._sources)

    def metadata(self) -> str:
        """This agent's name and full metadata (connection info and every registered region)."""
        with self._lock:
            return f"{self.name}:{self._handshaking().get_agent_metadata().hex()}"

    def region_metadata(self, descs) -> str:
        """Partial metadata: the regions `descs` only, no connection info."""
        with self._lock:
            return self._handshaking().get_partial_agent_metadata(descs, False).hex()

    def register(self, region):
        """Registers `region` (a tensor, kept until NIXL's agent is gone); returns its
        descriptor list (for `region_metadata`)."""
        with self._lock:
            descs = self._handshaking().register_memory(region)
            self._registered.append(descs)
            self._memory.append(region)
            return descs

    def _handshaking(self):
        try:
            return self._open()
        except PeerClosed as exc:
            raise HandshakeError(str(exc)) from None

    def prepare(self, peer_agent: str, rows: np.ndarray, mem_type: str):
        """A prepared descriptor list (NIXL's prep_xfer_dlist) of `rows` (N x 3: address,
        bytes, device): of this agent's memory where `peer_agent` is "", else of that peer's."""
        with self._lock:
            dlist = self._handshaking().prep_xfer_dlist(peer_agent or "NIXL_INIT_AGENT", rows, mem_type)
            self._dlists.append(dlist)
            return dlist

    # -- notifications ------------------------------------------------------------------------
    def pump(self) -> None:
        """Move every notification that has arrived into its peer's queue, and complete the
        writes in flight (at most every nixl_writes.COMPLETE_EVERY_S: every channel's poll pumps)."""
        with self._lock:
            try:
                arrived = self._open().get_new_notifs()
            except Exception as exc:  # nixl's own error types, and a closed agent
                raise PeerClosed(f"nixl: reading notifications failed ({type(exc).__name__}: {exc})") from None
            self.writes.complete_if_due()
        for remote, notes in arrived.items():
            remote = remote.decode() if isinstance(remote, bytes) else remote
            for note in notes:
                kind, body = note[:1], note[1:]
                if kind == NOTIF_DATA:
                    self.data.setdefault(remote, deque()).append(body)
                elif kind == NOTIF_CREDIT and len(body) == CREDIT_SLOT.size:
                    self.credits.setdefault(remote, []).append(CREDIT_SLOT.unpack(body)[0])
                else:  # that agent's channels fail on their next look, no other peer's
                    self.violations.setdefault(remote, f"a malformed {len(note)}-byte notification "
                                                       f"({bytes(note[:16]).hex()}...)")

    def check(self, peer_agent: str, peer: str) -> None:
        """Raises the violation `peer_agent`'s notifications committed, if any."""
        if self.violations and peer_agent in self.violations:
            raise broke(peer, self.violations[peer_agent])

    def notify(self, peer_agent: str, note: bytes) -> None:
        with self._lock:
            try:
                self._open().send_notif(peer_agent, note)
            except Exception as exc:  # nixl's own error types, and a closed agent
                raise PeerClosed(f"nixl: cannot notify agent {peer_agent} ({type(exc).__name__}: {exc})") from None

    # -- teardown -----------------------------------------------------------------------------
    def forget(self, peer_agent: str) -> None:
        """One channel to `peer_agent` closed; its queues go with the last. The peer's agent
        stays loaded until `close` (removing it with a write in flight frees what UCX uses)."""
        with self._lock:
            left = self._channels.get(peer_agent, 0) - 1
            if left > 0:
                self._channels[peer_agent] = left
                return
            self._channels.pop(peer_agent, None)
            self.data.pop(peer_agent, None)
            self.credits.pop(peer_agent, None)
            self.violations.pop(peer_agent, None)

    def close(self) -> None:
        """Tears the agent down in the order the module docstring gives, or abandons it whole
        where writes are still in flight after nixl_writes.DRAIN_S."""
        drained = self.writes.drain()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.writes.stop()
        settled = self.writes.settle()
        if not drained or not settled:
            logger.warning("nixl: agent %s closed with %d writes in flight after %g s (a link is down?): kept with "
                           "its %d registered regions for the life of the process, since UCX may still use them",
                           self.name, self.writes.unsettled(), nixl_writes.DRAIN_S, len(self._memory))
            _ABANDONED.append(self)
            return
        self._destroy()

    def _destroy(self) -> None:
        """The teardown proper, once nothing is in flight."""
        with self._lock:
            agent = self.agent
            for dlist in self._dlists:
                _quietly(agent.release_dlist_handle, dlist)
            for name in self._loaded:
                _quietly(agent.remove_remote_agent, name)
            for descs in self._registered:
                _quietly(agent.deregister_memory, descs)
            # The memory is freed only once NIXL's agent (its UCX worker) is gone: a peer's
            # write still arriving over TCP would otherwise land in freed memory.
            memory, self._memory = self._memory, []
            weakref.finalize(agent.agent, memory.clear)
            self._dlists, self._registered, self._sources = [], [], []
            self.agent = self.writes.api = None


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # nixl's own error types: best effort at teardown, nothing is in flight
        pass
