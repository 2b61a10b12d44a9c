"""The compiled M2N core (transport/csrc/m2n_core.cpp) as shared-memory channels; its tcp
channels are in transport/core_tcp.py.

The core does per round what transport/shm.py does per message: the same segment layout,
the same state words, doorbells and rules, in C++ with the GIL released, so a round to 32
peers is one call instead of 32 (see `transport.rounds`). Where it drives a channel it owns
that channel's sequence numbers and held slots: `CoreShmOutbound` and `CoreShmInbound` keep
the reference classes' set-up (segment, handshake fields) and interface, so `Endpoint.send`,
`recv` and `poll` work on them unchanged.

Whether an endpoint uses it is `EndpointSpec.core`: "auto" (the core where it is built, the
pure-Python reference otherwise, saying so in a warning with the reason), "on" (fail if it
is not built) or "off" (the reference, as the benchmarks and the tests that compare the two
ask for). The environment variable MEGAINFER_M2N_CORE (auto, on or off) overrides "auto" for
every endpoint of a process: an operator's switch back to the reference, and how the
transport tests run each case on both.
"""

from __future__ import annotations

import logging

from transport.errors import BackendUnavailable, PeerClosed, ProtocolViolation
from transport.shm import ShmInbound, ShmOutbound
from transport.transport_settings import M2N_CORE
from transport.wire import Header
from transport.wire_rules import InboundRules, broke

logger = logging.getLogger(__name__)

CORE_CHOICES = M2N_CORE.choices
CORE_ENV = M2N_CORE.name

try:
    from transport import _m2n_core as native
    BUILD_ERROR = ""
except ImportError as exc:  # not built: pip install compiles it (setup.py); the reference runs instead
    native = None
    BUILD_ERROR = (f"the compiled M2N core is not built ({exc}); reinstall with a C++ compiler present "
                   "(`pip install -e .`, or `python setup.py build_ext --inplace` in the checkout)")

_warned = False


def resolve(wanted: str, endpoint: str) -> bool:
    """Whether endpoint `endpoint` drives its shm, tcp and rdma channels with the core; logged."""
    global _warned
    if wanted not in CORE_CHOICES:
        raise ValueError(f"EndpointSpec.core {wanted!r} is not one of {', '.join(CORE_CHOICES)}")
    source = "core"
    if wanted == "auto" and (forced := M2N_CORE.read()) != "auto":  # a SettingError (ValueError) if bad
        wanted, source = forced, CORE_ENV
    if wanted == "off":
        logger.info("endpoint %s: shm, tcp and rdma channels on the pure-Python reference (%s='off')", endpoint,
                    source)
        return False
    if native is None:
        if wanted == "on":
            raise BackendUnavailable(BUILD_ERROR)
        if not _warned:  # once per process: every endpoint of it says the same
            _warned = True
            logger.warning("M2N: %s; shm, tcp and rdma rounds run on the pure-Python reference, one call per message",
                           BUILD_ERROR)
        return False
    logger.info("endpoint %s: shm, tcp and rdma channels and their rounds in the compiled M2N core (%s)", endpoint,
                native.__file__)
    return True


def demanded(wanted: str) -> bool:
    """Whether the core was asked for outright ("on", in the spec or through the environment):
    then a channel kind the core cannot drive here fails instead of running on the reference."""
    return wanted == "on" or (wanted == "auto" and M2N_CORE.read() == "on")


