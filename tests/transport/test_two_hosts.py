"""M2N between two hosts: two network namespaces joined by a veth (tests/netns.py), one peer
process in each (tests/transport/netns_peer.py), for the tcp and nixl backends:

    a. a 2 x 2 exchange: two initiators in namespace A, two responders in B, messages of 0
       bytes to 4 MiB, two micro-batches in flight, every one checked byte for byte by its
       receiver and its SHA-256 matched with its sender's, answers flowing back;
    b. the link cut while messages flow: every endpoint on both sides fails with PeerTimeout
       or PeerClosed within its timeout_s (3 s) and a small margin, never hangs;
    c. the link back: reconnect() on every endpoint, and a further exchange is exact.

NIXL runs over UCX, which between two processes of one machine writes through
process_vm_writev (cma) even across network namespaces, sending only its small active
messages (NIXL's notifications) over TCP: a cut link then still stops NIXL (no notification
arrives), though its payloads never crossed the link. The peers run with UCX_TLS=tcp and
UCX_NET_DEVICES=<their veth>, and (a) checks the veth's byte counters: every payload crossed
it. `auto` between the namespaces never picks shm (host_id() differs); the choice is logged.
Needs root (skipped otherwise)."""

from __future__ import annotations

import logging
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.netns import Host, TwoHosts, namespaces, two_hosts  # noqa: F401 (two_hosts is a fixture)
from tests.transport.netns_peer import (OUTBOUND, Close, Connect, Connected, Done, EndpointConfig, Exchange, Failed,
                                        Listening, Reconnect, Start, Transferred, decode, encode)
from transport import nixl as nixl_backend
from transport import rdma as rdma_backend

ROOT = Path(__file__).resolve().parents[2]
NIXL_OK, NIXL_REASON = nixl_backend.available()
BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON))]
TIMEOUT_S = 3.0  # every send's and recv's timeout
MARGIN_S = 2.0  # a failure after a cut comes within TIMEOUT_S + MARGIN_S of it
# EndpointSpec.timeout_s, which bounds connect() and reconnect(): the four handshakes start
# four NIXL agents at once (~0.6 s of CPU each), more than 3 s on a small, busy machine.
CONNECT_TIMEOUT_S = 20.0
WAIT_S = 30.0  # the longest the driver waits for any answer: nothing here can hang
KIB, MIB = 1 << 10, 1 << 20
SLOT_BYTES = 4 * MIB
# rounds[r][k]: the size of micro-batch k's messages (two in flight) in round r
ROUNDS = [[0, 1], [17, 256 * KIB], [4 * MIB, 0], [256 * KIB + 3, 4 * MIB], [4096, 100]]
INITIATORS, RESPONDERS = ("a0", "a1"), ("e0", "e1")
PEER_ERRORS = ("PeerTimeout", "PeerClosed")
PEER_ARGV = [sys.executable, "-m", "tests.transport.netns_peer"]
log = logging.getLogger(__name__)
made_namespaces: list[str] = []


def ucx_env(host: Host) -> dict[str, str]:
    """UCX over TCP on the veth only: left to itself, UCX moves bytes between two processes of
    one machine through shared memory or process_vm_writev (cma), which no link cut stops."""
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.device}


