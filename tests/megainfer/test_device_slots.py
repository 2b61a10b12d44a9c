"""Device slots (megainfer/disagg/device_slots.py) on the CPU, where the region is a shared
/dev/shm file: the offers traded over real shm endpoints, each pair's choice of path, and a
round's bytes landing in peer order whether they came direct or through the host."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megainfer.disagg import device_slots
from megainfer.disagg.device_slots import DeviceSlots, SlotOffer, link_post
from megainfer.disagg.slot_marks import MARK_ROOM, payload_offset, round_mark
from megainfer.disagg.device_staging import DeviceStaging
from megainfer.errors import DataPlaneError
from tests.helpers import connect_all
from tests.soft_rdma import soft_device
from transport import BackendUnavailable, Endpoint, EndpointSpec
from transport.wire import MARK_LEAD

SECRET = b"d" * 32
REGION = 256


def _offer(**changes) -> SlotOffer:
    base = dict(name="a", host="h/boot", device="cpu", device_uuid="", peers=("e",), micro_batches=2,
                region_bytes=REGION, region=("/dev/shm/x",))
    return SlotOffer(**(base | changes))


def test_a_pair_goes_direct_only_on_one_host_and_one_kind_of_device():
    assert _offer().direct_with(_offer(name="e"))
    assert not _offer().direct_with(_offer(name="e", host="other/boot"))
    assert not _offer().direct_with(_offer(name="e", device="cuda", device_uuid="GPU-1"))
    assert _offer(device="cuda", device_uuid="GPU-1").direct_with(_offer(device="cuda", device_uuid="GPU-1"))


def test_a_pair_writes_by_rdma_only_where_both_regions_are_exposed_and_both_channels_write_into_them():
    grant = (0x7F00_0000_0000, 1024, 0x1001, True)
    far = dict(name="e", host="other/boot")
    a = _offer(grant=grant, rdma_peers=("e",))
    assert a.path_with(_offer(grant=grant, rdma_peers=("a",), **far)) == "rdma"
    assert a.path_with(_offer(rdma_peers=("a",), **far)) == "host"  # one end's link cannot take the writes
    assert _offer().path_with(_offer(grant=grant, rdma_peers=("a",), **far)) == "host"
    # e's channel to a is not rdma in the core (shm on one host, tcp, nixl): grants alone are not enough
    assert a.path_with(_offer(grant=grant, rdma_peers=("x",), **far)) == "host"
    assert a.path_with(_offer(grant=grant, rdma_peers=("a",), device="cuda", device_uuid="GPU-2", **far)) == "rdma"
    assert a.path_with(_offer(name="e", grant=grant, rdma_peers=("a",))) == "local"  # one host: by the region itself
    offer = a
    assert SlotOffer.from_json(offer.to_json(), "a") == offer
    with pytest.raises(DataPlaneError, match="grant .* is not a list of plain fields"):
        SlotOffer.from_json(offer.to_json().replace(b'"grant": [', b'"grant": [{"x": 1}, '), "a")


@pytest.fixture
def hub_and_spokes():
    """An attention-like hub `a` and two spokes, shm endpoints, two micro-batch slots."""
    names = ("a", "e0", "e1")
    endpoints = {n: Endpoint(EndpointSpec(name=n, rank=i, secret=SECRET, backend="shm", slot_bytes=4096, num_slots=2,
                                          timeout_s=10.0)) for i, n in enumerate(names)}
    connect_all(endpoints, {"a": ["e0", "e1"], "e0": ["a"], "e1": ["a"]})
    yield endpoints
    for ep in endpoints.values():
        ep.close()


def _exchange_all(slots: dict[str, DeviceSlots], endpoints) -> None:
    errors = []

    def run(name):
        try:
            slots[name].exchange(endpoints[name])
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors


def _e1_elsewhere(endpoints, monkeypatch) -> dict[str, DeviceSlots]:
    """Device slots of the hub a and spoke e0 on this host and spoke e1 on another, offers traded."""
    slots = {"a": DeviceSlots("a", ("e0", "e1"), "cpu", 2, REGION),
             "e0": DeviceSlots("e0", ("a",), "cpu", 2, REGION)}
    monkeypatch.setattr(device_slots, "host_identity", lambda: "elsewhere/boot")  # e1 is on another host
    slots["e1"] = DeviceSlots("e1", ("a",), "cpu", 2, REGION)
    _exchange_all(slots, endpoints)
    return slots


def _spokes_answer(slots, endpoints, step: int = 0, layer: int = 0, marks: bool = True) -> dict[str, torch.Tensor]:
    """e0 and e1 answer hub a's micro-batch 1 of (`step`, `layer`) with rows of 4 bytes, each by
    its pair's path (the write into a's region, and the link's post with its ranges, targets and
    mark: none unless `marks`); the rows sent."""
    rows = {"e0": torch.arange(12, dtype=torch.uint8), "e1": torch.arange(100, 108, dtype=torch.uint8)}
    for name, data in rows.items():
        s = slots[name]
        begins, ends = np.array([0]), np.array([data.numel()])
        s.write(1, data, begins, ends)
        host_begins, host_ends, targets, mark = link_post(s, 1, begins, ends, step=step, layer=layer)
        endpoints[name].post_round(("a",), data, host_begins, host_ends, np.array([data.numel() // 4]), step=step,
                                   layer=layer, micro_batch=1, targets=targets, mark=mark if marks else 0)
    return rows


def test_a_round_lands_in_peer_order_from_direct_and_host_peers(hub_and_spokes, monkeypatch):
    endpoints = hub_and_spokes
    slots = _e1_elsewhere(endpoints, monkeypatch)
    assert slots["a"].direct.tolist() == [True, False]
    assert slots["e0"].direct.tolist() == [True] and slots["e1"].direct.tolist() == [False]

    # Each spoke answers micro-batch 1 with its rows: e0 by the region, e1 through the host.
    rows = _spokes_answer(slots, endpoints)
    arrivals = endpoints["a"].collect_round(("e0", "e1"), micro_batch=1)
    try:
        assert arrivals.byte_lengths.tolist() == [0, 8]  # e0's header carried no payload
        assert slots["a"].length_mismatch(arrivals, 4) == -1
        assert slots["a"].length_mismatch(arrivals, 2) == 1  # e1's 8 bytes are not 2 rows of 2
        landed = slots["a"].land(arrivals, 1, 4, DeviceStaging("cpu", 2))
    finally:
        arrivals.release()
    assert torch.equal(landed, torch.cat([rows["e0"], rows["e1"]]))
    for s in slots.values():
        s.close()


def test_a_write_past_the_peers_region_is_refused(hub_and_spokes):
    endpoints = hub_and_spokes
    slots = {"a": DeviceSlots("a", ("e0", "e1"), "cpu", 2, REGION),
             "e0": DeviceSlots("e0", ("a",), "cpu", 2, REGION), "e1": DeviceSlots("e1", ("a",), "cpu", 2, REGION)}
    _exchange_all(slots, endpoints)
    too_big = torch.zeros(REGION + 1, dtype=torch.uint8)
    with pytest.raises(DataPlaneError, match="exceed its device slot of 256 bytes"):
        slots["e0"].write(0, too_big, np.array([0]), np.array([REGION + 1]))
    with pytest.raises(DataPlaneError, match="past its device slot"):
        slots["a"].read(0, 0, REGION + 1)
    for s in slots.values():
        s.close()


def test_a_data_round_where_offers_are_due_is_a_clear_error(hub_and_spokes):
    endpoints = hub_and_spokes
    a = DeviceSlots("a", ("e0", "e1"), "cpu", 2, REGION)
    for name in ("e0", "e1"):  # spokes without device slots: their first round is data
        endpoints[name].post_round(("a",), torch.zeros(8, dtype=torch.uint8), np.array([0]), np.array([8]),
                                   np.array([2]), micro_batch=0)
    with pytest.raises(DataPlaneError, match="does not use device slots"):
        a.exchange(endpoints["a"])
    a.close()


def test_close_removes_the_shared_file():
    s = DeviceSlots("a", ("e0",), "cpu", 2, REGION)
    path = s.offer.region[0]
    assert path.startswith("/dev/shm/") and os.path.exists(path)
    s.close()
    assert not os.path.exists(path)


def test_an_offer_travels_as_checked_json_and_its_cuda_handle_round_trips():
    """The arguments torch's reduce_tensor gives rebuild_cuda_tensor, as plain JSON and back."""
    handle = (torch.Tensor, torch.Size([2, 3, 256]), (768, 256, 1), 0, torch.storage.TypedStorage, torch.uint8, 0,
              b"\x01\x02", 1536, 0, False, b"/torch_ref", 5, b"\x07" * 64, True)
    offer = SlotOffer("a", "h/boot", "cuda", "GPU-1", ("e0", "e1"), 2, 256, handle, (b"\x00\xff",))
    assert b"pickle" not in offer.to_json() and SlotOffer.from_json(offer.to_json(), "a") == offer


