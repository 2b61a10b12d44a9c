"""Bad input on the M2N wire: what a listener and an endpoint refuse, and that refusing it costs
no other peer anything.

A stranger or a garbled handshake on the listener is refused and logged while a real peer
still connects. An authenticated peer that then misbehaves (played here from a raw socket that
did the real handshake with the right secret, or by forging bytes into shared memory or NIXL
notifications) has its channel dropped with a `ProtocolViolation` naming what was wrong, while
a well-behaved peer's slots, pending messages and later exchanges keep their exact bytes.
Hypothesis feeds random and mutated byte streams to both doors; deterministic tests cover each
case by name. `slots_in_use()` is checked on every backend that runs here."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from transport import Endpoint, EndpointSpec, PeerClosed, PeerTimeout, SlotUsage
from transport import nixl as nixl_backend
from transport import rdma
from transport.errors import ProtocolViolation
from transport.handshake import authenticate
from transport.selection import Capabilities
from transport.shm import FULL, HEADER_OFFSET, PAYLOAD_OFFSET, SLOTS_OFFSET, STATE
from transport.wire import (CREDIT, CREDIT_MAGIC, HEADER, IMM_CREDIT, IMM_DATA, MAGIC, Hello, recv_json, send_frame,
                            send_json)

pytestmark = pytest.mark.usefixtures("m2n_core")  # shm cases on the compiled core and the reference

SECRET = b"wire-fuzz-secret-0123456789abcdef"
SLOT_BYTES = 256
NUM_SLOTS = 4
BAD_RANK, GOOD_RANK, VICTIM_RANK = 9, 3, 7
NIXL_OK, NIXL_REASON = nixl_backend.available()
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                derandomize=True)


def spec(name: str, rank: int, backend: str = "auto", **kw) -> EndpointSpec:
    return EndpointSpec(name=name, rank=rank, secret=SECRET, backend=backend, slot_bytes=SLOT_BYTES,
                        num_slots=NUM_SLOTS, timeout_s=kw.pop("timeout_s", 10.0), **kw)


def pattern(tag: int, n: int = 200) -> bytes:
    return bytes((tag * 37 + i) % 251 for i in range(n))


def message(seq: int, payload: bytes = b"", *, micro_batch: int | None = None, sender: int = BAD_RANK,
            magic: int = MAGIC, length: int | None = None) -> bytes:
    """A message as the wire carries it: header (wire.HEADER) and payload."""
    mb = seq % NUM_SLOTS if micro_batch is None else micro_batch
    return HEADER.pack(magic, 0, 1, mb, sender, 0, 0, seq, len(payload) if length is None else length) + payload


class RawPeer:
    """A peer named "bad" that holds the secret and does the real handshake from raw sockets,
    then writes whatever a test wants: `to_victim` carries its data into the victim's slots,
    `from_victim` carries the victim's messages to it and its credits back."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.to_victim: socket.socket | None = None
        self.from_victim: socket.socket | None = None

    def connect(self, victim_address: str) -> None:
        accepting = threading.Thread(target=self._accept)
        accepting.start()
        host, port = victim_address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        authenticate(sock, SECRET, initiator=True)
        caps = Capabilities(host="a-host-of-its-own", shm=False, rdma=False, nixl=False)
        send_json(sock, Hello("bad", BAD_RANK, "tcp", 0, "", caps).fields())
        assert recv_json(sock)["ok"]
        self.to_victim = sock
        accepting.join(10)

    def _accept(self) -> None:
        sock, _ = self.listener.accept()
        sock.settimeout(10)
        authenticate(sock, SECRET, initiator=False)
        recv_json(sock)
        send_json(sock, {"ok": True, "name": "bad", "backend": "tcp", "reason": "a test's raw peer",
                         "slot_bytes": SLOT_BYTES, "num_slots": NUM_SLOTS})
        self.from_victim = sock

    def close(self) -> None:
        for sock in (self.to_victim, self.from_victim, self.listener):
            if sock is not None:
                sock.close()