def violation_error(channel: "CoreShmInbound") -> ProtocolViolation:
    """The channel's violation, in the reference's words (transport/shm.py, wire_rules.py)."""
    code, a, b, fields = channel.core.violation_info()
    peer = channel.peer
    if code == native.BAD_STATE:
        return broke(peer, f"slot {a}'s state word is {b} (0 free, 1 full)")
    if code == native.WRONG_SLOT:
        return broke(peer, f"message seq {fields[7]} for micro-batch {fields[3]} lies in slot {a}, not "
                           f"{fields[3] % channel.num_slots}")
    if code == native.SKIPPED:
        return broke(peer, f"message seq {channel.core.next_seq} never arrived, yet seq {a} did (a message was "
                           "skipped)")
    if code == native.REWRITTEN:
        return broke(peer, f"slot {a} was rewritten while this endpoint held message seq {b} in it")
    rules = InboundRules(peer, channel.rules.sender, channel.slot_bytes, channel.num_slots)
    rules.next_seq = a  # BAD_HEADER: a = the seq that was due
    return rules._refusal(tuple(fields))


class CoreShmOutbound(ShmOutbound):
    """this endpoint -> peer over shm, written by the core (which stamps the sequence numbers)."""

    core_driven = True

    def __init__(self, peer: str, channel_id: int, slot_bytes: int, num_slots: int, doorbell, info: dict, control,
                 rank: int) -> None:
        super().__init__(peer, channel_id, slot_bytes, num_slots, doorbell, info, control)
        self.core = native.OutChannel(self.segment.view, slot_bytes, self.stride, num_slots, rank,
                                      doorbell._out.fileno(), self.peer_doorbell, self.peer_channel)

    def try_send(self, header: Header, payload) -> bool:
        return self.core.try_send(header.step, header.layer, header.micro_batch, header.flags, header.token_count,
                                  payload)

    def close(self) -> None:
        self.core.close()
        super().close()


class CoreOutbound:
    """What a core outbound channel that can fail (tcp's, rdma's) does alike, the core holding
    its slots and sequence numbers: the send and the count of unreleased slots raise the
    channel's failure (`failure()`, each kind's words) once the core recorded one."""

    core = None  # the native channel

    def failure(self):
        raise NotImplementedError

    @property
    def busy(self) -> list[bool]:
        return self.core.busy

    @busy.setter
    def busy(self, value) -> None:  # the reference's constructor sets it; the core keeps its own
        pass

    def try_send(self, header: Header, payload) -> bool:
        if self.core.try_send(header.step, header.layer, header.micro_batch, header.flags, header.token_count,
                              payload):
            return True
        if self.core.failed:
            raise self.failure()
        return False

    def unreleased(self) -> int:
        n = self.core.unreleased()
        if self.core.failed:
            raise self.failure()
        return n


class CoreInbound:
    """What a core inbound channel (shm's, tcp's) does alike, the core holding its sequence and
    slots: its counts, the single-message path's poll and release. `error()` is each kind's
    failure in the reference's words."""

    def error(self) -> PeerClosed:
        raise NotImplementedError

    @property
    def outstanding(self) -> int:
        """Messages handed out and not released (Endpoint.recv's pending ones included)."""
        return self.core.held

    @property
    def queued(self) -> int:
        """Messages the core admitted that nobody has taken yet."""
        return self.core.queued

    def poll(self) -> list[tuple[int, Header]]:
        found = self.core.poll()
        if not found and self.core.violation:  # after the messages that came before it
            raise self.error()
        return [(slot, Header._make(fields)) for slot, fields in found]

    def release(self, slot: int) -> None:
        self.core.release(slot)  # a rule broken meanwhile (shm: a rewritten slot) is raised by the next poll


class CoreShmInbound(CoreInbound, ShmInbound):
    """peer -> this endpoint over shm, read by the core (which holds the sequence and the slots)."""

    core_driven = True

    def bind_peer(self, doorbell: str, channel: int, control) -> None:
        super().bind_peer(doorbell, channel, control)
        self.core = native.InChannel(self.segment.view, self.slot_bytes, self.stride, self.num_slots,
                                     self.rules.sender, self.doorbell._out.fileno(), doorbell, channel)

    def error(self) -> ProtocolViolation:
        return violation_error(self)

    def set_asleep(self, asleep: bool) -> None:
        self.core.set_asleep(asleep)

    def close(self) -> None:
        if hasattr(self, "core"):
            self.core.close()
        super().close()