@pytest.mark.parametrize("data, match", [
    (b"not json", "malformed device-slot offer"),
    (b'{"name": "a"}', "malformed device-slot offer"),
    (b'{"name": "a", "host": "h", "device": "tpu", "device_uuid": "", "peers": [], "micro_batches": 2, '
     b'"region_bytes": 64, "region": [], "events": []}', "out of range: device 'tpu'"),
    (b'{"name": "a", "host": "h", "device": "cuda", "device_uuid": "", "peers": [], "micro_batches": 2, '
     b'"region_bytes": 64, "region": [{"class": "os.system"}], "events": []}', "malformed device-slot offer"),
])
def test_a_bad_offer_is_a_clear_error_naming_the_peer(data, match):
    with pytest.raises(DataPlaneError, match=match):
        SlotOffer.from_json(data, "e7")


def test_rows_are_aligned_and_the_offer_says_the_size_the_region_has():
    """A row per (micro-batch, peer), each starting aligned: the offer names the rounded size, which
    is what the peer maps and what reads are bounded by."""
    s = DeviceSlots("a", ("e0", "e1"), "cpu", 2, 100)
    assert s.region.shape == (2, 2, 128) and s.offer.region_bytes == s.region_bytes == 128
    assert all(s.region[j, i].data_ptr() % 64 == 0 for j in range(2) for i in range(2))
    s.close()


