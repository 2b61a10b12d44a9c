"""TCP is full duplex by construction: two processes sending each other 16 MiB messages at
once, m = 3 micro-batches in flight, socket buffers forced small, both finish. (Blocking
sends would both wait in sendmsg for a reader that is itself sending: a hang.)"""

from __future__ import annotations

import multiprocessing as mp

MESSAGE = 16 << 20
SLOTS = 3  # m
ROUNDS = 2
SECRET = b"duplex-test-secret-0123456789abcdef"


def _pattern(sender: int, round_: int, j: int) -> bytes:
    """A message whose every 4 KiB page says who sent it and when (cheap to build and check)."""
    page = bytes([sender, round_, j]) * 1365 + bytes([sender])
    return page * (MESSAGE // len(page)) + page[:MESSAGE % len(page)]


def _node(rank: int, addresses, peers_ready, results) -> None:
    from transport import Endpoint, EndpointSpec

    name, other = ("a", "b") if rank == 0 else ("b", "a")
    with Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, backend="tcp", slot_bytes=MESSAGE,
                               num_slots=SLOTS, timeout_s=60.0, tcp_buffer_bytes=64 << 10)) as endpoint:
        addresses[name] = endpoint.address
        peers_ready.wait(30)
        endpoint.connect({other: addresses[other]})
        ok = True
        for round_ in range(ROUNDS):
            for j in range(SLOTS):  # every micro-batch out before any answer is read, as the ping-pong does
                endpoint.send(other, _pattern(rank, round_, j), micro_batch=j, layer=round_)
            for j in range(SLOTS):
                with endpoint.recv(other, micro_batch=j) as msg:
                    ok &= msg.header.layer == round_ and bytes(msg.data) == _pattern(1 - rank, round_, j)
        results.put((rank, ok))


def test_two_senders_of_16_mib_messages_both_finish_with_small_socket_buffers():
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    addresses, peers_ready, results = manager.dict(), ctx.Event(), ctx.Queue()
    nodes = [ctx.Process(target=_node, args=(rank, addresses, peers_ready, results)) for rank in (0, 1)]
    for p in nodes:
        p.start()
    try:
        for _ in range(600):
            if len(addresses) == 2:
                break
            nodes[0].join(0.05)
        peers_ready.set()
        answers = sorted(results.get(timeout=120) for _ in nodes)
    finally:
        for p in nodes:
            p.join(10)
            if p.is_alive():
                p.kill()
        manager.shutdown()
    assert answers == [(0, True), (1, True)]


def test_socket_buffers_are_left_to_autotuning_unless_configured():
    import socket

    from transport.tcp import tune

    with socket.socket() as s:
        default = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        tune(s, None)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == default
        tune(s, 64 << 10)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 64 << 10  # Linux doubles what is asked
