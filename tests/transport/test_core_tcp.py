"""The compiled core's tcp channels (transport/core_tcp.py, transport/csrc/tcp_channels.cpp):
what they add to the reference's behaviour, which test_transport.py, test_rounds.py and
test_wire_fuzz.py check on both. A post returns once its bytes are in the kernel or in the
core's queue (the progress thread writes the rest as the peer reads), a close waits for the
queue to drain, a connection that breaks fails its peer alone, and the thread ends with the
endpoint."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from tests.helpers import connect_all
from transport import Endpoint, EndpointSpec, PeerClosed, RoundFailed, SlotUsage
from transport.core import native
from transport.core_tcp import CoreTcpInbound, CoreTcpOutbound
from transport.rounds import CoreRound

SECRET = b"t" * 32
IDLE = SlotUsage(held=0, unreleased=0, queued=0)
BIG = 4 << 20  # far past the 64 KiB socket buffers below: most of it waits in the core's queue

if native is None:
    pytest.fail("the compiled M2N core is not built: pip install builds it", pytrace=False)


@pytest.fixture
def star():
    made: list[Endpoint] = []

    def build(n: int, slot_bytes: int = 4096, slots: int = 2, timeout_s: float = 10.0):
        def spec(name: str, rank: int) -> EndpointSpec:
            return EndpointSpec(name=name, rank=rank, secret=SECRET, backend="tcp", slot_bytes=slot_bytes,
                                num_slots=slots, timeout_s=timeout_s, core="on", tcp_buffer_bytes=64 << 10)
        hub = Endpoint(spec("hub", 0))
        spokes = [Endpoint(spec(f"s{i}", i + 1)) for i in range(n)]
        made.extend([hub, *spokes])
        connect_all({"hub": hub, **{s.spec.name: s for s in spokes}},
                    {"hub": [s.spec.name for s in spokes], **{s.spec.name: ["hub"] for s in spokes}})
        return hub, spokes, tuple(s.spec.name for s in spokes)

    yield build
    for ep in made:
        ep.close()


def _pattern(n: int, seed: int) -> torch.Tensor:
    return torch.tensor(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def test_the_core_drives_tcp_channels_and_their_rounds(star):
    hub, spokes, names = star(2)
    assert all(isinstance(ch, CoreTcpOutbound) for ch in hub.outbound.values())
    assert all(isinstance(ch, CoreTcpInbound) for ch in hub.inbound.values())
    assert isinstance(hub._round_table.round_for(names), CoreRound)


def test_a_post_past_the_socket_buffers_returns_before_any_peer_reads_and_arrives_whole(star):
    hub, spokes, names = star(3, slot_bytes=BIG)
    buffer = _pattern(3 * BIG, 0)
    begins, ends = np.arange(3) * BIG, np.arange(1, 4) * BIG
    t0 = time.monotonic()
    hub.post_round(names, buffer, begins, ends, [1, 2, 3], step=7, micro_batch=1)
    posted_in = time.monotonic() - t0
    sent = bytes(buffer.numpy())
    buffer.zero_()  # the buffer is the caller's again once the post returned
    assert posted_in < 2.0 and hub.backends._progress.active == 3  # no peer read yet: the rest waits in the queues
    for i, spoke in enumerate(spokes):
        with spoke.recv("hub", micro_batch=1, timeout=10) as msg:
            assert (msg.header.step, msg.header.token_count) == (7, i + 1)
            assert bytes(msg.data) == sent[i * BIG:(i + 1) * BIG]
    # Both ways at once: every spoke answers with as much while the hub posts again.
    for spoke in spokes:
        spoke.send("hub", _pattern(BIG, 1), micro_batch=0, token_count=5)
    hub.post_round(names, _pattern(3 * BIG, 2), begins, ends, [4, 4, 4], micro_batch=0)
    arrivals = hub.collect_round(names, micro_batch=0, timeout=10)
    assert arrivals.byte_lengths.tolist() == [BIG] * 3
    assert all(bytes(arrivals.payload(i)) == bytes(_pattern(BIG, 1).numpy()) for i in range(3))
    arrivals.release()
    for spoke in spokes:
        spoke.recv("hub", micro_batch=0, timeout=10).release()
    assert hub.slots_in_use() == IDLE and all(s.slots_in_use() == IDLE for s in spokes)
    assert hub.backends._progress.active == 0  # every queue drained


def test_a_close_right_after_a_post_waits_for_the_queued_bytes_to_leave(star):
    hub, spokes, names = star(1, slot_bytes=BIG)
    data = _pattern(BIG, 3)
    hub.send("s0", data, micro_batch=0)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(bytes(spokes[0].recv("hub", timeout=10).data)))
    reader.start()
    hub.close()  # the peer reads as the close lingers
    reader.join(15)
    assert received == [bytes(data.numpy())]


def test_a_post_to_a_peer_whose_connection_broke_fails_it_alone(star):
    hub, spokes, names = star(3, slots=8)
    spokes[1].close()  # its process gone: the hub's writes meet a reset connection
    failed = None
    for j in range(6):  # the first write after the close may still land in the kernel
        try:
            hub.post_round(names, torch.zeros(24, dtype=torch.uint8), [0, 8, 16], [8, 16, 24], [1, 1, 1],
                           micro_batch=j)
        except RoundFailed as exc:
            failed = exc
            break
    assert failed is not None and list(failed.failures) == ["s1"]
    assert isinstance(failed.failures["s1"], PeerClosed)
    for spoke in (spokes[0], spokes[2]):  # the live ones got every round, the failed one's included
        for k in range(j + 1):
            spoke.recv("hub", micro_batch=k, timeout=5).release()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # the core's threads too, which threading does not see


def test_the_progress_thread_ends_with_the_endpoint():
    before = _threads()
    endpoints = {name: Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, backend="tcp", core="on"))
                 for rank, name in enumerate(("a", "b"))}
    connect_all(endpoints, {"a": ["b"], "b": ["a"]})
    endpoints["a"].send("b", b"x" * 100)
    endpoints["b"].recv("a", timeout=5).release()
    assert endpoints["a"].backends._progress is not None and _threads() > before
    for ep in endpoints.values():
        ep.close()
    assert endpoints["a"].backends._progress is None
    deadline = time.monotonic() + 5  # the acceptors' Python threads end on their own
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() <= before


def test_a_round_waiting_on_a_payload_that_arrives_in_parts_wakes_for_its_last_bytes():
    """The core's channel and round alone, over a loopback connection: a header and the first
    half of its payload, then the rest a moment later. The socket's low-water mark follows what
    the payload still lacks, so the round's poll sees the rest arrive (a mark left at the whole
    payload's size would never be reached: the round waited out its slice)."""
    import socket

    from transport.wire import MAGIC, HEADER

    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    receiver.setblocking(False)
    slots = bytearray(2 * 8192)
    channel = native.TcpInChannel(slots, receiver.fileno(), 8192, 2, 7)
    round_ = native.Round([], [channel], -1, [-1])
    payload = bytes(range(256)) * 24  # 6,144 bytes
    header = HEADER.pack(MAGIC, 3, 1, 0, 7, 0, 2, 0, len(payload))
    try:
        sender.sendall(header + payload[:3000])
        assert round_.collect(0, 0.0, 0.05) == 1  # half of it is in: the channel reads it and waits for the rest
        threading.Timer(0.1, lambda: sender.sendall(payload[3000:])).start()
        t0 = time.monotonic()
        assert round_.collect(0, 0.0, 3.0) == 0
        assert time.monotonic() - t0 < 1.0
        assert bytes(slots[:len(payload)]) == payload and round_.fields()[0, 2] == 1  # layer 1
        round_.release()
    finally:
        for sock in (sender, receiver, server):
            sock.close()
