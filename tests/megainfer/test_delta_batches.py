"""Deltas in batches: an attention node's poll answer travels as columns (`DeltaBatch`), and the
serving process fans it out to the streams without an object per delta
(`StreamRegistry.deliver_batch`), each request's deltas in order, every reader woken."""

from __future__ import annotations

import asyncio
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from megainfer.messages import DeltaBatch, DeltaColumns, FinishReason, RequestDelta
from megainfer.server.backend import StreamRegistry, foreign_places
from megainfer.server.choice_streams import LoopWakes
from megainfer.server.fan_in import FanIn


def plain(rid: str, token: int) -> RequestDelta:
    return RequestDelta(rid, [token], f"<{token}>")


def finished(rid: str, token: int) -> RequestDelta:
    return RequestDelta(rid, [token], f"<{token}>", True, FinishReason.LENGTH)


# A step sequence: each step, every request still open gains one delta; some finish, some ask
# for logprobs (so they travel whole).
steps_strategy = st.lists(st.lists(st.sampled_from(["plain", "finish", "logprobs"]), min_size=4, max_size=4),
                          min_size=1, max_size=5)


def deltas_of(steps: list[list[str]]) -> list[RequestDelta]:
    out, done, token = [], set(), 0
    for step in steps:
        for r, kind in enumerate(step):
            if r in done:
                continue
            token += 1
            if kind == "finish":
                out.append(finished(f"r{r}", token))
                done.add(r)
            elif kind == "logprobs":
                out.append(RequestDelta(f"r{r}", [token], f"<{token}>", logprobs=[{}]))
            else:
                out.append(plain(f"r{r}", token))
    return out


@settings(max_examples=60, deadline=None)
@given(steps_strategy)
def test_a_batch_in_columns_gives_back_every_delta_in_order(steps):
    deltas = deltas_of(steps)
    columns = DeltaColumns.of(deltas)
    assert len(columns) == len(deltas)
    assert columns.deltas == deltas
    assert all(isinstance(t, int) for t in columns.token_ids)  # the plain ones are columns, not objects
    batch = DeltaBatch("node", len(deltas), columns)
    assert len(batch) == len(deltas) and batch.deltas == deltas
    # Steps appended to one another (a poll answering several) keep the order.
    half = len(deltas) // 2
    joined = DeltaColumns.of(deltas[:half])
    joined.extend(DeltaColumns.of(deltas[half:]))
    assert joined.deltas == deltas


@settings(max_examples=60, deadline=None)
@given(steps_strategy)
def test_the_fan_out_keeps_each_requests_order_and_wakes_its_reader(steps):
    deltas = deltas_of(steps)
    registry = StreamRegistry(max_open=8)
    readers = {f"r{r}": FanIn([registry.open(f"r{r}")]) for r in range(4)}
    registry.deliver_batch(DeltaColumns.of(deltas))
    for rid, reader in readers.items():
        got = []
        while (item := reader.get(0.0)) is not None:
            got.append(item[1])
        assert got == [d for d in deltas if d.request_id == rid]
    # A finished request's stream is closed; the others stay open.
    assert {rid for rid in readers if registry.is_open(rid)} == \
        {rid for rid in readers if not any(d.finished for d in deltas if d.request_id == rid)}


def test_a_closed_stream_takes_no_delta_and_a_thread_reader_is_woken():
    registry = StreamRegistry(max_open=4)
    stream = registry.open("a")
    registry.open("gone")
    registry.close("gone")
    got = []
    reader = threading.Thread(target=lambda: got.append(stream.get(5.0)))
    reader.start()
    registry.deliver_batch(DeltaColumns.of([plain("gone", 1), plain("a", 2)]))
    reader.join(5)
    assert got == [plain("a", 2)]


def test_a_delta_announced_twice_is_read_once():
    registry = StreamRegistry(max_open=1)
    stream = registry.open("a")
    registry.deliver_batch(DeltaColumns.of([plain("a", 1)]))
    reader = FanIn([stream])
    stream._wake()  # the race `listen` allows: one delta, two wakes
    assert reader.get(0.0) == (0, plain("a", 1))
    assert reader.get(0.01) is None


def test_foreign_places_and_dropping_them_keep_the_rest_in_order():
    batch = DeltaColumns.of([plain("a", 1), plain("b", 2), finished("x", 3), plain("c", 4), plain("b", 5)])
    owner = {"a": 0, "b": 1, "c": 0, "x": 0}
    assert foreign_places(batch.request_ids, owner, 0) == [1, 3]
    assert foreign_places(["a", "c"], owner, 0) == []
    kept = batch.without_places([1, 3])
    assert kept.deltas == [plain("a", 1), finished("x", 3), plain("c", 4)]


def test_an_event_loop_is_woken_once_per_burst():
    class Group:
        def __init__(self):
            self.taken = []

        def take(self, choice):
            self.taken.append(choice.stream.pop())

    class Choice:
        def __init__(self, stream):
            self.stream = stream

    async def main():
        loop = asyncio.get_running_loop()
        wakes = LoopWakes.of(loop)
        assert LoopWakes.of(loop) is wakes
        scheduled = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            scheduled.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        registry, group = StreamRegistry(max_open=100), Group()
        for r in range(100):
            choice = Choice(registry.open(f"r{r}"))
            choice.stream.listen(lambda c=choice: wakes.wake(group, c))
        batch = DeltaColumns.of([plain(f"r{r}", r) for r in range(100)])
        # Delivered while the loop is busy (here: on it), as a poll answer lands mid-burst: a
        # delivering thread racing an idle loop may see a drain start between two wakes.
        registry.deliver_batch(batch)
        await asyncio.sleep(0.05)
        return scheduled, group.taken

    scheduled, taken = asyncio.run(main())
    assert sum(getattr(c, "__name__", "") == "_drain" for c in scheduled) == 1  # one drain for 100 deltas
    assert taken == [plain(f"r{r}", r) for r in range(100)]


def test_a_reader_that_listens_late_is_woken_once_per_queued_delta():
    registry = StreamRegistry(max_open=1)
    stream = registry.open("a")
    registry.deliver_batch(DeltaColumns.of([plain("a", 1), plain("a", 2)]))
    stream.put(finished("a", 3))
    wakes = []
    stream.listen(lambda: wakes.append(1))
    assert len(wakes) == 3
    assert [stream.pop(), stream.pop(), stream.pop(), stream.pop()] == [plain("a", 1), plain("a", 2),
                                                                      finished("a", 3), None]
