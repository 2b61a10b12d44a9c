"""Rounds (transport/rounds.py): one call posts to every peer, one collects from every peer, on
the compiled core and on the per-message reference, over shm and tcp; failures per peer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.helpers import connect_all
from transport import (Endpoint, EndpointSpec, PayloadTooLarge, PeerClosed, PeerTimeout, ProtocolViolation,
                       RoundFailed, SlotUsage, TransportError)
from transport import nixl as nixl_backend
from transport.rounds import BYTE_LENGTH, CoreRound, MessageRound, STEP, TOKEN_COUNT
from transport.shm import FULL, HEADER_OFFSET, SLOTS_OFFSET, STATE
from transport.wire import Header

SECRET = b"r" * 32
SLOT = 4096
IDLE = SlotUsage(held=0, unreleased=0, queued=0)


@pytest.fixture
def star():
    """A hub and n spokes, every one connected to the hub; the hub's and the spokes' core chosen apart."""
    made: list[Endpoint] = []

    def build(n: int, backend: str = "shm", hub_core: str = "on", spoke_core: str = "on", timeout_s: float = 5.0,
              slots: int = 2):
        hub = Endpoint(EndpointSpec(name="hub", secret=SECRET, backend=backend, slot_bytes=SLOT, num_slots=slots,
                                    timeout_s=timeout_s, core=hub_core))
        spokes = [Endpoint(EndpointSpec(name=f"s{i}", rank=i + 1, secret=SECRET, backend=backend, slot_bytes=SLOT,
                                        num_slots=slots, timeout_s=timeout_s, core=spoke_core)) for i in range(n)]
        endpoints = {"hub": hub, **{s.spec.name: s for s in spokes}}
        made.extend(endpoints.values())
        connect_all(endpoints, {"hub": [s.spec.name for s in spokes], **{s.spec.name: ["hub"] for s in spokes}})
        return hub, spokes, tuple(s.spec.name for s in spokes)

    yield build
    for ep in made:
        ep.close()


def _payloads(n: int, step: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
    """A buffer holding n payloads of varied length (peer i: i * 37 % 300 bytes, some empty)."""
    sizes = np.array([(i * 37 + step) % 300 for i in range(n)], dtype=np.int64)
    ends = np.cumsum(sizes)
    buffer = torch.tensor([(k * 7 + step) % 251 for k in range(int(ends[-1]) if n else 0)], dtype=torch.uint8)
    return buffer, ends - sizes, ends, sizes // 3


@pytest.mark.parametrize("backend, hub_core, spoke_core", [
    ("shm", "on", "on"), ("shm", "off", "off"), ("shm", "on", "off"), ("shm", "off", "on"),
    ("tcp", "on", "on"), ("tcp", "off", "off"), ("tcp", "on", "off"), ("tcp", "off", "on")])
def test_a_round_delivers_every_peers_bytes_both_ways(star, backend, hub_core, spoke_core):
    n = 5
    hub, spokes, names = star(n, backend, hub_core, spoke_core)
    for step in range(5):  # more rounds than slots: slots are reused after their release
        j = step % 2
        buffer, begins, ends, counts = _payloads(n, step)
        hub.post_round(names, buffer, begins, ends, counts, step=step, layer=3, micro_batch=j)
        answers = []
        for i, spoke in enumerate(spokes):
            with spoke.recv("hub", micro_batch=j) as msg:
                assert bytes(msg.data) == bytes(buffer[begins[i]:ends[i]].numpy())
                assert (msg.header.step, msg.header.layer, msg.header.token_count) == (step, 3, counts[i])
            answers.append(bytes([i + 1]) * (i * 11 + step))
            spoke.send("hub", answers[-1], step=step, layer=3, micro_batch=j, token_count=i)
        arrivals = hub.collect_round(names, micro_batch=j)
        assert arrivals.fields[:, STEP].tolist() == [step] * n
        assert arrivals.token_counts.tolist() == list(range(n))
        assert [bytes(arrivals.payload(i)) for i in range(n)] == answers
        into = torch.full((2000,), 0xEE, dtype=torch.uint8)
        offsets = arrivals.gather_into(into)
        assert bytes(into[:offsets[-1]].numpy()) == b"".join(answers)
        assert offsets.tolist() == np.cumsum([0] + [len(a) for a in answers]).tolist()
        arrivals.release()
    assert isinstance(hub._round_table.round_for(names), CoreRound if hub_core == "on" else MessageRound)
    assert hub.slots_in_use() == IDLE and all(s.slots_in_use() == IDLE for s in spokes)


@pytest.mark.parametrize("hub_core", ["on", "off"])
def test_post_rows_lays_peers_rows_end_to_end(star, hub_core):
    hub, spokes, names = star(3, hub_core=hub_core)
    rows = torch.arange(6 * 8, dtype=torch.uint8).view(6, 8)  # 6 rows of 8 bytes: 1, 0 and 5 to the peers
    hub.post_rows(names, rows[:6], np.array([1, 0, 5]), 8, step=1, layer=2, micro_batch=1)
    got = []
    for spoke in spokes:
        with spoke.recv("hub", micro_batch=1) as msg:
            got.append((msg.header.token_count, bytes(msg.data)))
    flat = bytes(rows.view(-1).numpy())
    assert got == [(1, flat[:8]), (0, b""), (5, flat[8:48])]


@pytest.mark.parametrize("hub_core", ["on", "off"])
def test_poll_round_keeps_what_arrived_and_a_timeout_loses_nothing(star, hub_core):
    hub, spokes, names = star(3, hub_core=hub_core)
    spokes[0].send("hub", b"first", micro_batch=0, token_count=1)
    assert hub.poll_round(names, micro_batch=0) is None
    with pytest.raises(PeerTimeout, match="s1, s2"):
        hub.collect_round(names, micro_batch=0, timeout=0.05)
    spokes[1].send("hub", b"second", micro_batch=0, token_count=2)
    spokes[2].send("hub", b"", micro_batch=0, token_count=3)
    arrivals = hub.poll_round(names, micro_batch=0) or hub.collect_round(names, micro_batch=0, timeout=2)
    assert [bytes(arrivals.payload(i)) for i in range(3)] == [b"first", b"second", b""]
    assert arrivals.byte_lengths.tolist() == [5, 6, 0] and arrivals.token_counts.tolist() == [1, 2, 3]
    arrivals.release()
    assert hub.slots_in_use() == IDLE


NIXL_OK, NIXL_REASON = nixl_backend.available()


@pytest.mark.parametrize("backend, hub_core", [
    ("shm", "on"), ("shm", "off"), ("tcp", "on"),
    pytest.param("nixl", "on", marks=pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON))])
def test_a_peer_that_died_fails_the_round_alone_and_every_slot_is_freed(star, backend, hub_core):
    hub, spokes, names = star(4, backend, hub_core=hub_core)
    for spoke in spokes[:3]:
        spoke.send("hub", b"answer", micro_batch=1, token_count=1)
    spokes[3].close()  # killed mid-round: the others' messages are in
    t0 = time.monotonic()
    with pytest.raises(RoundFailed) as failed:
        hub.collect_round(names, micro_batch=1, timeout=3.0)
    assert time.monotonic() - t0 < 3.0  # the close is seen at once, not at the timeout
    assert list(failed.value.failures) == ["s3"] and failed.value.peers_closed
    assert isinstance(failed.value.failures["s3"], PeerClosed)
    assert hub.slots_in_use().held == 0  # the arrived messages were released with the failure
    # A post to the dead peer fails it alone; the live ones get their message.
    with pytest.raises(RoundFailed) as failed:
        hub.post_round(names, torch.zeros(8, dtype=torch.uint8), [0] * 4, [8] * 4, [1] * 4, micro_batch=0)
    assert list(failed.value.failures) == ["s3"]
    for spoke in spokes[:3]:
        spoke.recv("hub", micro_batch=0).release()


@pytest.mark.parametrize("hub_core", ["on", "off"])
def test_a_peer_holding_its_slot_delays_the_post_and_past_the_timeout_fails_alone(star, hub_core):
    hub, spokes, names = star(2, hub_core=hub_core, slots=1, timeout_s=5.0)
    data = torch.arange(16, dtype=torch.uint8)
    hub.post_round(names, data, [0, 8], [8, 16], [1, 1], micro_batch=0)
    held = spokes[0].recv("hub", micro_batch=0)  # s0 holds its only slot
    spokes[1].recv("hub", micro_batch=0).release()
    releaser = threading.Timer(0.2, held.release)
    t0 = time.monotonic()  # before the start: the release comes 0.2 s after t0 at the earliest
    releaser.start()
    hub.post_round(names, data, [0, 8], [8, 16], [2, 2], micro_batch=0)  # waits for s0's release
    assert time.monotonic() - t0 >= 0.15
    releaser.join()
    spokes[1].recv("hub", micro_batch=0).release()
    still = spokes[0].recv("hub", micro_batch=0)  # held now: the next post cannot reach s0
    with pytest.raises(RoundFailed) as failed:
        hub.post_round(names, data, [0, 8], [8, 16], [3, 3], micro_batch=0, timeout=0.3)
    assert list(failed.value.failures) == ["s0"] and isinstance(failed.value.failures["s0"], PeerTimeout)
    assert spokes[1].recv("hub", micro_batch=0).header.token_count == 3
    still.release()


def test_a_round_refuses_ranges_outside_the_buffer_or_the_slot(star):
    hub, spokes, names = star(2)
    data = torch.zeros(SLOT + 8, dtype=torch.uint8)
    with pytest.raises(PayloadTooLarge, match="outside"):
        hub.post_round(names, data[:16], [0, 8], [8, 24], [1, 1])
    with pytest.raises(PayloadTooLarge, match="slot"):
        hub.post_round(names, data, [0, 0], [8, SLOT + 8], [1, 1])
    with pytest.raises(ValueError, match="contiguous"):
        hub.post_round(names, data.view(2, -1).t(), [0, 0], [1, 1], [1, 1])
    assert hub.slots_in_use() == IDLE  # nothing was written


def test_a_bad_header_in_a_core_round_drops_that_peer_alone(star):
    hub, spokes, names = star(3)
    bad = spokes[1].outbound["hub"]  # s1 maps the segment hub reads its messages from: it can write anything
    base = SLOTS_OFFSET
    Header(0, 0, 0, 99, 0, 1, 0, 4).pack_into(bad.segment.view, base + HEADER_OFFSET)  # rank 99, not s1's 2
    STATE.pack_into(bad.segment.view, base, FULL)
    spokes[0].send("hub", b"ok", micro_batch=0, token_count=1)
    spokes[2].send("hub", b"ok", micro_batch=0, token_count=1)
    with pytest.raises(RoundFailed) as failed:
        hub.collect_round(names, micro_batch=0, timeout=2)
    error = failed.value.failures["s1"]
    assert list(failed.value.failures) == ["s1"] and isinstance(error, ProtocolViolation)
    assert "header names sender rank 99, but the peer announced rank 2" in str(error)
    # The others go on: their next round arrives whole on a round without s1.
    for k in (0, 2):
        spokes[k].send("hub", b"again", micro_batch=1, token_count=2)
    arrivals = hub.collect_round(("s0", "s2"), micro_batch=1, timeout=2)
    assert arrivals.fields[:, BYTE_LENGTH].tolist() == [5, 5] and arrivals.fields[:, TOKEN_COUNT].tolist() == [2, 2]
    arrivals.release()


def test_mismatch_names_the_first_peer_off_the_round(star):
    for hub_core in ("on", "off"):
        hub, spokes, names = star(3, hub_core=hub_core)
        for i, spoke in enumerate(spokes):
            spoke.send("hub", bytes(8 * (i + 1)), step=4, layer=2 if i != 2 else 9, micro_batch=0, token_count=i + 1)
        arrivals = hub.collect_round(names, micro_batch=0)
        assert arrivals.mismatch(4, 2, 8, np.array([1, 2, 3])) == 2  # s2's layer
        assert arrivals.mismatch(-1, 9) == 0 and arrivals.mismatch(4, 2, 8, np.array([1, 5, 3])) == 1
        assert arrivals.mismatch(5, 2) == 0 and arrivals.mismatch(4, 2, 7) == 0  # s0: 8 bytes for 1 row of 7
        arrivals.release()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_closing_the_endpoint_during_a_collect_ends_it_without_a_crash(star, backend):
    """A deployment re-wiring closes a node's endpoint from another thread while its loop waits
    in a round: the wait ends in PeerClosed (the core's shm mapping, and its own duplicate of a
    tcp socket's descriptor, stay until it lets go)."""
    hub, spokes, names = star(2, backend)
    spokes[0].send("hub", b"in", micro_batch=0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            hub.collect_round(names, micro_batch=0, timeout=5.0)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    hub.close()
    waiter.join(3.0)
    assert not waiter.is_alive() and len(errors) == 1 and isinstance(errors[0], PeerClosed), errors


@pytest.mark.parametrize("hub_core", ["on", "off"])
def test_recv_after_a_round_took_a_later_message_gets_the_earlier_one(star, hub_core):
    hub, spokes, names = star(1, hub_core=hub_core)
    spokes[0].send("hub", b"zero", micro_batch=0)
    spokes[0].send("hub", b"one", micro_batch=1)
    arrivals = hub.collect_round(names, micro_batch=1)  # seq 0 stays queued behind it
    assert bytes(arrivals.payload(0)) == b"one"
    arrivals.release()
    with hub.recv("s0", micro_batch=0, timeout=2) as msg:
        assert bytes(msg.data) == b"zero" and msg.header.seq == 0
    assert hub.slots_in_use() == IDLE


@pytest.mark.parametrize("hub_core", ["on", "off"])
def test_a_round_out_of_turn_is_refused_saying_why(star, hub_core):
    hub, spokes, names = star(2, hub_core=hub_core)
    spokes[0].send("hub", b"a", micro_batch=0)
    assert hub.poll_round(names, micro_batch=0) is None  # s0's is taken, s1's awaited
    with pytest.raises(TransportError, match="micro-batch 0's round .* is partly collected"):
        hub.collect_round(names, micro_batch=1, timeout=0.1)
    spokes[1].send("hub", b"b", micro_batch=0)
    arrivals = hub.collect_round(names, micro_batch=0, timeout=2)
    with pytest.raises(TransportError, match="was not released"):
        hub.collect_round(names, micro_batch=1, timeout=0.1)
    arrivals.release()
    assert hub.slots_in_use() == IDLE


def test_a_core_round_refuses_messages_recv_already_took(star):
    hub, spokes, names = star(1)
    spokes[0].send("hub", b"zero", micro_batch=0)
    spokes[0].send("hub", b"one", micro_batch=1)
    hub.recv("s0", micro_batch=0, timeout=2).release()  # takes seq 1 into the endpoint's pending list too
    with pytest.raises(TransportError, match=r"taken by recv\(\)/poll\(\)"):
        hub.collect_round(names, micro_batch=1, timeout=0.1)
    hub.recv("s0", micro_batch=1, timeout=2).release()


@pytest.mark.parametrize("hub_core", ["on", "off"])
def test_a_peer_that_dies_while_others_are_slow_fails_alone_once_they_arrive(star, hub_core):
    hub, spokes, names = star(3, hub_core=hub_core)
    spokes[0].send("hub", b"early", micro_batch=0)
    spokes[1].close()
    late = threading.Timer(0.3, lambda: spokes[2].send("hub", b"late", micro_batch=0))
    late.start()
    with pytest.raises(RoundFailed) as failed:
        hub.collect_round(names, micro_batch=0, timeout=5.0)
    late.join()
    assert list(failed.value.failures) == ["s1"]
    assert hub.slots_in_use().held == 0  # s0's and s2's messages were released with the failure