class PeerProcess:
    """One tests.transport.netns_peer in a namespace: commands in, every answer kept with the
    time.monotonic() it arrived at."""

    def __init__(self, net: TwoHosts, host: Host, stderr_path: Path) -> None:
        self.host = host
        env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **ucx_env(host)}
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")
        self.proc = net.run(host, PEER_ARGV, env=env, cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.answers: list[tuple[float, object]] = []
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True, name=f"read-{host.netns}").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                answer = decode(line, OUTBOUND)
            except (ValueError, KeyError, TypeError) as exc:  # kept, and shown should a wait fail
                answer = f"unparsable line {line!r} ({exc})"
            with self._cond:
                self.answers.append((time.monotonic(), answer))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def send(self, command) -> None:
        self.proc.stdin.write(encode(command) + "\n")
        self.proc.stdin.flush()

    def mark(self) -> int:
        with self._cond:
            return len(self.answers)

    def wait(self, ready, since: int = 0, timeout: float = WAIT_S, what: str = "") -> list[tuple[float, object]]:
        """Waits until `ready(answers since the mark)` is true; fails (never hangs) after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ready([a for _, a in self.answers[since:]]):
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    why = "exited" if self._eof else f"did not answer within {timeout:g} s"
                    raise AssertionError(f"peer in {self.host.netns} {why} waiting for {what}; answers: "
                                         f"{[a for _, a in self.answers[since:]][-8:]}; stderr: {self.stderr_tail()}")
                self._cond.wait(min(left, 0.5))
            return self.answers[since:]

    def stderr_tail(self, n: int = 3000) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()[-n:]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send(Close())
                self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass  # two_hosts kills it
        self._stderr.close()


def finished(endpoints, tag: str):
    """ready() for `wait`: every endpoint answered done or failed for `tag`."""
    def ready(answers) -> bool:
        return {a.endpoint for a in answers if isinstance(a, (Done, Failed)) and a.tag == tag} >= set(endpoints)
    return ready


class Pair:
    """Both peers: initiators a0, a1 in namespace A, responders e0, e1 in B, all connected."""

    def __init__(self, net: TwoHosts, backend: str, tmp_path: Path) -> None:
        self.net, self.backend = net, backend
        self.a = PeerProcess(net, net.a, tmp_path / "peer-a.log")
        self.b = PeerProcess(net, net.b, tmp_path / "peer-b.log")
        secret = secrets.token_hex(32)
        for proc, names, role, rank0 in ((self.a, INITIATORS, "initiator", 0), (self.b, RESPONDERS, "responder", 100)):
            proc.send(Start([EndpointConfig(n, rank0 + i, role, f"{proc.host.address}:0", backend, SLOT_BYTES, 2,
                                            CONNECT_TIMEOUT_S, TIMEOUT_S) for i, n in enumerate(names)], secret))
        self.listening: dict[str, Listening] = {}
        for proc in (self.a, self.b):
            _, listening = proc.wait(lambda ans: any(isinstance(x, Listening) for x in ans), what="listening")[0]
            assert isinstance(listening, Listening), listening
            self.listening[proc.host.netns] = listening
        self.addresses = {**self.listening[net.a.netns].addresses, **self.listening[net.b.netns].addresses}
        self.a.send(Connect({a: {e: self.addresses[e] for e in RESPONDERS} for a in INITIATORS}))
        self.b.send(Connect({e: {a: self.addresses[a] for a in INITIATORS} for e in RESPONDERS}))
        self.connected = self._await_connected(0, 0, "connect")

    def _await_connected(self, mark_a: int, mark_b: int, tag: str) -> dict[str, Connected]:
        out: dict[str, Connected] = {}
        for proc, mark, names in ((self.a, mark_a, INITIATORS), (self.b, mark_b, RESPONDERS)):
            for _, ans in proc.wait(lambda ans: {x.endpoint for x in ans if isinstance(x, (Connected, Failed))
                                                 and getattr(x, "tag", tag) == tag} >= set(names),
                                    since=mark, what=tag):
                if isinstance(ans, Failed):
                    raise AssertionError(f"{tag} failed: {ans}; stderr: {proc.stderr_tail()}")
                if isinstance(ans, Connected):
                    out[ans.endpoint] = ans
        return out

    def reconnect(self) -> dict[str, Connected]:
        marks = self.a.mark(), self.b.mark()
        self.a.send(Reconnect())
        self.b.send(Reconnect())
        return self._await_connected(*marks, "reconnect")

    def start_exchange(self, tag: str, rounds: list[list[int]], seed: int) -> tuple[int, int]:
        marks = self.a.mark(), self.b.mark()
        for proc in (self.b, self.a):
            proc.send(Exchange(tag, seed, rounds))
        return marks

    def exchange(self, tag: str, rounds: list[list[int]], seed: int) -> None:
        """Runs an exchange and checks it: every endpoint done, every message received, and
        each message's SHA-256 the same at its sender and its receiver."""
        marks = self.start_exchange(tag, rounds, seed)
        answers = []
        for proc, mark, names in ((self.a, marks[0], INITIATORS), (self.b, marks[1], RESPONDERS)):
            got = [a for _, a in proc.wait(finished(names, tag), since=mark, what=f"exchange {tag}")]
            failures = [a for a in got if isinstance(a, Failed) and a.tag == tag]
            assert not failures, f"exchange {tag}: {failures}; stderr: {proc.stderr_tail()}"
            answers += [a for a in got if isinstance(a, Transferred) and a.tag == tag]
        sent = {(a.endpoint, a.peer, a.round, a.micro_batch): (a.size, a.sha256) for a in answers if a.op == "sent"}
        received = {(a.peer, a.endpoint, a.round, a.micro_batch): (a.size, a.sha256) for a in answers
                    if a.op == "received"}
        expected = {(src, dst, r, k) for r, sizes in enumerate(rounds) for k in range(len(sizes))
                    for src, dst in [(x, y) for x in INITIATORS for y in RESPONDERS] +
                    [(y, x) for x in INITIATORS for y in RESPONDERS]}
        assert set(sent) == expected and set(received) == expected
        assert received == sent  # sizes and SHA-256 match, both directions
        assert {size for size, _ in sent.values()} >= {s for sizes in rounds for s in sizes}

    def check_backends(self, connected: dict[str, Connected], backend: str) -> None:
        assert set(connected) == set(INITIATORS + RESPONDERS)
        for name, c in connected.items():
            peers = RESPONDERS if name in INITIATORS else INITIATORS
            assert set(c.outbound) == set(peers) == set(c.inbound) == set(c.choices), c
            assert set(c.outbound.values()) == set(c.inbound.values()) == {backend}, c
            assert {choice[0] for choice in c.choices.values()} == {backend}, c
            for peer, (kind, reason) in c.choices.items():
                log.info("%s <-> %s over %s (%s)", name, peer, kind, reason)

    def close(self) -> None:
        for proc in (self.a, self.b):
            proc.close()