# -- across hosts, by rdma in the compiled core (the software verbs provider: no adapter here) --
@pytest.fixture
def rdma_hub_and_spokes(soft_verbs, monkeypatch):
    """`hub_and_spokes` over rdma channels of the compiled core, on the software provider."""
    soft_device(monkeypatch, soft_verbs)
    names = ("a", "e0", "e1")
    endpoints = {n: Endpoint(EndpointSpec(name=n, rank=i, secret=SECRET, backend="rdma", slot_bytes=4096,
                                          num_slots=2, timeout_s=10.0, core="on")) for i, n in enumerate(names)}
    connect_all(endpoints, {"a": ["e0", "e1"], "e0": ["a"], "e1": ["a"]})
    yield endpoints
    for ep in endpoints.values():
        ep.close()


def test_a_peer_on_another_host_writes_into_the_region_by_rdma_and_it_is_read_in_place(rdma_hub_and_spokes,
                                                                                        monkeypatch):
    endpoints = rdma_hub_and_spokes
    slots = _e1_elsewhere(endpoints, monkeypatch)
    assert slots["a"].direct.tolist() == [True, True] and slots["a"].local.tolist() == [True, False]
    assert slots["e1"].direct.tolist() == [True] and slots["e1"].needs_host_copy  # its bytes go by the post

    # The spokes answer micro-batch 1: e0 by its write into a's region, e1 by its post into it.
    rows = _spokes_answer(slots, endpoints)
    arrivals = endpoints["a"].collect_round(("e0", "e1"), micro_batch=1)
    try:
        assert arrivals.byte_lengths.tolist() == [0, 0]  # neither header carried the bytes
        assert slots["a"].length_mismatch(arrivals, 4) == -1
        landed = slots["a"].land(arrivals, 1, 4, DeviceStaging("cpu", 2))
    finally:
        arrivals.release()
    assert torch.equal(landed, torch.cat([rows["e0"], rows["e1"]]))
    assert torch.equal(slots["a"].region[1, 1, :8], rows["e1"])  # landed in a's row for e1, by the adapter

    # The other way: a dispatches to both; e1 reads its own region in place.
    data = torch.arange(64, dtype=torch.uint8)
    begins, ends = np.array([0, 24]), np.array([24, 64])
    slots["a"].write(0, data, begins, ends)
    host_begins, host_ends, targets, mark = link_post(slots["a"], 0, begins, ends, step=0, layer=0)
    assert host_begins.tolist() == [0, 24] and host_ends.tolist() == [0, 64]  # only e0's bytes skip the post
    endpoints["a"].post_round(("e0", "e1"), data, host_begins, host_ends, np.array([6, 10]), micro_batch=0,
                              targets=targets, mark=mark)
    for name, (begin, end) in (("e0", (0, 24)), ("e1", (24, 64))):
        arrivals = endpoints[name].collect_round(("a",), micro_batch=0)
        try:
            got = slots[name].land(arrivals, 0, 4, DeviceStaging("cpu", 2))
        finally:
            arrivals.release()
        assert torch.equal(got, data[begin:end])
    with pytest.raises(DataPlaneError, match="exceed its device slot of 256 bytes"):
        link_post(slots["e1"], 0, np.array([0]), np.array([REGION + 1]), step=0, layer=0)
    assert all(ep.slots_in_use().held == 0 for ep in endpoints.values())
    for s in slots.values():
        s.close()