class Trio:
    """A victim endpoint with a well-behaved peer ("good") and a misbehaving one ("bad")."""

    def __init__(self, good_backend: str = "tcp", bad_backend: str | None = None) -> None:
        self.victim = Endpoint(spec("victim", VICTIM_RANK))
        self.good = Endpoint(spec("good", GOOD_RANK, good_backend))
        # bad_backend None: the raw tcp peer; else a real endpoint whose bytes a test forges
        self.bad = RawPeer() if bad_backend is None else Endpoint(spec("bad", BAD_RANK, bad_backend))
        self.sent_by_good = 0
        calls = [(self.victim.connect, {"good": self.good.address, "bad": self.bad.address}),
                 (self.good.connect, {"victim": self.victim.address})]
        calls.append((self.bad.connect, self.victim.address if bad_backend is None else
                      {"victim": self.victim.address}))
        errors: list[BaseException] = []

        def run(call, arg):
            try:
                call(arg)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=c) for c in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        if errors:
            self.close()
            raise errors[0]

    def good_sends(self, count: int) -> list[bytes]:
        """`count` messages from good, each with payload bytes of its own; returns them."""
        payloads = []
        for _ in range(count):
            payloads.append(pattern(100 + self.sent_by_good))
            self.good.send("victim", payloads[-1], micro_batch=self.sent_by_good % NUM_SLOTS)
            self.sent_by_good += 1
        return payloads

    def exchange_with_good(self, rounds: int = 3) -> None:
        """Both directions between victim and good, bytes checked: the victim still serves."""
        for _ in range(rounds):
            [expected] = self.good_sends(1)
            with self.victim.recv("good", timeout=5) as msg:
                assert bytes(msg.data) == expected and msg.header.sender == GOOD_RANK
            self.victim.send("good", expected[::-1], micro_batch=msg.header.micro_batch)
            with self.good.recv("victim", timeout=5) as back:
                assert bytes(back.data) == expected[::-1]

    def close(self) -> None:
        for ep in (self.victim, self.good, self.bad):
            ep.close()


@pytest.fixture
def trio():
    made: list[Trio] = []

    def build(*args, **kwargs) -> Trio:
        made.append(Trio(*args, **kwargs))
        return made[-1]

    yield build
    for t in made:
        t.close()


def until(condition, timeout_s: float = 3.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            return value
        time.sleep(0.005)
    return value


def is_dropped(victim: Endpoint, peer: str = "bad") -> bool:
    """Whether `victim` has dropped `peer` for breaking the protocol (after reading what arrived)."""
    victim.slots_in_use()
    try:
        victim.recv(peer, timeout=0)
    except ProtocolViolation:
        return True
    except PeerTimeout:
        return False
    raise AssertionError(f"a message from {peer}")


def drain_bad(victim: Endpoint, quiet_s: float = 0.15) -> tuple[list, BaseException | None]:
    """Messages the victim accepts from bad (held), and the error that ended them (None: bad
    went quiet)."""
    accepted = []
    while True:
        try:
            accepted.append(victim.recv("bad", timeout=quiet_s))
        except PeerTimeout:
            return accepted, None
        except PeerClosed as exc:
            return accepted, exc


def assert_good_survives(t: Trio, held: list, payloads: list[bytes]) -> None:
    """good's messages the victim held through the trouble keep their bytes; released, the
    victim and good go on exchanging."""
    assert [bytes(m.data) for m in held] == payloads
    for m in held:
        m.release()
    t.exchange_with_good()


# -- the listener --------------------------------------------------------------------------------
def listening(host: Endpoint, peers: dict[str, str]) -> threading.Thread:
    connecting = threading.Thread(target=host.connect, args=(peers,))
    connecting.start()
    return connecting


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]


class RecordingSocket:
    """A socket whose sent bytes are kept: the transcript of one side of a handshake."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sent = sock, bytearray()

    def sendall(self, data) -> None:
        self.sent += data
        self.sock.sendall(data)

    def recv_into(self, *args) -> int:
        return self.sock.recv_into(*args)


def legitimate_transcript(name: str = "bad") -> bytes:
    """What a real peer sends to authenticate and say hello, recorded against another listener
    with the same secret (its proof answers that listener's nonce, not anyone else's)."""
    left, right = socket.socketpair()
    recorder = RecordingSocket(left)
    responder = threading.Thread(target=lambda: (authenticate(right, SECRET, initiator=False), recv_json(right)))
    responder.start()
    authenticate(recorder, SECRET, initiator=True)
    caps = Capabilities(host="h", shm=False, rdma=False, nixl=False)
    send_json(recorder, Hello(name, BAD_RANK, "tcp", 0, "", caps).fields())
    responder.join(5)
    left.close(), right.close()
    return bytes(recorder.sent)


def send_raw(address: str, data: bytes, *, authenticated: bool = False, hello=None) -> bytes:
    """Opens a connection, optionally authenticates with the right secret, sends `data` (or a
    hello frame), ends its side, and returns what came back until the listener closed it."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if authenticated:
            authenticate(sock, SECRET, initiator=True)
        if hello is not None:
            send_frame(sock, hello if isinstance(hello, bytes) else json.dumps(hello).encode())
        answer = bytearray()
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:  # refused (reset, not connected) while bytes were still in flight
            pass
        return bytes(answer)


