"""A node's `resources()` reads the M2N slots in use without touching the transport: the loop
thread counts them (deploy/link.py), so a Ray thread asking for resources never polls a
channel beside the loop (two pollers split tcp credit frames or race RDMA credits: a
spurious ProtocolViolation across hosts)."""

from __future__ import annotations

import threading
import time

import torch

from deploy.link import SwitchableLink
from deploy.node_actor import rank_resources
from megainfer.messages import NodeRole
from transport import PeerTimeout
from transport.endpoint import SlotUsage

SECRET = b"k" * 32


class OwnedEndpoint:
    """An endpoint whose polls must run on its owner thread (as a real one's must)."""

    def __init__(self, owner: int, usage: SlotUsage) -> None:
        self.owner, self.usage = owner, usage
        self.polls: list[int] = []  # threads that polled
        self.quiet = 1  # receives that time out before a message comes

    def slots_in_use(self) -> SlotUsage:
        self.polls.append(threading.get_ident())
        assert threading.get_ident() == self.owner, "a transport poll off the loop thread"
        return self.usage

    def collect_round(self, peers, *, micro_batch, timeout):
        assert threading.get_ident() == self.owner
        if self.quiet:
            self.quiet -= 1
            raise PeerTimeout("nothing within the timeout")
        return f"message for {micro_batch}"

    def close(self) -> None:
        pass


def link_on(endpoint, **kw) -> SwitchableLink:
    link = SwitchableLink("expert0", 1000, SECRET, "127.0.0.1", 1024, 2, "tcp", 5.0, **kw)
    link.endpoint = endpoint
    return link


def on_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    return out[0]


def test_resources_from_another_thread_never_poll_the_transport():
    """Before: rank_resources -> SwitchableLink.slot_usage -> Endpoint.slots_in_use on the caller's thread."""
    loop = threading.Thread(target=lambda: None)
    loop.start()
    loop.join()
    endpoint = OwnedEndpoint(loop.ident, SlotUsage(held=1, unreleased=2))
    link = link_on(endpoint)
    res = rank_resources("expert0", NodeRole.EXPERT, 0, link)  # this thread is the Ray thread
    assert (res.slots_held, res.slots_unreleased) == (0, 0) and endpoint.polls == []


def test_an_expert_link_counts_in_a_quiet_wait_on_the_loop_thread():
    holder = {}
    link = link_on(None, count_when_quiet=True)

    def loop():
        holder["endpoint"] = link.endpoint = OwnedEndpoint(threading.get_ident(), SlotUsage(held=0, unreleased=3))
        return link.collect_round(("attention0",), micro_batch=1)

    assert on_thread(loop) == "message for 1"  # the quiet receive timed out, counted, then waited on
    endpoint = holder["endpoint"]
    assert len(endpoint.polls) == 1 and endpoint.polls[0] == endpoint.owner
    res = rank_resources("expert0", NodeRole.EXPERT, 0, link)
    assert (res.slots_held, res.slots_unreleased) == (0, 3) and len(endpoint.polls) == 1


def test_step_counts_are_rate_limited_and_a_new_endpoint_starts_at_zero():
    me = threading.get_ident()
    endpoint = OwnedEndpoint(me, SlotUsage(held=2, unreleased=0))
    link = link_on(endpoint)
    link.count_usage()
    link.count_usage()  # within COUNT_EVERY_S of the last: no second poll
    assert link.slot_usage() == (2, 0) and len(endpoint.polls) == 1
    link.count_usage(force=True)
    assert len(endpoint.polls) == 2
    link.close()
    assert link.slot_usage() == (0, 0)


def test_a_busy_tcp_pair_is_polled_by_the_expert_loop_only_and_reads_zero_when_quiet():
    """Real endpoints over tcp: a reader thread asks for the expert's slots throughout; every
    credit drain and channel poll of the expert's endpoint stays on its loop thread."""
    attention = SwitchableLink("a0", 0, SECRET, "127.0.0.1", 64, 2, "tcp", 10.0)
    expert = SwitchableLink("e0", 1, SECRET, "127.0.0.1", 64, 2, "tcp", 10.0, count_when_quiet=True)
    expert.COUNT_EVERY_S = 0.0  # count at every quiet wait
    addresses = {"a0": attention.open(), "e0": expert.open()}
    wiring = threading.Thread(target=lambda: expert.connect({"a0": addresses["a0"]}))
    wiring.start()
    attention.connect({"e0": addresses["e0"]})
    wiring.join(10)
    pollers: set[int] = set()
    ep = expert.endpoint
    for channel, name in ((ep.outbound["a0"], "drain_credits"), (ep.inbound["a0"], "poll")):
        real = getattr(channel, name)
        setattr(channel, name, lambda *a, _real=real, **k: (pollers.add(threading.get_ident()), _real(*a, **k))[1])
    steps, payload = 60, torch.zeros(16, dtype=torch.uint8)
    stop, readings = threading.Event(), []

    def expert_loop():
        for i in range(steps + 1):
            expert.collect_round(("a0",), micro_batch=i % 2).release()
            if i < steps:
                expert.post_round(("a0",), payload, [0], [16], [0], step=i, layer=0, micro_batch=i % 2)
        return expert.slot_usage()  # counted in the last, quiet wait

    def reader():
        while not stop.is_set():
            readings.append(rank_resources("e0", NodeRole.EXPERT, 0, expert))

    loop = threading.Thread(target=lambda: readings.append(("final", expert_loop())))
    threads = [loop, threading.Thread(target=reader)]
    for t in threads:
        t.start()
    try:
        for i in range(steps):
            attention.post_round(("e0",), payload, [0], [16], [0], step=i, layer=0, micro_batch=i % 2)
            attention.collect_round(("e0",), micro_batch=i % 2).release()
            if i % 10 == 0:
                time.sleep(0.005)  # between steps: the expert waits with nothing arriving
        time.sleep(0.02)  # every answer released: the expert's last wait is quiet
        attention.post_round(("e0",), payload, [0], [16], [0], step=steps, layer=0, micro_batch=steps % 2)
        loop.join(10)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        attention.close()
        expert.close()
    assert pollers == {loop.ident}
    assert ("final", (0, 0)) in readings and len(readings) > 2
