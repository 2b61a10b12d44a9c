"""transport/cuda.py: stream-ordered staging between device tensors and M2N slots. Host
tensors pass through on any machine; the CUDA paths (a producer still running when the send
is called, buffers reused across messages) run where a GPU exists and are skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import connect_all
from transport import Endpoint, EndpointSpec, PayloadTooLarge
from transport.cuda import StreamOrderedReceiver, StreamOrderedSender

SECRET = b"c" * 32
SLOT_BYTES = 1 << 20
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU time: the producer is still running when the host sends


@pytest.fixture
def pair():
    """A sender endpoint and a receiver endpoint over shared memory, one slot per micro-batch."""
    a = Endpoint(EndpointSpec(name="a0", secret=SECRET, backend="shm", slot_bytes=SLOT_BYTES, num_slots=1,
                              timeout_s=10))
    e = Endpoint(EndpointSpec(name="e0", rank=100, secret=SECRET, backend="shm", slot_bytes=SLOT_BYTES,
                              num_slots=1, timeout_s=10))
    connect_all({"a0": a, "e0": e}, {"a0": ["e0"], "e0": ["a0"]})
    yield a, e
    a.close()
    e.close()


def test_host_tensors_pass_through_and_release_their_slot(pair):
    a, e = pair
    sender, receiver = StreamOrderedSender(a, SLOT_BYTES), StreamOrderedReceiver(e, SLOT_BYTES, device="cpu")
    x = torch.arange(24, dtype=torch.float32).view(4, 6)
    for step in range(3):  # one slot: each send needs the previous message released
        sender.send("e0", (x + step).t(), step=step, token_count=6)  # non-contiguous
        header, out = receiver.recv("a0", dtype=torch.float32, shape=(6, 4))
        assert header.step == step and header.token_count == 6
        assert torch.equal(out, (x + step).t())
    assert sender._stream is None and receiver._staging == []  # no CUDA resource was made


def test_a_message_larger_than_the_staging_buffer_is_refused_and_released(pair):
    a, e = pair
    receiver = StreamOrderedReceiver(e, 64, device="cpu")
    a.send("e0", torch.zeros(65, dtype=torch.uint8))
    with pytest.raises(PayloadTooLarge, match="65 bytes"):
        receiver.recv("a0")
    a.send("e0", torch.ones(8, dtype=torch.uint8), timeout=1)  # the slot was released
    assert torch.equal(receiver.recv("a0")[1], torch.ones(8, dtype=torch.uint8))


@pytest.mark.gpu
def test_a_send_waits_for_the_producers_event_not_the_device(pair):
    a, e = pair
    sender, receiver = StreamOrderedSender(a, SLOT_BYTES), StreamOrderedReceiver(e, SLOT_BYTES)
    producer = torch.cuda.Stream()
    x = torch.zeros(64, 32, device="cuda")
    producer.wait_stream(torch.cuda.current_stream())  # x is zeroed first
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(3.0)
        y = x.t()  # non-contiguous: gathered on the side stream after the event
        done = producer.record_event()
    assert not done.query()  # the producer is still running as the send starts
    sender.send("e0", y, event=done, token_count=1)
    header, out = receiver.recv("a0", dtype=torch.float32, shape=(32, 64))
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, torch.full((32, 64), 3.0, device="cuda"))
    with pytest.raises(PayloadTooLarge):
        sender.send("e0", torch.zeros(SLOT_BYTES // 4 + 1, device="cuda"))


@pytest.mark.gpu
def test_staging_buffers_are_reused_only_after_their_copies(pair):
    a, e = pair
    receiver = StreamOrderedReceiver(e, SLOT_BYTES, buffers=2)
    consumer = torch.cuda.Stream()
    outs = []
    for i in range(5):
        a.send("e0", torch.full((1024,), float(i)), step=i)
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(SLEEP_CYCLES // 10)  # the consumer lags: copies queue behind it
            outs.append(receiver.recv("a0", dtype=torch.float32, stream=consumer)[1] * 1)
    consumer.synchronize()
    assert [int(o.unique().item()) for o in outs] == list(range(5))