HELLO = {"name": "bad", "rank": BAD_RANK, "backend": "tcp", "channel": 0, "doorbell": ""}
MALFORMED_HELLOS = {
    "not an object": [1, 2, 3],
    "name missing": {k: v for k, v in HELLO.items() if k != "name"},
    "name not a string": {**HELLO, "name": ["bad"]},
    "name with a slash": {**HELLO, "name": "b/ad"},
    "rank a string": {**HELLO, "rank": "9"},
    "rank a boolean": {**HELLO, "rank": True},
    "rank huge": {**HELLO, "rank": 2 ** 70},
    "rank negative": {**HELLO, "rank": -1},
    "rank a float": {**HELLO, "rank": 9.0},
    "channel huge": {**HELLO, "channel": 10 ** 30},
    "backend unknown": {**HELLO, "backend": "carrier-pigeon"},
    "doorbell a path": {**HELLO, "doorbell": "../../etc/passwd"},
    "unexpected name": {**HELLO, "name": "stranger"},
}


def test_listener_refuses_each_malformed_handshake_and_a_real_peer_still_connects(caplog):
    host = Endpoint(spec("victim", VICTIM_RANK, "tcp"))
    bad = RawPeer()
    try:
        with caplog.at_level(logging.WARNING, logger="transport.peering"):
            connecting = listening(host, {"bad": bad.address})
            cases = {
                "garbage": (b"\x00GET / HTTP/1.1\r\n\r\n" * 4, {}),
                "oversized frame": (struct.pack("<I", 1 << 31) + b"x" * 64, {}),
                "truncated frame": (struct.pack("<I", 32) + b"short", {}),
                "wrong proof": (struct.pack("<I", 32) + bytes(32) + struct.pack("<I", 32) + bytes(32), {}),
                "replayed transcript": (legitimate_transcript(), {}),
                "huge number in JSON": (b"", {"authenticated": True, "hello": b'{"name":"bad","rank":' +
                                              b"9" * 5000 + b"}"}),
                "nested too deep": (b"", {"authenticated": True, "hello": b"[" * 30000 + b"]" * 30000}),
                "not JSON": (b"", {"authenticated": True, "hello": b"\xff\xfe{"}),
                **{name: (b"", {"authenticated": True, "hello": obj}) for name, obj in MALFORMED_HELLOS.items()},
            }
            for name, (data, how) in cases.items():
                before = len(refusals(caplog))
                answer = send_raw(host.address, data, **how)
                assert until(lambda: len(refusals(caplog)) > before), f"{name}: not refused"
                if name == "unexpected name":
                    assert b"is not an expected peer" in answer
                if name == "replayed transcript":
                    assert "failed authentication" in refusals(caplog)[-1]
            assert connecting.is_alive()  # still waiting for its one real peer
            bad.connect(host.address)
            connecting.join(10)
        assert not connecting.is_alive() and set(host.inbound) == {"bad"}
        messages = " | ".join(refusals(caplog))
        for reason in ("refused (limit 65536)", "closed during the handshake", "does not hold the shared secret",
                       "malformed handshake message", "'rank' must be an integer", "'name' must be an endpoint name",
                       "'backend' must be one of", "'doorbell' is not a doorbell name", "'channel' must be an integer",
                       "unexpected or duplicate peer 'stranger'"):
            assert reason in messages, reason
        bad.to_victim.sendall(message(0, b"hello"))
        assert bytes(host.recv("bad", timeout=5).data) == b"hello"
    finally:
        host.close(), bad.close()


def test_a_stalled_handshake_does_not_keep_a_real_peer_waiting():
    host = Endpoint(spec("victim", VICTIM_RANK, "tcp"))
    bad = RawPeer()
    idle = []
    try:
        connecting = listening(host, {"bad": bad.address})
        port = int(host.address.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # connect, then say nothing
        idle[0].sendall(struct.pack("<I", 32) + b"half a nonc")
        time.sleep(0.2)
        start = time.monotonic()
        bad.connect(host.address)
        connecting.join(10)
        assert set(host.inbound) == {"bad"} and time.monotonic() - start < 2.0
    finally:
        for sock in idle:
            sock.close()
        host.close(), bad.close()


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
HELLO_FIELDS = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.text(max_size=300).filter(lambda n: n != "bad"), JSON_VALUES),
    "rank": st.one_of(st.integers(), JSON_VALUES), "channel": st.one_of(st.integers(), JSON_VALUES),
    "backend": st.one_of(st.sampled_from(["auto", "tcp", "shm", "nixl", "rdma", "x"]), JSON_VALUES),
    "doorbell": st.one_of(st.just(""), st.text(max_size=40), JSON_VALUES),
    "host": JSON_VALUES, "shm": JSON_VALUES, "nixl": JSON_VALUES}).filter(lambda hello: hello.get("name") != "bad")


