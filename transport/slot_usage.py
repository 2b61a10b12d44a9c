"""An endpoint's slot accounting, for leak checks: the slots its messages hold, on both ends."""

from __future__ import annotations

from dataclasses import dataclass

from transport.errors import PeerClosed

__all__ = ["SlotUsage", "count_slots"]


@dataclass(frozen=True)
class SlotUsage:
    """An endpoint's slots in use, for leak checks: all zero on an idle endpoint."""

    held: int  # messages recv() handed out that the caller has not released yet
    unreleased: int  # messages this endpoint sent whose slot the receiving peer has not released yet
    queued: int = 0  # messages that arrived but recv() has not handed out yet


def count_slots(doorbell, channels, inbox) -> SlotUsage:
    """The slots in use now (`Endpoint.slots_in_use` says when it may be called): credits and
    doorbells that have arrived are taken first, without waiting; a peer found gone on the way
    is dropped from `channels` and keeps the slots it never released."""
    if doorbell is not None:
        doorbell.drain()
    unreleased = 0
    for peer, channel in channels.outbound.items():
        try:
            unreleased += channel.unreleased()
        except PeerClosed as exc:
            channels.drop(peer, exc)
            unreleased += sum(channel.busy)  # shm never raises here: the others keep `busy`
    queued = len(inbox.pending)
    held = sum(channel.outstanding for channel in channels.inbound.values()) - queued
    queued += sum(getattr(channel, "queued", 0) for channel in channels.inbound.values())  # the core's
    return SlotUsage(held=held, unreleased=unreleased, queued=queued)