@pytest.fixture
def pair_of(two_hosts, tmp_path):  # noqa: F811 (two_hosts: the fixture imported above)
    made_namespaces.extend([two_hosts.a.netns, two_hosts.b.netns])
    pairs: list[Pair] = []

    def build(backend: str) -> Pair:
        pairs.append(Pair(two_hosts, backend, tmp_path))
        return pairs[-1]

    yield build
    for p in pairs:
        p.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_2x2_exchange_across_two_hosts_is_exact_both_ways(pair_of, backend):
    pair = pair_of(backend)
    listening = list(pair.listening.values())
    assert listening[0].host != listening[1].host  # two namespaces: two hosts to M2N
    assert all(ls.env.get("UCX_TLS") == "tcp" for ls in listening)
    pair.check_backends(pair.connected, backend)
    sent_before = {h.netns: pair.net.bytes_sent(h) for h in (pair.net.a, pair.net.b)}
    pair.exchange("2x2", ROUNDS, seed=1)
    pair.exchange("2x2-again", ROUNDS[::-1], seed=2)  # the same channels, their slots reused
    # Every payload crossed the veth, each way (UCX took no shared-memory shortcut).
    payload_bytes = 2 * len(INITIATORS) * len(RESPONDERS) * sum(map(sum, ROUNDS))  # two exchanges
    for h in (pair.net.a, pair.net.b):
        assert pair.net.bytes_sent(h) - sent_before[h.netns] >= payload_bytes, h


