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
