"""The M2N transport: exact delivery over shm and tcp in several M x N shapes, back-pressure,
timeouts, oversize sends, authentication, peer death, and the wire formats."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import socket
import threading
import time

import pytest
import torch

from tests.helpers import connect_all
from transport import (Endpoint, EndpointSpec, HandshakeError, Header, PayloadTooLarge, PeerClosed, PeerTimeout,
                       TransportError)
from transport import nixl as nixl_backend
from transport import rdma as rdma_backend
from transport.handshake import authenticate
from transport.wire import (IMM_CREDIT, IMM_DATA, QPInfo, check_header_fields, pack_tag, recv_frame, send_frame,
                            unpack_tag)

pytestmark = pytest.mark.usefixtures("m2n_core")  # shm cases on the compiled core and the reference

SECRET = b"x" * 32
NIXL_OK, NIXL_REASON = nixl_backend.available()
# Every backend that runs on this machine (rdma needs a verbs device: tests/transport/test_rdma*.py).
BACKENDS = ["shm", "tcp", pytest.param("nixl", marks=pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON))]


@pytest.fixture
def mesh():
    made: list[Endpoint] = []

    def build(backend: str, m: int, n: int, slot_bytes: int = 1 << 16, num_slots: int = 2, timeout_s: float = 10.0):
        senders = {f"a{i}": Endpoint(EndpointSpec(name=f"a{i}", rank=i, secret=SECRET, backend=backend,
                                                  slot_bytes=slot_bytes, num_slots=num_slots, timeout_s=timeout_s))
                   for i in range(m)}
        receivers = {f"e{j}": Endpoint(EndpointSpec(name=f"e{j}", rank=100 + j, secret=SECRET, backend=backend,
                                                    slot_bytes=slot_bytes, num_slots=num_slots, timeout_s=timeout_s))
                     for j in range(n)}
        endpoints = {**senders, **receivers}
        made.extend(endpoints.values())
        connect_all(endpoints, {**{a: list(receivers) for a in senders}, **{e: list(senders) for e in receivers}})
        return senders, receivers

    yield build
    for ep in made:
        ep.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m, n", [(1, 1), (2, 3), (3, 2)])
def test_m2n_exchange_delivers_exact_bytes_and_tags(mesh, backend, m, n):
    senders, receivers = mesh(backend, m, n)
    sizes = [0, 1, 4096, 65536, 0, 777]  # empty messages included

    def payload(a, e, k):
        return bytes((a * 31 + e * 7 + k + i) % 251 for i in range(sizes[k]))

    def expert(j, name, ep, failures):
        try:
            for k in range(len(sizes)):
                got = {}
                for _ in senders:
                    msg = ep.recv(micro_batch=k % 2, timeout=10)
                    got[msg.peer] = msg
                for i, a in enumerate(senders):
                    h = got[a].header
                    assert bytes(got[a].data) == payload(i, j, k)
                    assert (h.layer, h.micro_batch, h.sender, h.token_count, h.step, h.seq) == \
                        (k + 1, k % 2, i, sizes[k] // 8, 7, k)
                    got[a].release()
                    # answer: the weighted sum, here the same bytes reversed
                    ep.send(a, payload(i, j, k)[::-1], layer=k + 1, micro_batch=k % 2, token_count=sizes[k] // 8)
        except BaseException as exc:
            failures.append(exc)

    failures: list = []
    threads = [threading.Thread(target=expert, args=(j, name, ep, failures))
               for j, (name, ep) in enumerate(receivers.items())]
    for t in threads:
        t.start()
    for k in range(len(sizes)):
        for i, ep in enumerate(senders.values()):
            for j, e in enumerate(receivers):
                ep.send(e, payload(i, j, k), step=7, layer=k + 1, micro_batch=k % 2, token_count=sizes[k] // 8)
        for i, ep in enumerate(senders.values()):
            for j, e in enumerate(receivers):
                msg = ep.recv(e, micro_batch=k % 2, timeout=10)
                assert bytes(msg.data) == payload(i, j, k)[::-1]
                assert msg.header.sender == 100 + j
                msg.release()
    for t in threads:
        t.join(20)
    assert not failures, failures
    assert all(ep.backend_of(e) == backend for ep in senders.values() for e in receivers)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_is_reused_only_after_release(mesh, backend):
    senders, receivers = mesh(backend, 1, 1, num_slots=1)
    a, e = senders["a0"], receivers["e0"]
    a.send("e0", b"first")
    msg = e.recv("a0")
    with pytest.raises(PeerTimeout, match="has not released its slot for micro-batch 0"):
        a.send("e0", b"second", timeout=0.3)  # the slot is still held: back-pressure, not overwrite
    assert bytes(msg.data) == b"first"
    msg.release()
    a.send("e0", b"second", timeout=5)
    assert bytes(e.recv("a0").data) == b"second"


def test_zero_copy_view_on_the_slot(mesh):
    senders, receivers = mesh("shm", 1, 1)
    values = torch.arange(256, dtype=torch.float32)
    senders["a0"].send("e0", values)
    msg = receivers["e0"].recv("a0")
    view = msg.tensor(torch.float32)
    assert torch.equal(view, values)
    # The tensor is the slot: a write through it is a write into shared memory.
    view[0] = 42.0
    assert msg.tensor(torch.float32)[0].item() == 42.0
    msg.release()


@pytest.mark.parametrize("backend", BACKENDS)
def test_oversize_payload_is_refused_with_sizes(mesh, backend):
    senders, _ = mesh(backend, 1, 1, slot_bytes=1024)
    with pytest.raises(PayloadTooLarge, match="payload of 2048 bytes exceeds the 1024-byte slot of peer e0"):
        senders["a0"].send("e0", bytes(2048))


@pytest.mark.parametrize("backend", BACKENDS)
def test_receive_timeout_names_the_peer(mesh, backend):
    _, receivers = mesh(backend, 1, 1)
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match="no message from a0 for micro-batch 1 within 0.2 s"):
        receivers["e0"].recv("a0", micro_batch=1, timeout=0.2)
    assert time.monotonic() - start < 2


def test_unknown_peer_and_bad_header_fields(mesh):
    senders, _ = mesh("tcp", 1, 1)
    with pytest.raises(TransportError, match="has no peer 'e9'"):
        senders["a0"].send("e9", b"x")
    with pytest.raises(ValueError, match="layer=70000 does not fit 16 unsigned bits"):
        senders["a0"].send("e0", b"x", layer=70000)


def test_stranger_is_refused_and_the_real_peer_still_connects(caplog):
    host = Endpoint(EndpointSpec(name="e0", secret=SECRET, timeout_s=5))
    real = Endpoint(EndpointSpec(name="a0", secret=SECRET, timeout_s=5))
    stranger = Endpoint(EndpointSpec(name="a0", secret=b"y" * 32, timeout_s=1))
    try:
        with caplog.at_level(logging.WARNING, logger="transport.endpoint"):
            t = threading.Thread(target=lambda: host.connect({"a0": real.address}))
            t.start()
            with pytest.raises((HandshakeError, PeerTimeout)):
                stranger.connect({"e0": host.address})
            real.connect({"e0": host.address})
            t.join(10)
        assert any("refused a connection" in r.message for r in caplog.records)
        real.send("e0", b"hello")
        assert bytes(host.recv("a0").data) == b"hello"
    finally:
        for ep in (host, real, stranger):
            ep.close()


def test_handshake_rejects_wrong_secret_on_both_sides():
    left, right = socket.socketpair()
    errors = {}

    def side(name, sock, secret, initiator):
        try:
            authenticate(sock, secret, initiator)
        except HandshakeError as exc:
            errors[name] = exc

    t = threading.Thread(target=side, args=("right", right, b"b" * 32, False))
    t.start()
    side("left", left, b"a" * 32, True)
    t.join(5)
    assert set(errors) == {"left", "right"}
    left.close(), right.close()


def test_oversized_handshake_frame_is_refused():
    left, right = socket.socketpair()
    left.sendall((1 << 20).to_bytes(4, "little"))
    with pytest.raises(HandshakeError, match="refused"):
        recv_frame(right)
    send_frame(left, b"ok")
    left.close(), right.close()


def _serve_then_die(address_queue, peer_queue, backend):
    ep = Endpoint(EndpointSpec(name="e0", secret=SECRET, backend=backend, timeout_s=10))
    address_queue.put(ep.address)
    ep.connect({"a0": peer_queue.get()})
    ep.recv("a0").release()
    os._exit(0)  # dies without closing anything


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_peer_is_reported_promptly_not_after_the_timeout(backend):
    # spawn, not fork: a fork copies NIXL's and UCX's locks mid-use from this process's earlier
    # agents (their progress threads keep running), and the child's agent then hangs
    ctx = mp.get_context("spawn")
    addresses, peers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve_then_die, args=(addresses, peers, backend))
    proc.start()
    ep = Endpoint(EndpointSpec(name="a0", secret=SECRET, backend=backend, timeout_s=30))
    try:
        peers.put(ep.address)
        ep.connect({"e0": addresses.get(timeout=10)})
        ep.send("e0", b"last words")
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(PeerClosed, match="peer e0 closed its connection"):
            ep.recv("e0")
        assert time.monotonic() - start < 5  # well inside the 30 s timeout
    finally:
        ep.close()


@pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON)
def test_nixl_writes_a_registered_payload_from_where_it_lies(mesh):
    senders, receivers = mesh("nixl", 1, 1, slot_bytes=1 << 16)
    a, e = senders["a0"], receivers["e0"]
    source = torch.arange(4096, dtype=torch.int32)  # 16 KiB the sender declares it sends from
    a.register(source)
    a.send("e0", source[1024:2048], micro_batch=1)
    unregistered = torch.full((256,), 7, dtype=torch.int32)
    a.send("e0", unregistered, micro_batch=0)
    staging = a.outbound["e0"].staging
    stride = a.outbound["e0"].stride
    for mb, expected in ((1, source[1024:2048]), (0, unregistered)):
        msg = e.recv("a0", micro_batch=mb)
        assert torch.equal(msg.tensor(torch.int32), expected)
        msg.release()
    # the registered payload never touched the staging slot; the other one went through it
    assert not staging[stride + 96:stride + 96 + 4096].any()
    assert staging[96:96 + 1024].view(torch.int32).eq(7).all()


@pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON)
def test_nixl_header_only_messages_hold_no_slot(mesh):
    senders, receivers = mesh("nixl", 1, 1, num_slots=1)
    a, e = senders["a0"], receivers["e0"]
    a.send("e0", b"data", micro_batch=0)
    for k in range(5):  # the slot is held (unreleased data), yet headers still go: they occupy none
        a.send("e0", b"", micro_batch=0, layer=k, timeout=2)
    got = [e.recv("a0", timeout=5) for _ in range(6)]
    assert bytes(got[0].data) == b"data" and [m.header.layer for m in got[1:]] == [0, 1, 2, 3, 4]
    with pytest.raises(PeerTimeout, match="has not released its slot"):
        a.send("e0", b"more", micro_batch=0, timeout=0.3)
    for m in got:
        m.release()
    a.send("e0", b"more", micro_batch=0, timeout=5)
    assert bytes(e.recv("a0", timeout=5).data) == b"more"


def test_auto_picks_shm_on_one_host_and_logs_why(mesh, caplog):
    with caplog.at_level(logging.INFO, logger="transport.endpoint"):
        senders, receivers = mesh("auto", 1, 1)
    assert senders["a0"].backend_of("e0") == "shm"
    choice = senders["a0"].choices["e0"]
    assert choice.backend == "shm" and "both ends are on one host" in choice.reason
    assert receivers["e0"].choices["a0"] == choice  # the acceptor decided; the initiator was told
    assert any("a0 -> e0 over shm (both ends are on one host" in r.message for r in caplog.records)


def test_rdma_requested_without_a_device_is_a_clear_error():
    ok, reason = rdma_backend.available()
    if ok:
        pytest.skip("this machine has an RDMA device")
    with pytest.raises(TransportError, match="backend .rdma. requested but unavailable: " + re.escape(reason)):
        Endpoint(EndpointSpec(name="a0", secret=SECRET, backend="rdma"))


def test_header_round_trip_and_magic():
    h = Header(step=5, layer=3, micro_batch=2, sender=9, flags=0, token_count=128, seq=41, byte_length=196608)
    assert Header.unpack_from(h.pack()) == h
    bad = bytearray(h.pack())
    bad[0] ^= 0xFF
    with pytest.raises(HandshakeError, match="bad message header magic"):
        Header.unpack_from(bad)
    with pytest.raises(ValueError, match="token_count"):
        check_header_fields(0, 0, 0, 0, 1 << 32)


def test_rdma_tag_packing_round_trips_and_checks_ranges():
    for kind in (IMM_DATA, IMM_CREDIT):
        for channel, slot in ((0, 0), (16383, 65535), (7, 3)):
            assert unpack_tag(pack_tag(kind, channel, slot)) == (kind, channel, slot)
    with pytest.raises(ValueError):
        pack_tag(IMM_DATA, 1 << 14, 0)
    with pytest.raises(ValueError):
        pack_tag(3, 0, 0)


def test_qp_info_exchange_format():
    info = QPInfo(qp_num=0x1234, psn=0xABCDE, lid=7, port=1, gid_index=3, gid=bytes(range(16)), rkey=0xDEADBEEF,
                  addr=0x7F00_0000_1000, slot_stride=262240)
    packed = info.pack()
    assert len(packed) == 46
    assert QPInfo.unpack(packed) == info
    assert info.gid_text == "0001:0203:0405:0607:0809:0a0b:0c0d:0e0f"
    with pytest.raises(HandshakeError, match="46"):
        QPInfo.unpack(packed[:-1])