@pytest.mark.parametrize("backend", BACKENDS)
def test_link_down_fails_both_sides_within_the_timeout_and_reconnect_recovers(pair_of, backend):
    pair = pair_of(backend)
    pair.check_backends(pair.connected, backend)
    pair.exchange("before", ROUNDS, seed=3)

    # (b) cut the link while 256 KiB and 4 MiB messages flow both ways
    flowing = [[256 * KIB, 4 * MIB]] * 100_000
    marks = pair.start_exchange("flowing", flowing, seed=4)
    for proc, mark in zip((pair.a, pair.b), marks):
        proc.wait(lambda ans: any(isinstance(x, Transferred) and x.op == "received" and x.round >= 2 for x in ans)
                  or any(isinstance(x, Failed) for x in ans), since=mark, what="messages flowing")
    cut = time.monotonic()
    pair.net.link_down()
    failures: dict[str, tuple[float, Failed]] = {}
    for proc, mark, names in ((pair.a, marks[0], INITIATORS), (pair.b, marks[1], RESPONDERS)):
        for arrived, ans in proc.wait(finished(names, "flowing"), since=mark, timeout=TIMEOUT_S + MARGIN_S + 5,
                                      what="the failures after the cut"):
            if isinstance(ans, (Done, Failed)) and ans.tag == "flowing":
                failures[ans.endpoint] = (arrived, ans)
    for name, (arrived, ans) in sorted(failures.items()):
        log.info("%s failed %.2f s after the cut: %s: %s", name, ans.at - cut if isinstance(ans, Failed) else -1,
                 getattr(ans, "error_type", "done"), getattr(ans, "error", ""))
    assert set(failures) == set(INITIATORS + RESPONDERS)
    for name, (arrived, ans) in failures.items():
        assert isinstance(ans, Failed), f"{name} finished 100 000 rounds with the link down: {ans}"
        assert ans.error_type in PEER_ERRORS, ans
        assert cut <= ans.at <= cut + TIMEOUT_S + MARGIN_S, (ans.at - cut, ans)
        assert arrived <= cut + TIMEOUT_S + MARGIN_S + 0.5, (arrived - cut, ans)
        other = "|".join(RESPONDERS if name in INITIATORS else INITIATORS)
        if ans.error_type == "PeerTimeout":  # names itself, the peer it waited for and the limit
            assert re.fullmatch(rf"endpoint {name}: (peer ({other}) .*|no message from ({other}) .*)within "
                                rf"{TIMEOUT_S:g} s( \(.*\))?", ans.error), ans
        else:
            assert re.search(rf"peer ({other})", ans.error), ans

    # (c) the link back: every endpoint reconnects, and the exchange is exact again
    pair.net.link_up()
    reconnected = pair.reconnect()
    pair.check_backends(reconnected, backend)
    pair.exchange("after", ROUNDS, seed=5)
    pair.exchange("after-again", ROUNDS[::-1], seed=6)


def test_auto_between_two_hosts_never_chooses_shm(pair_of):
    pair = pair_of("auto")
    kinds = set()
    for name, c in pair.connected.items():
        for peer, (kind, reason) in c.choices.items():
            log.info("auto: %s <-> %s chose %s (%s)", name, peer, kind, reason)
            assert kind != "shm" and "not shm: the two ends are on different hosts" in reason, reason
            kinds.add(kind)
    if not rdma_backend.available()[0]:  # no verbs device: after shm and rdma, auto prefers nixl to tcp
        assert kinds == {"nixl" if NIXL_OK else "tcp"}
    assert len(kinds) == 1
    pair.check_backends(pair.connected, kinds.pop())
    pair.exchange("auto", ROUNDS[:3], seed=7)


def test_no_namespace_is_left_behind():
    if not made_namespaces:
        pytest.skip("no test of this module made namespaces")
    assert not set(made_namespaces) & namespaces()
