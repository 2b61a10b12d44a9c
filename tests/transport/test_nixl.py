"""The nixl backend's own guarantees (transport/nixl.py, transport/nixl_agent.py): one agent
per endpoint however many peers connect at once, sends posted from prepared descriptor lists
without waiting for the write, failures raised on a later call, and a teardown that frees
nothing a write in flight still uses. The exchanges themselves run in test_transport.py and
test_two_hosts.py.

A `Gate` holds writes back from NIXL, as a slow link would; UCX_TLS=tcp where NIXL itself
must complete a write after `transfer` (between two agents of one process UCX otherwise
writes through shared memory or cma, which completes inside `transfer`)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from tests.helpers import connect_all
from transport import Endpoint, EndpointSpec, PeerClosed, PeerTimeout
from transport import backends as backends_module
from transport import nixl as nixl_backend
from transport import nixl_agent, nixl_writes

SECRET = b"x" * 32
NIXL_OK, NIXL_REASON = nixl_backend.available()
pytestmark = pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON)


@pytest.fixture
def mesh():
    made: list[Endpoint] = []

    def build(m: int, n: int, slot_bytes: int = 1 << 16, num_slots: int = 2) -> tuple[dict, dict]:
        def endpoint(name: str, rank: int) -> Endpoint:
            return Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, backend="nixl", slot_bytes=slot_bytes,
                                         num_slots=num_slots, timeout_s=10))

        senders = {f"a{i}": endpoint(f"a{i}", i) for i in range(m)}
        receivers = {f"e{j}": endpoint(f"e{j}", 100 + j) for j in range(n)}
        made.extend([*senders.values(), *receivers.values()])
        connect_all({**senders, **receivers}, {**{a: list(receivers) for a in senders},
                                                **{e: list(senders) for e in receivers}})
        return senders, receivers

    yield build
    for ep in made:
        ep.close()


class Gate:
    """Stands in front of an agent's transfer and check_xfer_state, as a slow link would:
    while shut, a posted write is held back from NIXL and looks in flight (so no notification
    leaves either); once open, the first look posts it for real. `verdict` may turn a write
    NIXL completed into a failed one."""

    def __init__(self, monkeypatch, agent: nixl_agent.NixlAgent) -> None:
        self.real_transfer, self.real_check = agent.agent.transfer, agent.agent.check_xfer_state
        self.held: list = []  # posted while shut: NIXL has not seen them
        self.shut = True
        self.verdict = "DONE"
        monkeypatch.setattr(agent.agent, "transfer", self.transfer)
        monkeypatch.setattr(agent.agent, "check_xfer_state", self.check)

    def transfer(self, handle) -> str:
        if self.shut:
            self.held.append(handle)
            return "PROC"
        return self.judge(self.real_transfer(handle))

    def check(self, handle) -> str:
        if self.shut:
            return "PROC"
        if any(h is handle for h in self.held):
            self.held = [h for h in self.held if h is not handle]
            state = self.real_transfer(handle)
            if state != "PROC":
                return self.judge(state)
        return self.judge(self.real_check(handle))

    def judge(self, state: str) -> str:
        return self.verdict if state == "DONE" else state


def test_nixl_one_agent_per_endpoint_when_peers_connect_at_once(monkeypatch, mesh):
    made: list[str] = []

    class SlowAgent(nixl_backend.NixlAgent):
        def __init__(self, endpoint_name: str) -> None:
            made.append(endpoint_name)
            time.sleep(0.3)  # the window in which each concurrent handshake would make its own
            super().__init__(endpoint_name)

    monkeypatch.setattr(backends_module, "NixlAgent", SlowAgent)
    senders, receivers = mesh(4, 1)  # e0's acceptor serves a0..a3 on four threads at once
    assert sorted(made) == ["a0", "a1", "a2", "a3", "e0"], f"{len(made)} agents: {' '.join(sorted(made))}"
    e = receivers["e0"]
    assert len({id(ch.agent) for ch in [*e.inbound.values(), *e.outbound.values()]}) == 1
    for name, a in senders.items():
        a.send("e0", name.encode())
    assert sorted(bytes(e.recv(timeout=5).data) for _ in senders) == [b"a0", b"a1", b"a2", b"a3"]


def test_nixl_sends_use_prepared_descriptors_and_deliver_exact_bytes(monkeypatch, mesh):
    slot_bytes = 10_000  # not a multiple of the 4096-byte block: each slot ends in a short one
    senders, receivers = mesh(1, 1, slot_bytes=slot_bytes)
    a, e = senders["a0"], receivers["e0"]
    api = a.outbound["e0"].agent.agent
    made = []
    monkeypatch.setattr(api, "get_xfer_descs", lambda *args: pytest.fail("a descriptor list built per send"))
    monkeypatch.setattr(api, "initialize_xfer", lambda *args: pytest.fail("a descriptor list built per send"))
    prepped = api.make_prepped_xfer
    monkeypatch.setattr(api, "make_prepped_xfer", lambda *args: made.append(len(args[2])) or prepped(*args))
    sizes = [1, 4095, 4096, 4097, 8192, 9999, slot_bytes, 777]
    for k, n in enumerate(sizes):
        payload = bytes((k * 37 + i) % 251 for i in range(n))
        a.send("e0", payload, micro_batch=k % 2)
        msg = e.recv("a0", timeout=5)
        assert bytes(msg.data) == payload and msg.header.micro_batch == k % 2
        msg.release()
    assert made == [1, 1, 1, 2, 2, 3, 3, 1]  # whole blocks: the indices of the slot's first ones


def test_nixl_send_posts_without_waiting_and_the_completer_delivers(monkeypatch, mesh):
    monkeypatch.setenv("UCX_TLS", "tcp")
    senders, receivers = mesh(1, 3, slot_bytes=1 << 20)
    a = senders["a0"]
    agent = a.outbound["e0"].agent
    gate = Gate(monkeypatch, agent)
    payload = bytes(range(256)) * 1024  # 256 KiB to each peer
    for name in receivers:
        a.send(name, payload, micro_batch=1)
    assert agent.writes.in_flight() == 3  # every send returned with its write in flight
    for e in receivers.values():  # no notification leaves before the sender sees its write done
        with pytest.raises(PeerTimeout):
            e.recv("a0", timeout=0.2)
    gate.shut = False  # a0 makes no further call: its completer thread finishes the writes
    for e in receivers.values():
        msg = e.recv("a0", timeout=5)
        assert bytes(msg.data) == payload
        msg.release()
    # A write's notification can arrive before the sender's UCX has seen it leave: its handle
    # is released a look later. The credits are on their way too.
    deadline = time.monotonic() + 5
    while (agent.writes.in_flight() or a.slots_in_use().unreleased) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert agent.writes.in_flight() == 0 and a.slots_in_use().unreleased == 0


def test_nixl_a_failed_write_is_raised_by_the_next_send_to_that_peer_only(monkeypatch, mesh):
    senders, receivers = mesh(1, 2, slot_bytes=1 << 20)
    a = senders["a0"]
    agent = a.outbound["e0"].agent
    gate = Gate(monkeypatch, agent)
    a.send("e0", bytes(1 << 18), micro_batch=0)  # returns: the failure comes later
    gate.verdict, gate.shut = "ERR", False
    deadline = time.monotonic() + 5
    while agent.writes.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(PeerClosed, match="a write to e0 failed"):
        a.send("e0", b"next", micro_batch=1)
    gate.verdict = "DONE"
    a.send("e1", b"still fine", micro_batch=0)
    assert bytes(receivers["e1"].recv("a0", timeout=5).data) == b"still fine"


def test_nixl_close_releases_every_write_before_removing_peers_and_memory(monkeypatch, mesh):
    monkeypatch.setenv("UCX_TLS", "tcp")
    senders, _ = mesh(1, 2, slot_bytes=1 << 20)
    a = senders["a0"]
    agent = a.outbound["e0"].agent
    gate = Gate(monkeypatch, agent)
    calls = []
    for method in ("release_xfer_handle", "release_dlist_handle", "remove_remote_agent", "deregister_memory"):
        real = getattr(agent.agent, method)
        monkeypatch.setattr(agent.agent, method, lambda *args, _m=method, _r=real: calls.append(_m) or _r(*args))
    for name in ("e0", "e1"):
        a.send(name, bytes(1 << 19), micro_batch=0)
    assert agent.writes.in_flight() == 2
    threading.Timer(0.2, lambda: setattr(gate, "shut", False)).start()  # the writes complete during close
    binding = weakref.ref(agent.agent.agent)
    a.close()
    assert calls.count("release_xfer_handle") == 2 and calls.count("remove_remote_agent") == 2
    first_removal = min(calls.index("remove_remote_agent"), calls.index("deregister_memory"))
    assert all(c != "release_xfer_handle" for c in calls[first_removal:])
    assert calls.index("release_dlist_handle") < first_removal
    assert agent not in nixl_agent._ABANDONED
    monkeypatch.undo()
    del gate, real  # they hold NIXL's agent
    gc.collect()
    assert binding() is None, [type(r) for r in gc.get_referrers(binding())]  # NIXL's agent is gone


def test_nixl_close_with_a_write_stuck_in_flight_keeps_the_agent_whole(monkeypatch, mesh, caplog):
    monkeypatch.setattr(nixl_writes, "DRAIN_S", 1.0)  # long against a busy machine's pauses: two drains are 2 s
    senders, _ = mesh(1, 1, slot_bytes=1 << 20)
    a = senders["a0"]
    agent = a.outbound["e0"].agent
    gate = Gate(monkeypatch, agent)  # shut for good: the link is "down"
    removed = []
    monkeypatch.setattr(agent.agent, "remove_remote_agent", removed.append)
    monkeypatch.setattr(agent.agent, "deregister_memory", removed.append)
    a.send("e0", bytes(1 << 19), micro_batch=0)
    start = time.monotonic()
    a.close()
    assert time.monotonic() - start < 1.9  # one drain of DRAIN_S, not one per channel and another for the agent
    assert agent in nixl_agent._ABANDONED and removed == []
    assert agent.writes.in_flight() == 1 and agent.agent is not None
    assert "kept with its" in caplog.text
    # Clean up for the process's other tests: the write is in truth done; finish the teardown.
    nixl_agent._ABANDONED.remove(agent)
    gate.shut = False
    assert agent.writes.complete() == 0
    monkeypatch.undo()
    agent._destroy()