def test_rdma_bytes_are_read_only_under_their_rounds_mark(rdma_hub_and_spokes, monkeypatch):
    """The adapter leaves the round's mark before each row's bytes, after them and before the
    header: the receiver reads a row only under the mark its header names (on CUDA its stream
    waits on it; here it is checked), so a row whose mark did not come is an error, not bytes
    of an older round."""
    endpoints = rdma_hub_and_spokes
    slots = _e1_elsewhere(endpoints, monkeypatch)
    for layer, marks in ((2, True), (3, False)):  # the second round's sender leaves no mark
        rows = _spokes_answer(slots, endpoints, step=4, layer=layer, marks=marks)
        arrivals = endpoints["a"].collect_round(("e0", "e1"), micro_batch=1)
        try:
            if marks:
                assert torch.equal(slots["a"].land(arrivals, 1, 4, DeviceStaging("cpu", 2)),
                                   torch.cat([rows["e0"], rows["e1"]]))
                assert slots["a"].marks.words[1, 1].item() & 0xFFFFFFFF == round_mark(4, 2)
                assert slots["a"].marks.words[1, 0].item() == 0  # e0 writes into a's region itself: no mark
            else:
                with pytest.raises(DataPlaneError, match=f"e1's rdma bytes for micro-batch 1 came without their "
                                                         f"mark \\(found {round_mark(4, 2)}, expected "
                                                         f"{round_mark(4, 3)}\\)"):
                    slots["a"].land(arrivals, 1, 4, DeviceStaging("cpu", 2))
        finally:
            arrivals.release()
    for s in slots.values():
        s.close()


def test_round_marks_are_never_zero_and_differ_between_a_rows_consecutive_rounds():
    steps, layers = np.meshgrid(np.arange(0, 70_000, 7), np.arange(0, 94), indexing="ij")
    marks = round_mark(steps, layers)
    assert marks.min() >= 1 and marks.max() <= 0xFFFFFFFF
    assert (marks[:, 1:] != marks[:, :-1]).all() and (marks[1:, 0] != marks[:-1, -1]).all()
    assert round_mark(1 << 20, 5) == int(round_mark(np.array([1 << 20]), np.array([5]))[0])
    assert round_mark(0xFFFF, 0xFFFF) == 0xFFFFFFFF % 0xFFFFFFFF + 1 == 1  # the one wrap: 0 is never a mark


def test_a_row_reserves_room_for_its_mark_and_the_marks_address_it():
    s = DeviceSlots("a", ("e0", "e1"), "cpu", 2, 100)
    assert s._memory.shape == (2, 2, MARK_ROOM + 128)
    for j in range(2):
        for i in range(2):
            assert s.region[j, i].data_ptr() - s.marks.words[j, i].data_ptr() == MARK_LEAD
            assert int(s.marks.addresses[j, i]) == s.marks.words[j, i].data_ptr()
            assert s.region[j, i].data_ptr() - s._memory.data_ptr() == payload_offset(j, i, 2, 128)
    s.close()


def test_a_region_that_cannot_be_exposed_is_said_and_its_pairs_go_through_the_host(rdma_hub_and_spokes, monkeypatch,
                                                                                   caplog):
    endpoints = rdma_hub_and_spokes
    hosts = iter(["h0/boot", "h1/boot", "h2/boot"])
    monkeypatch.setattr(device_slots, "host_identity", lambda: next(hosts))  # every node on a host of its own

    def refuse(buffer):
        raise BackendUnavailable("rdma: cannot expose a 512-byte host region on soft0 (no memory)")

    monkeypatch.setattr(endpoints["e1"], "expose", refuse)
    slots = {n: DeviceSlots(n, ("e0", "e1") if n == "a" else ("a",), "cpu", 2, REGION) for n in endpoints}
    _exchange_all(slots, endpoints)
    assert slots["a"].direct.tolist() == [True, False]  # e0 by rdma, e1 through the host
    said = [r.getMessage() for r in caplog.records if "cannot write into this node's device slots" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("e1:") and "no memory" in said[0]
    for s in slots.values():
        s.close()


@pytest.mark.parametrize("on_cuda, local, direct, reads, sources, expected", [
    (False, [False, False], [True, True], True, 2, (False, "host memory")),  # the CPU sends from its tensors
    (True, [True, True], [True, True], True, 2, (False, "pinned host memory")),  # every peer local: nothing posted
    (True, [False, False], [True, False], True, 2, (False, "some peer goes through the host")),
    (True, [True, False], [True, True], False, 2, (False, "cannot read this GPU's send buffers")),
    (True, [True, False], [True, True], True, 0, (False, "cannot read this GPU's send buffers")),
    (True, [True, False], [True, True], True, 2, (True, "rounds leave from GPU memory")),
])
def test_rounds_leave_from_gpu_memory_only_where_every_peer_can_take_them_so(on_cuda, local, direct, reads, sources,
                                                                              expected):
    slots = SimpleNamespace(on_cuda=on_cuda, local=np.array(local), direct=np.array(direct))
    link = SimpleNamespace(reads_in_place=lambda buffer: reads)
    made = []
    chosen, why = device_slots.device_send_choice(slots, link, lambda: made.append(1) or [torch.zeros(1)] * sources)
    assert made == ([1] if on_cuda and not all(local) and all(direct) else [])  # made only where they may serve
    assert chosen == expected[0] and expected[1] in why