def mutated(transcript: bytes):
    """A legitimate transcript with a few bytes changed, cut short, or both."""
    edits = st.lists(st.tuples(st.integers(0, len(transcript) - 1), st.integers(0, 255)), max_size=4)
    return st.tuples(edits, st.integers(0, len(transcript))).map(
        lambda e: bytes(b for i, b in enumerate(_apply(transcript, e[0])) if i < e[1]))


def _apply(data: bytes, edits) -> bytes:
    out = bytearray(data)
    for at, value in edits:
        out[at] = value
    return bytes(out)


def test_fuzzed_handshakes_never_stop_the_listener(caplog):
    host = Endpoint(spec("victim", VICTIM_RANK, "tcp", timeout_s=60))
    bad = RawPeer()
    transcript = legitimate_transcript()
    try:
        connecting = listening(host, {"bad": bad.address})

        @settings(FUZZ, max_examples=200)
        @given(st.one_of(
            st.binary(max_size=200).map(lambda b: (b, {})),
            st.lists(st.tuples(st.integers(0, (1 << 32) - 1) | st.integers(0, 80), st.binary(max_size=80)),
                     max_size=4).map(lambda frames: (b"".join(struct.pack("<I", n) + body for n, body in frames), {})),
            mutated(transcript).map(lambda b: (b, {})),
            HELLO_FIELDS.map(lambda h: (b"", {"authenticated": True, "hello": h})),
            JSON_VALUES.map(lambda v: (b"", {"authenticated": True, "hello": v})),
        ))
        def garbage_is_refused(case):
            data, how = case
            send_raw(host.address, data, **how)
            assert connecting.is_alive()

        garbage_is_refused()
        bad.connect(host.address)
        connecting.join(10)
        assert set(host.inbound) == {"bad"}
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        bad.to_victim.sendall(message(0, b"after the storm"))
        assert bytes(host.recv("bad", timeout=5).data) == b"after the storm"
    finally:
        host.close(), bad.close()


