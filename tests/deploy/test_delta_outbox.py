"""The attention node's outbox: deltas stay until a poll acknowledges them, so a poll whose
answer was lost (it timed out while the node was stopped and ran later) loses nothing."""

from __future__ import annotations

import threading

from deploy.delta_outbox import DeltaOutbox
from megainfer.messages import RequestDelta


def delta(rid: str, token: int) -> RequestDelta:
    return RequestDelta(rid, [token], "", False)


def test_a_lost_poll_answer_is_returned_again_and_acknowledged_deltas_are_dropped():
    box = DeltaOutbox()
    box.put([delta("a", 1), delta("a", 2)])
    first = box.poll(None, 0, 0.0)
    assert [d.new_token_ids for d in first.deltas] == [[1], [2]] and first.last == 2
    # That answer never reached the poller (its call had timed out): the next poll, still at
    # the old cursor, gets the same deltas.
    again = box.poll(first.incarnation, 0, 0.0)
    assert [d.new_token_ids for d in again.deltas] == [[1], [2]]
    box.put([delta("a", 3)])
    after = box.poll(again.incarnation, again.last, 0.0)
    assert [d.new_token_ids for d in after.deltas] == [[3]] and after.last == 3
    empty = box.poll(after.incarnation, after.last, 0.0)
    assert empty.deltas == [] and empty.last == 3


def test_a_cursor_from_another_process_reads_everything():
    old, new = DeltaOutbox(), DeltaOutbox()
    old.put([delta("a", 1)] * 5)
    cursor = old.poll(None, 0, 0.0)
    new.put([delta("b", 7)])
    batch = new.poll(cursor.incarnation, cursor.last, 0.0)  # the node restarted: its count began anew
    assert [d.request_id for d in batch.deltas] == ["b"] and batch.incarnation != cursor.incarnation


def test_a_poll_waits_for_the_first_delta():
    box = DeltaOutbox()
    threading.Timer(0.05, box.put, args=([delta("a", 9)],)).start()
    batch = box.poll(None, 0, 5.0)
    assert [d.new_token_ids for d in batch.deltas] == [[9]]


def test_the_frontend_aborts_a_request_its_node_does_not_hold_and_streams_the_rest():
    """A poll answer naming a request that is held elsewhere (sent on after its node hung): the
    delta is dropped and the request aborted on the node that sent it; the others stream."""
    from deploy.frontend import Frontend
    from megainfer.messages import DeltaBatch, DeltaColumns, FinishReason
    from megainfer.server.fan_in import FanIn

    aborted = []

    class Node:
        class abort:
            @staticmethod
            def remote(request_id):
                aborted.append(request_id)

    frontend = Frontend(router=None, max_open_per_group=8)
    frontend.registry.max_open = 8
    frontend._nodes = [Node(), Node()]
    readers = {}
    for rid, node in (("a", 0), ("b", 1), ("c", 0)):
        readers[rid] = FanIn([frontend.registry.open(rid)])
        frontend._owner[rid] = node
    last = RequestDelta("c", [4], "", True, FinishReason.LENGTH)
    frontend.deliveries.batch(0, DeltaBatch("n0", 4, DeltaColumns.of([delta("a", 1), delta("b", 2), delta("c", 3), last])))
    assert aborted == ["b"]
    assert readers["a"].get(0.0) == (0, delta("a", 1))
    assert readers["b"].get(0.0) is None
    assert [readers["c"].get(0.0), readers["c"].get(0.0)] == [(0, delta("c", 3)), (0, last)]
    assert frontend.owner_of("c") is None and frontend.owner_of("a") == 0
