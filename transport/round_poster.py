"""Posting an endpoint's rounds: one message to each of a set of peers, from one buffer.

In the core (a CoreRound) a post is one C++ call; peers whose slot was still held are then
waited for here. Otherwise (a MessageRound, or a peer known dead) the round is one `send`
per peer. Either way a peer that fails does not stop the others: RoundFailed names every
peer that did.
"""

from __future__ import annotations

import os
import time

import numpy as np

from transport.errors import PayloadTooLarge, PeerClosed, PeerTimeout, RoundFailed, TransportError
from transport.message import as_bytes
from transport.peer_channels import PeerChannels
from transport.rounds import CoreRound, MessageRound, RoundTable, round_failed, row_ranges, send_span
from transport.wakeups import Wakeups
from transport.wire import check_header_fields

__all__ = ["RoundPoster"]


class RoundPoster:
    """`Endpoint.post_round` and `Endpoint.post_rows`; `send` is the endpoint's, for rounds
    that go per message."""

    def __init__(self, spec, table: RoundTable, channels: PeerChannels, wakeups: Wakeups, send) -> None:
        self.spec = spec
        self.table = table
        self._rounds = table.rounds  # the table's own dict (never replaced): one lookup per post
        self.channels = channels
        self._dead = channels.dead  # likewise the channel set's
        self.wakeups = wakeups
        self.send = send

    def post_round(self, peers, buffer, begins, ends, token_counts, step: int, layer: int, micro_batch: int,
                   flags: int, timeout: float | None, targets=None, mark: int = 0) -> None:
        check_header_fields(step, layer, micro_batch, self.spec.rank, 0)
        limit = self.spec.timeout_s if timeout is None else timeout
        if targets is not None:
            return self._post_targeted(peers, buffer, begins, ends, token_counts, step, layer, micro_batch, flags,
                                       limit, targets, mark)
        if mark:
            raise ValueError(f"post: a mark ({mark}) goes with writes into exposed regions: give `targets`")
        round_ = self._core_round_to_post(peers)
        if round_ is None:
            return self._post_each(peers, buffer, begins, ends, token_counts, step, layer, micro_batch, flags, limit)
        address, nbytes, device = send_span(buffer)
        # the arrays are converted to int64 by the core's binding where they are not already
        self._post_core(round_, micro_batch, limit, round_.native.post, step, layer, micro_batch, flags & 0xFFFF,
                        address, nbytes, begins, ends, token_counts, device)

    def post_rows(self, peers, buffer, token_counts, row_bytes: int, step: int, layer: int, micro_batch: int,
                  flags: int, timeout: float | None, targets=None, mark: int = 0) -> None:
        round_ = None if targets is not None else self._core_round_to_post(peers)
        if round_ is None:
            begins, ends = row_ranges(token_counts, row_bytes)
            return self.post_round(peers, buffer, begins, ends, token_counts, step, layer, micro_batch, flags, timeout,
                                   targets, mark)
        check_header_fields(step, layer, micro_batch, self.spec.rank, 0)
        address, nbytes, device = send_span(buffer)
        self._post_core(round_, micro_batch, self.spec.timeout_s if timeout is None else timeout,
                        round_.native.post_rows, step, layer, micro_batch, flags & 0xFFFF, address, nbytes,
                        token_counts, row_bytes, device)

    def _post_targeted(self, peers, buffer, begins, ends, counts, step, layer, micro_batch, flags, limit,
                       targets, mark) -> None:
        """A post where some peers' bytes go into regions they exposed. Those peers go through
        the core (only its rdma channels write into a region; any other is refused there,
        before a byte moves); the rest as any round goes: in the same core round where every
        live peer's channel is the core's (where none is dead either, the one call any round
        is), else on their own (per message where theirs are not). Peers known dead fail the
        round; the live ones are posted all the same. `mark` (a 32-bit word, 0: none) follows
        each region write of bytes, MARK_LEAD bytes before them."""
        targets = np.asarray(targets, dtype=np.int64)
        if targets.shape != (len(peers),):
            raise ValueError(f"post: one region offset (or -1) per peer, {len(peers)}, not {targets.shape}")
        if not 0 <= mark <= 0xFFFFFFFF:
            raise ValueError(f"post: a mark is a 32-bit word, not {mark}")
        round_ = self._core_round_to_post(peers)
        if round_ is not None:  # every peer alive and the core's, as nearly every round is: one call
            address, nbytes, device = send_span(buffer)
            return self._post_core(round_, micro_batch, limit, round_.native.post, step, layer, micro_batch,
                                   flags & 0xFFFF, address, nbytes, begins, ends, counts, device, targets, mark)
        begins, ends, counts = (np.asarray(a, dtype=np.int64) for a in (begins, ends, counts))
        failures = {peer: self.channels.dead_error(peer) for peer in peers if peer in self._dead}
        live = [i for i, peer in enumerate(peers) if peer not in failures]
        together = live and not isinstance(self.table.round_for(tuple(peers[i] for i in live)), MessageRound)
        groups = [live] if together else [[i for i in live if targets[i] >= 0], [i for i in live if targets[i] < 0]]
        for group in (g for g in groups if g):
            subset, pick = tuple(peers[i] for i in group), np.asarray(group, dtype=np.intp)
            try:
                if (targets[pick] < 0).all():  # no region among them: an ordinary round
                    self.post_round(subset, buffer, begins[pick], ends[pick], counts[pick], step, layer, micro_batch,
                                    flags, limit)
                    continue
                round_ = self._rounds.get(subset) or self.table.round_for(subset)
                if isinstance(round_, MessageRound):
                    raise TypeError(f"endpoint {self.spec.name}: a post into exposed regions goes through the "
                                    f"compiled core's rdma channels, and some of {', '.join(subset)} are not")
                address, nbytes, device = send_span(buffer)
                self._post_core(round_, micro_batch, limit, round_.native.post, step, layer, micro_batch,
                                flags & 0xFFFF, address, nbytes, begins[pick], ends[pick], counts[pick], device,
                                targets[pick], mark)
            except RoundFailed as exc:
                failures |= exc.failures
        if failures:
            raise round_failed(self.spec.name, "post", micro_batch, failures)

    def _core_round_to_post(self, peers) -> CoreRound | None:
        """The core's round to these peers, or None where the post goes per message: channels the
        core does not drive, or a peer known dead (it fails alone and the others are posted, as
        send() does)."""
        round_ = self._rounds.get(peers) or self.table.round_for(peers)
        if isinstance(round_, MessageRound) or self._dead and not self._dead.keys().isdisjoint(peers):
            return None
        return round_

    def _post_core(self, round_: CoreRound, micro_batch: int, limit: float, post, *args) -> None:
        """One call into the core posts the round (`post(*args)`); peers whose slot is still held
        are then waited for."""
        try:
            pending = post(*args)
        except (IndexError, ValueError) as exc:  # a range outside the buffer, or past a peer's slot
            raise PayloadTooLarge(f"endpoint {self.spec.name}: {exc}") from None
        if pending or round_.native.send_failures:
            self._post_pending(round_, micro_batch, limit)

    def _post_each(self, peers, buffer, begins, ends, counts, step, layer, micro_batch, flags, limit) -> None:
        view = as_bytes(buffer)
        failures: dict[str, TransportError] = {}
        for i, peer in enumerate(peers):
            try:
                self.send(peer, view[begins[i]:ends[i]], step=step, layer=layer, micro_batch=micro_batch,
                          token_count=int(counts[i]), flags=flags, timeout=limit)
            except (PeerClosed, PeerTimeout) as exc:
                failures[peer] = exc
        if failures:
            raise round_failed(self.spec.name, "post", micro_batch, failures)

    def _post_pending(self, round_: CoreRound, micro_batch: int, limit: float) -> None:
        """Peers that still held their slot at the post: spin, then sleep, until each frees it,
        dies, or the timeout passes. Peers whose connection broke in the post (tcp) fail now."""
        deadline = time.monotonic() + limit
        spin_until = time.monotonic() + self.wakeups.spin_s
        failures: dict[str, TransportError] = {}
        pending = round_.pending
        while True:
            if round_.native.send_failures:
                self._note_send_failures(round_, failures)
            for i in np.flatnonzero(pending):
                peer = round_.peers[i]
                if peer in self._dead:
                    failures[peer] = self.channels.dead_error(peer)
                    pending[i] = 0
            if not pending.any():
                break
            now = time.monotonic()
            if now >= deadline:
                for i in np.flatnonzero(pending):
                    failures[round_.peers[i]] = PeerTimeout(
                        f"endpoint {self.spec.name}: peer {round_.peers[i]} has not released its slot for micro-batch "
                        f"{micro_batch} within {limit:g} s (it stopped consuming, or died)")
                pending[:] = 0
                break
            if now < spin_until:
                os.sched_yield()
                round_.native.retry()
            else:
                waiting = [round_.outbound[i] for i in np.flatnonzero(pending)]
                self.wakeups.block(deadline, lambda: round_.native.retry() == 0, asleep=waiting)
        if failures:
            raise round_failed(self.spec.name, "post", micro_batch, failures)

    def _note_send_failures(self, round_: CoreRound, failures: dict[str, TransportError]) -> None:
        """The round's channels whose connection broke (tcp): their peers are dropped and fail
        the post."""
        for i, channel in enumerate(round_.outbound):
            peer = round_.peers[i]
            if peer not in failures and channel.core.failed:
                if peer not in self._dead:
                    self.channels.drop(peer, channel.failure(), channel.control)
                failures[peer] = self.channels.dead_error(peer)