# -- an authenticated peer that misbehaves on the data connection (tcp) ---------------------------------
DATA_CASES = {
    "wrong magic": ([message(0, b"ok"), message(1, b"x", magic=0xDEADBEEF)], "header magic 0xdeadbeef"),
    "oversized": ([message(0, b"", length=SLOT_BYTES + 1)], f"announces {SLOT_BYTES + 1} payload bytes"),
    "replayed": ([message(0, b"a"), message(1, b"b"), message(1, b"b")],
                 "sequence number 1 where 2 was expected (a replayed"),
    "skipped": ([message(0, b"a"), message(2, b"c")], "sequence number 2 where 1 was expected (a message was skipped"),
    "another sender": ([message(0, b"a", sender=GOOD_RANK)], f"names sender rank {GOOD_RANK}, but the peer announced"),
    "into a held slot": ([message(0, b"a", micro_batch=1), message(1, b"b", micro_batch=1)],
                         "which still holds message seq 0"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
@pytest.mark.parametrize("good_backend", ["tcp", "shm"])
def test_a_misbehaving_peer_is_dropped_alone(trio, case, good_backend):
    stream, reason = DATA_CASES[case]
    t = trio(good_backend)
    held_good = [t.victim.recv("good", timeout=5) for _ in t.good_sends(2)]
    payloads = [pattern(100), pattern(101)]
    t.bad.to_victim.sendall(b"".join(stream))
    accepted, error = drain_bad(t.victim)
    assert isinstance(error, ProtocolViolation) and reason in str(error), error
    assert "its channel is dropped" in str(error)
    if case == "into a held slot":  # the held message was not overwritten: the check came before the read
        assert bytes(accepted[0].data) == b"a"
    with pytest.raises(ProtocolViolation, match="broke the M2N protocol"):  # and stays dropped
        t.victim.recv("bad", timeout=0.1)
    with pytest.raises(ProtocolViolation):
        t.victim.send("bad", b"anything")
    assert t.bad.to_victim.recv(1) == b""  # the victim shut the connection: the peer sees it drop
    assert_good_survives(t, held_good, payloads)
    [payload] = t.good_sends(1)
    with t.victim.recv(timeout=5) as got:  # a wait on any peer goes on with the ones alive
        assert got.peer == "good" and bytes(got.data) == payload


def test_any_peer_wait_skips_the_dropped_peer(trio):
    t = trio()
    t.bad.to_victim.sendall(message(0, b"", magic=1))
    [payload] = t.good_sends(1)
    with t.victim.recv(timeout=5) as msg:
        assert msg.peer == "good" and bytes(msg.data) == payload
    with pytest.raises(ProtocolViolation, match="header magic"):
        t.victim.recv("bad", timeout=1)


def test_a_message_cut_short_by_a_close_is_a_violation(trio):
    t = trio()
    held_good = [t.victim.recv("good", timeout=5) for _ in t.good_sends(1)]
    t.bad.to_victim.sendall(message(0, b"whole") + message(1, b"x" * 100)[:60])
    first = t.victim.recv("bad", timeout=5)
    t.bad.to_victim.close()
    with pytest.raises(ProtocolViolation, match=r"closed in the middle of a message \(28 of 100 payload bytes"):
        t.victim.recv("bad", timeout=5)
    assert bytes(first.data) == b"whole"
    assert_good_survives(t, held_good, [pattern(100)])


@pytest.mark.parametrize("credit, reason", [
    (CREDIT.pack(0x12345678, 0, 0), "magic 0x12345678"),
    (CREDIT.pack(CREDIT_MAGIC, 3, 0), "slot 3 of 4, not in use"),
    (CREDIT.pack(CREDIT_MAGIC, 70, 0), "slot 70 of 4"),
    (CREDIT.pack(CREDIT_MAGIC, 0, 5), "malformed credit frame"),
])
def test_a_malformed_credit_drops_the_peer(trio, credit, reason):
    t = trio()
    t.victim.send("bad", b"to bad", micro_batch=0)
    t.bad.from_victim.sendall(credit)
    assert until(lambda: is_dropped(t.victim))
    with pytest.raises(ProtocolViolation, match=reason):
        t.victim.send("bad", b"more", micro_batch=1)
    t.exchange_with_good()


def test_a_real_credit_frees_the_slot(trio):
    t = trio()
    t.victim.send("bad", b"to bad", micro_batch=2)
    assert t.victim.slots_in_use().unreleased == 1
    t.bad.from_victim.sendall(CREDIT.pack(CREDIT_MAGIC, 2, 0))
    assert until(lambda: t.victim.slots_in_use() == SlotUsage(0, 0, 0))


def model_of_victim(stream: bytes) -> tuple[list[tuple[int, bytes]], str]:
    """What the victim must accept from `stream` while it holds every message: [(seq, payload)]
    and how the stream ends: "violation", "clean" (nothing left over) or "partial"."""
    accepted, held, seq, at = [], set(), 0, 0
    while len(stream) - at >= HEADER.size:
        magic, _, _, mb, sender, _, _, msg_seq, length = HEADER.unpack_from(stream, at)
        if magic != MAGIC or sender != BAD_RANK or length > SLOT_BYTES or msg_seq != seq or mb % NUM_SLOTS in held:
            return accepted, "violation"
        if len(stream) - at - HEADER.size < length:
            return accepted, "partial"
        accepted.append((msg_seq, stream[at + HEADER.size:at + HEADER.size + length]))
        held.add(mb % NUM_SLOTS)
        seq, at = seq + 1, at + HEADER.size + length
    return accepted, "clean" if at == len(stream) else "partial"


FIELD_VALUES = {"seq": st.integers(0, 8) | st.integers(0, (1 << 32) - 1), "magic": st.integers(0, (1 << 32) - 1),
                "sender": st.integers(0, 12) | st.integers(0, 0xFFFF), "micro_batch": st.integers(0, 0xFFFF),
                "length": st.integers(0, 2 * SLOT_BYTES)}


@st.composite
def data_streams(draw):
    """Valid messages edited as a faulty peer would (a message replayed, skipped, reordered, a
    header field changed), then maybe bytes changed, cut, or appended; or bytes at random."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(min_size=1, max_size=300))
    msgs = [{"seq": seq, "micro_batch": mb, "payload": payload} for seq, (mb, payload) in
            enumerate(draw(st.lists(st.tuples(st.integers(0, 7), st.binary(max_size=64)), min_size=1, max_size=5)))]
    for _ in range(draw(st.integers(0, 2))):
        edit, i = draw(st.sampled_from(["replay", "skip", "swap", "field"])), draw(st.integers(0, len(msgs) - 1))
        if edit == "replay":
            msgs.insert(i + 1, dict(msgs[i]))
        elif edit == "skip" and len(msgs) > 1:
            del msgs[i]
        elif edit == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        elif edit == "field":
            field = draw(st.sampled_from(sorted(FIELD_VALUES)))
            msgs[i][field] = draw(FIELD_VALUES[field])
    stream = b"".join(message(m["seq"], m["payload"], micro_batch=m["micro_batch"], sender=m.get("sender", BAD_RANK),
                              magic=m.get("magic", MAGIC), length=m.get("length")) for m in msgs)
    if draw(st.integers(0, 3)) == 0:
        stream = _apply(stream, draw(st.lists(st.tuples(st.integers(0, len(stream) - 1), st.integers(0, 255)),
                                              min_size=1, max_size=3)))
    if draw(st.integers(0, 3)) == 0:
        stream = stream[:draw(st.integers(0, len(stream)))]
    return stream + draw(st.just(b"") | st.binary(max_size=40))


@settings(FUZZ, max_examples=60)
@given(stream=data_streams(), good_backend=st.sampled_from(["tcp", "shm"]))
def test_fuzzed_data_streams_hurt_only_their_sender(stream, good_backend):
    t = Trio(good_backend)
    try:
        held_good = [t.victim.recv("good", timeout=5) for _ in t.good_sends(2)]
        expected, ending = model_of_victim(stream)
        event(f"the stream ends: {ending}")
        t.bad.to_victim.sendall(stream)
        accepted, error = drain_bad(t.victim)
        assert [(m.header.seq, bytes(m.data)) for m in accepted] == expected
        if ending == "violation":
            assert isinstance(error, ProtocolViolation), (ending, error)
        else:
            assert error is None, error
            t.bad.to_victim.close()  # a close after a whole message is a plain close; inside one, a violation
            _, error = drain_bad(t.victim, 2.0)
            assert type(error) is (PeerClosed if ending == "clean" else ProtocolViolation), (ending, error)
        usage = t.victim.slots_in_use()
        assert usage == SlotUsage(held=len(accepted) + 2, unreleased=0, queued=0)
        assert_good_survives(t, held_good, [pattern(100), pattern(101)])
        for m in accepted:
            m.release()
        assert until(lambda: t.victim.slots_in_use() == SlotUsage(0, 0, 0))
    finally:
        t.close()


@st.composite
def credit_streams(draw):
    frames = draw(st.lists(st.one_of(st.tuples(st.just(CREDIT_MAGIC), st.integers(0, 5), st.just(0)),
                                     st.tuples(st.integers(0, (1 << 32) - 1), st.integers(0, 0xFFFF),
                                               st.integers(0, 0xFFFF))), max_size=4))
    stream = b"".join(CREDIT.pack(*f) for f in frames)
    return stream + draw(st.binary(max_size=7))


@settings(FUZZ, max_examples=40)
@given(stream=credit_streams())
def test_fuzzed_credit_streams_hurt_only_their_sender(stream):
    t = Trio()
    try:
        for mb in (0, 1):
            t.victim.send("bad", pattern(mb, 40), micro_batch=mb)
        busy, broken = {0, 1}, False
        for at in range(0, len(stream) - len(stream) % CREDIT.size, CREDIT.size):
            magic, slot, reserved = CREDIT.unpack_from(stream, at)
            if magic != CREDIT_MAGIC or reserved or slot not in busy:
                broken = True
                break
            busy.discard(slot)
        event(f"the credits are {'malformed' if broken else 'valid'}")
        t.bad.from_victim.sendall(stream)
        if broken:
            assert until(lambda: is_dropped(t.victim))
            with pytest.raises(ProtocolViolation):
                t.victim.send("bad", b"x", micro_batch=2)
        else:
            assert until(lambda: t.victim.slots_in_use().unreleased == len(busy))
        t.exchange_with_good()
    finally:
        t.close()


# -- shared memory: a peer that writes anything into its slots ----------------------------------------
def forge(bad: Endpoint, slot: int, *, seq: int, micro_batch: int | None = None, sender: int = BAD_RANK,
          magic: int = MAGIC, length: int = 4, state: int = FULL) -> None:
    """Writes a header (and `length` bytes) into bad's slot `slot` of the victim's segment."""
    out = bad.outbound["victim"]
    base = SLOTS_OFFSET + slot * out.stride
    view = out.segment.view
    view[base + PAYLOAD_OFFSET:base + PAYLOAD_OFFSET + min(length, SLOT_BYTES)] = b"f" * min(length, SLOT_BYTES)
    HEADER.pack_into(view, base + HEADER_OFFSET, magic, 0, 0, slot if micro_batch is None else micro_batch, sender, 0,
                     0, seq, length)
    STATE.pack_into(view, base, state)


SHM_CASES = {
    "wrong magic": (dict(slot=0, seq=0, magic=0x4D324E02), "header magic 0x4d324e02"),
    "oversized": (dict(slot=0, seq=0, length=SLOT_BYTES + 1), f"announces {SLOT_BYTES + 1} payload bytes"),
    "another sender": (dict(slot=0, seq=0, sender=1), "names sender rank 1"),
    "replayed": (dict(slot=0, seq=(1 << 32) - 1), "a replayed or duplicated message"),
    "far ahead": (dict(slot=0, seq=1000), "a message was skipped"),
    "skipped within the slots": (dict(slot=1, seq=1), "message seq 0 never arrived, yet seq 1 did"),
    "wrong slot": (dict(slot=0, seq=0, micro_batch=1), "lies in slot 0, not 1"),
    "state word": (dict(slot=2, seq=0, state=7), "slot 2's state word is 7"),
}


@pytest.mark.parametrize("case", list(SHM_CASES))
def test_shm_peer_writing_anything_is_dropped_alone(trio, case):
    fields, reason = SHM_CASES[case]
    t = trio("shm", bad_backend="shm")
    assert t.victim.backend_of("bad") == "shm" and t.victim.backend_of("good") == "shm"
    held_good = [t.victim.recv("good", timeout=5) for _ in t.good_sends(2)]
    forge(t.bad, **fields)
    accepted, error = drain_bad(t.victim)
    assert not accepted and isinstance(error, ProtocolViolation) and reason in str(error), error
    assert_good_survives(t, held_good, [pattern(100), pattern(101)])
    with pytest.raises(PeerClosed):  # the bad peer sees its connection drop
        until(lambda: t.bad.send("victim", b"x", micro_batch=3, timeout=2) and False, 3)


def test_shm_peer_rewriting_a_held_slot_is_caught_on_release(trio):
    t = trio("shm", bad_backend="shm")
    t.bad.send("victim", b"original", micro_batch=0)
    held = t.victim.recv("bad", timeout=5)
    forge(t.bad, 0, seq=1)  # over the message the victim still holds
    held.release()
    with pytest.raises(ProtocolViolation, match="slot 0 was rewritten while this endpoint held message seq 0"):
        t.victim.recv("bad", timeout=1)
    t.exchange_with_good()


def test_shm_in_sequence_messages_across_slots_are_accepted(trio):
    t = trio("shm", bad_backend="shm")
    for seq in (0, 1, 2):  # written straight into three slots, the later ones first
        forge(t.bad, 2 - seq, seq=2 - seq)
    got = [t.victim.recv("bad", timeout=5) for _ in range(3)]
    assert [m.header.seq for m in got] == [0, 1, 2]
    assert t.victim.slots_in_use() == SlotUsage(held=3, unreleased=0, queued=0)


# -- nixl: forged notifications -----------------------------------------------------------------------
def notify(bad: Endpoint, body: bytes, kind: bytes = nixl_backend.NOTIF_DATA) -> None:
    out = bad.outbound["victim"]
    out.agent.notify(out.peer_agent, kind + body)


@pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON)
def test_nixl_forged_notifications_drop_only_their_sender(trio):
    t = trio("nixl", bad_backend="nixl")
    held_good = [t.victim.recv("good", timeout=5) for _ in t.good_sends(2)]
    t.bad.send("victim", b"legit", micro_batch=0)
    first = t.victim.recv("bad", timeout=5)
    notify(t.bad, HEADER.pack(MAGIC, 0, 0, 0, BAD_RANK, 0, 0, 1, 8))  # data into slot 0, still held
    with pytest.raises(ProtocolViolation, match="slot 0 .* which still holds message seq 0"):
        t.victim.recv("bad", timeout=5)
    assert bytes(first.data) == b"legit"
    first.release()
    assert_good_survives(t, held_good, [pattern(100), pattern(101)])


@pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON)
@pytest.mark.parametrize("body, kind, reason", [
    (HEADER.pack(0x11111111, 0, 0, 0, BAD_RANK, 0, 0, 0, 0), nixl_backend.NOTIF_DATA, "header magic 0x11111111"),
    (b"\x01\x02", b"X", "a malformed 3-byte notification"),
])
def test_nixl_malformed_notification(trio, body, kind, reason):
    t = trio("tcp", bad_backend="nixl")
    notify(t.bad, body, kind)
    with pytest.raises(ProtocolViolation, match=reason):
        t.victim.recv("bad", timeout=5)
    t.exchange_with_good()


# -- rdma: the checks on what a peer wrote, without a device --------------------------------------------
class FakeQueuePair:
    """What RdmaInbound/RdmaOutbound use of a queue pair: a region, queued completions, credits."""

    def __init__(self, num_slots: int = 2) -> None:
        self.stride = rdma.slot_stride(SLOT_BYTES)
        self.view = memoryview(bytearray(rdma.region_bytes(self.stride, num_slots)))
        self.arrived: list[tuple[int, int, int]] = []
        self.credits: list[int] = []

    def completions(self, peer: str):
        out, self.arrived = self.arrived, []
        return out

    def post_credit(self, tag: int) -> None:
        self.credits.append(rdma.unpack_tag(tag)[2])

    def write(self, slot: int, seq: int, *, micro_batch: int | None = None, kind: int = IMM_DATA, **fields) -> None:
        header = {"magic": MAGIC, "sender": BAD_RANK, "length": 3, **fields}
        HEADER.pack_into(self.view, rdma.header_offset(slot, self.stride), header["magic"], 0, 0,
                         slot if micro_batch is None else micro_batch, header["sender"], 0, 0, seq, header["length"])
        self.arrived.append((kind, 0, slot))


def rdma_inbound(qp: FakeQueuePair) -> rdma.RdmaInbound:
    return rdma.RdmaInbound("bad", SLOT_BYTES, 2, qp, control=None, sender=BAD_RANK)


@pytest.mark.parametrize("write, reason", [
    (dict(slot=0, seq=0, magic=7), "header magic 0x00000007"),
    (dict(slot=0, seq=0, sender=2), "names sender rank 2"),
    (dict(slot=0, seq=0, length=SLOT_BYTES + 1), "announces 257 payload bytes"),
    (dict(slot=0, seq=3), "sequence number 3 where 0 was expected"),
    (dict(slot=0, seq=0, micro_batch=1), "tagged for slot 0 carries a header for micro-batch 1"),
    (dict(slot=0, seq=0, kind=IMM_CREDIT), "an immediate of kind 1 for slot 0 on a data channel"),
])
def test_rdma_inbound_refuses_what_the_peer_wrote(write, reason):
    qp = FakeQueuePair()
    qp.write(**write)
    with pytest.raises(ProtocolViolation, match=reason):
        rdma_inbound(qp).poll()


def test_rdma_inbound_holds_slots_and_refuses_a_write_into_a_held_one():
    qp = FakeQueuePair()
    inbound = rdma_inbound(qp)
    qp.write(0, 0)
    qp.write(1, 1)
    assert [(slot, h.seq) for slot, h in inbound.poll()] == [(0, 0), (1, 1)] and inbound.outstanding == 2
    inbound.release(1)
    assert qp.credits == [1] and inbound.outstanding == 1
    qp.write(1, 2)
    qp.write(0, 3)  # slot 0 still holds seq 0: the message before it is handed out, then the refusal
    assert [(slot, h.seq) for slot, h in inbound.poll()] == [(1, 2)]
    with pytest.raises(ProtocolViolation, match="slot 0 .* still holds message seq 0"):
        inbound.poll()


def test_rdma_outbound_counts_unreleased_and_refuses_a_stray_credit():
    qp = FakeQueuePair()
    out = rdma.RdmaOutbound("bad", 0, SLOT_BYTES, 2, qp, control=None)
    out.busy = [True, True]
    qp.arrived = [(IMM_CREDIT, 0, 1)]
    assert out.unreleased() == 1
    qp.arrived = [(IMM_CREDIT, 0, 1)]  # slot 1 is no longer in use
    with pytest.raises(ProtocolViolation, match="credit for a slot in use"):
        out.unreleased()


# -- slot accounting ---------------------------------------------------------------------------------------
BACKENDS = ["shm", "tcp", pytest.param("nixl", marks=pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_in_use_counts_held_and_unreleased_then_returns_to_zero(backend):
    a, b = Endpoint(spec("a", 0, backend)), Endpoint(spec("b", 1, backend))
    try:
        threads = [threading.Thread(target=a.connect, args=({"b": b.address},)),
                   threading.Thread(target=b.connect, args=({"a": a.address},))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        assert a.slots_in_use() == b.slots_in_use() == SlotUsage(0, 0, 0)
        a.send("b", b"one", micro_batch=0)
        a.send("b", b"two", micro_batch=1)
        a.send("b", b"", micro_batch=2)  # header only (over nixl it holds no slot)
        header_only_slots = 0 if backend == "nixl" else 1
        assert a.slots_in_use().unreleased == 2 + header_only_slots
        first = b.recv("a", micro_batch=0, timeout=5)
        assert b.slots_in_use().held == 1
        rest = [b.recv("a", timeout=5) for _ in range(2)]
        assert b.slots_in_use() == SlotUsage(held=3, unreleased=0, queued=0)
        first.release()
        assert b.slots_in_use().held == 2
        assert until(lambda: a.slots_in_use().unreleased == 1 + header_only_slots)
        for m in rest:
            m.release()
        assert b.slots_in_use() == SlotUsage(0, 0, 0)
        assert until(lambda: a.slots_in_use() == SlotUsage(0, 0, 0))
        a.send("b", b"three", micro_batch=3)  # queued: arrived, not handed out yet

        def usage_after_a_look():
            with pytest.raises(PeerTimeout):
                b.recv("a", micro_batch=2, timeout=0.01)  # collects what arrived, hands out nothing
            return b.slots_in_use()
        assert until(lambda: usage_after_a_look() == SlotUsage(0, 0, 1))
    finally:
        a.close(), b.close()
