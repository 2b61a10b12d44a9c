"""Collecting an endpoint's rounds: a message for one micro-batch from each of a set of peers.

In the core (a CoreRound) a collect is one C++ call that spins, then sleeps, until the round
is in or its time slice ends; peers found broken or gone are noted here and the round stops
waiting for them. Otherwise (a MessageRound) the round is one `recv` (or `poll`) per peer.
A peer that fails does not stop the others from arriving; once each has arrived or failed,
the round's messages are released and RoundFailed names every peer that failed.
"""

from __future__ import annotations

import time

import numpy as np

from transport.errors import PeerClosed, PeerTimeout, TransportError
from transport.inbox import Inbox
from transport.peer_channels import PeerChannels
from transport.rounds import Arrivals, CoreRound, MessageRound, RoundTable, round_failed
from transport.wakeups import MAX_SLEEP_S, Wakeups

__all__ = ["RoundCollector"]


class RoundCollector:
    """`Endpoint.collect_round` and `Endpoint.poll_round`; `poll` and `recv` are the
    endpoint's, for rounds that go per message."""

    def __init__(self, spec, table: RoundTable, channels: PeerChannels, inbox: Inbox, wakeups: Wakeups,
                 poll, recv) -> None:
        self.spec = spec
        self.table = table
        self._rounds = table.rounds  # the table's own dict (never replaced): one lookup per collect
        self.channels = channels
        self.inbox = inbox
        self.wakeups = wakeups
        self.poll, self.recv = poll, recv

    def collect(self, peers, micro_batch: int, limit: float | None) -> Arrivals | None:
        """The round, or None where `limit` is None (a poll) and part of it has not arrived."""
        round_ = self._rounds.get(peers) or self.table.round_for(peers)
        if round_.handed_out:
            raise TransportError(f"endpoint {self.spec.name}: the last round from {', '.join(round_.peers)} was not "
                                 "released (Arrivals.release) before the next was collected")
        if round_.partial is not None and round_.partial != micro_batch:
            raise TransportError(f"endpoint {self.spec.name}: micro-batch {round_.partial}'s round from "
                                 f"{', '.join(round_.peers)} is partly collected; collect it before micro-batch "
                                 f"{micro_batch}'s")
        if isinstance(round_, CoreRound):
            if self.inbox.holds_from(peers):
                raise TransportError(f"endpoint {self.spec.name}: messages from {', '.join(round_.peers)} were taken "
                                     "by recv()/poll() and not handed out yet; a round cannot collect them (take "
                                     "them with recv() first, or use rounds alone)")
            round_.partial = micro_batch  # until it completes or fails
            arrivals = self._collect_core(round_, micro_batch, limit)
        else:
            round_.partial = micro_batch
            arrivals = self._collect_each(round_, micro_batch, limit)
        if arrivals is not None:
            round_.partial = None
            round_.handed_out = True
        return arrivals

    def _collect_core(self, round_: CoreRound, micro_batch: int, limit: float | None) -> Arrivals | None:
        native = round_.native
        deadline = None if limit is None else time.monotonic() + limit
        spin, slice_s = (0.0, 0.0) if limit is None else (self.wakeups.spin_s, min(limit, MAX_SLEEP_S))
        while True:
            try:
                missing = native.collect(micro_batch, spin, slice_s)
            except RuntimeError as exc:  # the endpoint was closed (from another thread) during the round
                round_.partial = None
                raise PeerClosed(f"endpoint {self.spec.name}: {exc}") from None
            if native.failed_count or missing:
                if native.closed:  # closed meanwhile: a tcp channel's reads saw its own connection end first
                    round_.partial = None
                    raise PeerClosed(f"endpoint {self.spec.name}: a channel of this round was closed (the endpoint "
                                     "closed)")
                missing = self._note_failures(round_)
            if not missing:
                if native.failed_count:
                    failures = {peer: self.channels.dead_error(peer) for i, peer in enumerate(round_.peers)
                                if not round_.arrived[i]}
                    round_.release()
                    native.clear_failures()
                    round_.partial = None
                    raise round_failed(self.spec.name, "collect", micro_batch, failures)
                return Arrivals(round_.peers, round_.fields, round_)
            if deadline is None:  # a poll: what arrived stays taken
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = [peer for i, peer in enumerate(round_.peers)
                           if not round_.arrived[i] and peer not in self.channels.dead]
                raise PeerTimeout(f"endpoint {self.spec.name}: no message for micro-batch {micro_batch} from "
                                  f"{', '.join(waiting)} within {limit:g} s")
            spin, slice_s = 0.0, min(remaining, MAX_SLEEP_S)

    def _note_failures(self, round_: CoreRound) -> int:
        """Peers of the round that broke the protocol are dropped, peers found gone (a selector
        look) given up: the round waits for neither. Returns how many it still awaits."""
        native = round_.native
        channels = self.channels
        for i in np.flatnonzero(round_.broken):
            peer, channel = round_.peers[i], round_.inbound[i]
            if peer not in channels.dead:
                channels.drop(peer, channel.error(), channel.control if channel.kind == "tcp" else None)
        self.wakeups.look()
        awaited = 0
        for i, peer in enumerate(round_.peers):
            if round_.arrived[i] or round_.broken[i]:
                continue
            if peer in channels.dead:
                native.give_up(i)
            else:
                awaited += 1
        return awaited

    def _collect_each(self, round_: MessageRound, micro_batch: int, limit: float | None) -> Arrivals | None:
        taken = round_.messages or [None] * len(round_.peers)  # a poll may have found part of the round
        round_.messages = taken
        deadline = None if limit is None else time.monotonic() + limit
        failures: dict[str, TransportError] = {}
        slow: list[str] = []
        for i, peer in enumerate(round_.peers):
            if taken[i] is not None:
                continue
            try:
                taken[i] = (self.poll(peer, micro_batch=micro_batch) if deadline is None else
                            self.recv(peer, micro_batch=micro_batch, timeout=max(0.0, deadline - time.monotonic())))
            except PeerTimeout:
                slow.append(peer)
            except PeerClosed as exc:
                failures[peer] = exc
        if failures and all(msg is not None or peer in failures for peer, msg in zip(round_.peers, taken)):
            round_.release()  # every peer has arrived or failed: the round fails as a whole
            round_.partial = None
            raise round_failed(self.spec.name, "collect", micro_batch, failures)
        if slow:
            raise PeerTimeout(f"endpoint {self.spec.name}: no message for micro-batch {micro_batch} from "
                              f"{', '.join(slow)} within {limit:g} s")
        if any(msg is None for msg in taken):
            return None  # a poll: the rest is awaited by the next call (a failed peer is reported then)
        round_.take(taken)
        return Arrivals(round_.peers, round_.fields, round_)
