"""The compiled core's rdma channels (transport/core_rdma.py, transport/csrc/verbs_channels.cpp)
without an adapter.

The core loads libibverbs at run time and calls it as verbs.h does; here it loads a software
provider instead (tests/transport/verbs/soft_verbs.cpp, built by the fixture with the C++
compiler that builds the core): the same exported functions and ops table, queue pairs in this
process, writes copied between registered regions with their immediates, completion events,
and a queue pair put in error as a dead peer's would be. So everything above the adapter runs:
the core's queue-pair set-up and transitions with rdma.py's attribute values, its work
requests, completions, credits and rules, the endpoint's handshake, rounds and failures.
Beside it: the ABI the core declares is compiled against a real verbs.h, and the real
libibverbs that pyverbs bundles is loaded (every symbol resolves; no device here)."""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import mmap
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers import connect_all
from tests.soft_rdma import HERE, ROOT, SOFT, SOFT_GID, compiler, shared_library, soft_device
from transport import (BackendUnavailable, Endpoint, EndpointSpec, PayloadTooLarge, ProtocolViolation, RoundFailed,
                       SlotUsage, TransportError)
from transport import nixl, rdma
from transport import rdma_port as rp
from transport.core import native
from transport.core_rdma import CoreQueuePair, CoreRdmaInbound, CoreRdmaOutbound, CoreVerbs, verbs_library
from transport.errors import HandshakeError, PeerClosed
from transport.rounds import CoreRound
from transport.shm import slot_stride
from transport.wire import MARK_LEAD, Header, RegionGrant

SECRET = b"v" * 32
IDLE = SlotUsage(held=0, unreleased=0, queued=0)

if native is None:
    pytest.fail("the compiled M2N core is not built: pip install builds it", pytrace=False)


@pytest.fixture(scope="module")
def stand_in_cuda(tmp_path_factory):
    """A libcuda.so.1 stand-in (tests/transport/verbs/stand_in_cuda.cpp) and its hooks."""
    path = shared_library("stand_in_cuda.cpp", tmp_path_factory.mktemp("cuda") / "libcuda.so.1")
    lib = ctypes.CDLL(path)
    lib.stand_in_alloc.restype = ctypes.c_uint64
    lib.stand_in_alloc.argtypes = [ctypes.c_size_t]
    lib.stand_in_write.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
    lib.stand_in_read.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
    lib.stand_in_set_dmabuf_supported.argtypes = [ctypes.c_int]
    lib.stand_in_set_rdma_ordering.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.stand_in_last_export.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)]
    lib.path = path
    return lib


@pytest.fixture(scope="module")
def hooks(soft_verbs):
    lib = ctypes.CDLL(soft_verbs)  # the same handle the core's dlopen got: the same queue pairs
    lib.soft_verbs_break.argtypes = [ctypes.c_uint32]
    lib.soft_verbs_attr.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.soft_verbs_live.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.soft_verbs_hold_send_completions.argtypes = [ctypes.c_int]
    return lib


def live(hooks) -> tuple[int, int]:
    mrs = ctypes.c_int()
    return hooks.soft_verbs_live(ctypes.byref(mrs)), mrs.value


# -- the ABI, the real library ----------------------------------------------------------------
def _verbs_include(tmp_path: Path) -> Path | None:
    if Path("/usr/include/infiniband/verbs.h").exists():
        return Path("/usr/include")
    debs = sorted(glob.glob("/var/cache/apt/archives/libibverbs-dev_*.deb"))
    if debs and shutil.which("dpkg"):  # the image keeps rdma-core's headers in its package cache
        subprocess.run(["dpkg", "-x", debs[-1], str(tmp_path)], check=True)
        return tmp_path / "usr" / "include"
    return None


def test_the_declared_abi_matches_a_real_verbs_h(tmp_path):
    include = _verbs_include(tmp_path)
    if include is None:
        pytest.skip("no <infiniband/verbs.h> here (nor rdma-core's package in the apt cache)")
    done = subprocess.run([compiler(), "-std=c++17", "-fsyntax-only", f"-I{include}",
                           f"-I{ROOT / 'transport' / 'csrc'}", str(HERE / "verbs_abi_check.cpp")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_core_loads_the_libibverbs_pyverbs_loaded_and_says_why_it_cannot_open_a_device():
    pytest.importorskip("pyverbs.device", reason="pyverbs is not installed")
    path = verbs_library({})
    assert "libibverbs" in Path(path).name and Path(path).exists()
    assert verbs_library({"MEGAINFER_LIBIBVERBS": "/opt/x/libibverbs.so.1"}) == "/opt/x/libibverbs.so.1"
    try:
        devices = native.verbs_devices(path)  # every symbol the core uses resolved, by version
    except RuntimeError as exc:  # no RDMA in this kernel: the library's own error
        assert "ibv_get_device_list failed" in str(exc)
        devices = []
    if "mlx5_0" not in devices:
        with pytest.raises(RuntimeError, match=r"ibv_get_device_list failed|no verbs device named mlx5_0"):
            native.VerbsDomain(path, "mlx5_0")
    with pytest.raises(RuntimeError, match=r"libc\.so\.6 has no ibv_get_device_list \(not a libibverbs\?\)"):
        native.verbs_devices("libc.so.6")
    with pytest.raises(RuntimeError, match=r"cannot load /nonexistent/libibverbs\.so\.1"):
        native.verbs_devices("/nonexistent/libibverbs.so.1")


# -- a channel pair in the core ----------------------------------------------------------------
@pytest.fixture
def pair(soft_verbs, hooks):
    verbs = CoreVerbs(SOFT, soft_verbs)
    made = []

    def build(slot_bytes=256, num_slots=2, rank=3, sender=3, out_slots=None):
        out_qp = CoreQueuePair(verbs, slot_bytes, out_slots or num_slots)
        in_qp = CoreQueuePair(verbs, slot_bytes, num_slots)
        made.extend([out_qp, in_qp])
        out_qp.to_rts(in_qp.info())
        in_qp.to_rts(out_qp.info())
        out = native.VerbsOutChannel(out_qp.native, slot_bytes, out_qp.stride, out_slots or num_slots, rank, 5)
        inbound = native.VerbsInChannel(in_qp.native, slot_bytes, in_qp.stride, num_slots, sender)
        return out, inbound, out_qp, in_qp

    build.verbs = verbs
    yield build
    for qp in made:
        qp.close()
    assert live(hooks) == (0, 0)  # every queue pair destroyed, every region deregistered


def test_queue_pairs_get_the_reference_attributes(pair, hooks):
    lossless = dataclasses.replace(SOFT, traffic_class=106, service_level=3)  # DSCP 26, as a PFC fabric wants
    pair.verbs.choice = lossless
    _, _, out_qp, in_qp = pair()
    attr, state = (ctypes.c_uint8 * 256)(), ctypes.c_int()
    assert hooks.soft_verbs_attr(out_qp.native.qp_num, attr, ctypes.byref(state)) == 0
    raw = bytes(attr)
    fields = dict(zip(("qp_state", "cur", "path_mtu", "mig", "qkey", "rq_psn", "sq_psn", "dest_qp_num", "access"),
                      np.frombuffer(raw[:36], dtype=np.uint32)))
    assert state.value == 3  # RTS
    assert fields["dest_qp_num"] == in_qp.native.qp_num and fields["rq_psn"] == in_qp.psn
    assert fields["sq_psn"] == out_qp.psn and fields["path_mtu"] == rp.path_mtu(SOFT.mtu, SOFT.mtu)
    assert fields["access"] == 3  # LOCAL_WRITE | REMOTE_WRITE, at INIT
    ah = raw[56:88]  # ibv_qp_attr.ah_attr: the GRH (dgid, flow label, sgid index, hop limit, class), then dlid ...
    assert ah[:16] == SOFT_GID.raw and ah[20] == SOFT.gid.index and ah[21] == rdma.HOP_LIMIT
    assert ah[22] == 106 and ah[26] == 3  # the GRH's traffic class, the service level
    assert ah[29] == 1 and ah[30] == SOFT.port  # is_global, port_num
    reference = rdma.rtr_attr(lossless, in_qp.info()).ah_attr  # the pyverbs path gives the same
    assert (reference.traffic_class, reference.sl) == (106, 3)
    tail = raw[120:135]  # pkey_index .. alt_timeout
    assert tail[6:13] == bytes([rdma.MAX_RD_ATOMIC, rdma.MAX_RD_ATOMIC, rdma.MIN_RNR_TIMER, SOFT.port, rdma.TIMEOUT,
                                rdma.RETRY_CNT, rdma.RNR_RETRY])


def test_messages_land_in_place_and_credits_free_the_slots(pair):
    out, inbound, _, in_qp = pair()
    assert out.try_send(7, 1, 0, 0, 4, b"hello") and out.try_send(7, 1, 1, 0, 2, b"")
    assert not out.try_send(7, 1, 2, 0, 4, b"x")  # slot 0 still held by the peer
    got = inbound.poll()
    assert [(slot, Header._make(f).micro_batch, Header._make(f).seq) for slot, f in got] == [(0, 0, 0), (1, 1, 1)]
    start = rdma.payload_offset(0, in_qp.stride)
    assert bytes(in_qp.view[start:start + 5]) == b"hello"  # where a view of the slot reads it: no copy
    assert inbound.held == 2 and out.unreleased() == 2
    inbound.release(0)
    assert out.unreleased() == 1 and out.try_send(7, 1, 2, 0, 4, b"again")
    assert [Header._make(f).seq for _, f in inbound.poll()] == [2]


def test_a_full_send_queue_holds_messages_and_credits_back_until_a_completion_frees_room(soft_verbs, hooks):
    verbs = CoreVerbs(SOFT, soft_verbs)
    regions = [mmap.mmap(-1, rdma.region_bytes(slot_stride(256), 2)) for _ in range(2)]
    a = native.VerbsQueuePair(verbs.domain, regions[0], 1, 2)  # room for two send requests
    b = native.VerbsQueuePair(verbs.domain, regions[1], 1, 1)  # for one: its credits queue up
    try:
        for qp, peer in ((a, b), (b, a)):
            qp.connect(native.VerbsRoute(qp_num=peer.qp_num, psn=0, addr=peer.address, rkey=peer.rkey, path_mtu=5,
                                         is_global=True, dgid=SOFT_GID.raw, dlid=0, sgid_index=3, hop_limit=64,
                                         traffic_class=0, service_level=0, port=1, sq_psn=0, min_rnr_timer=12,
                                         timeout=14, retry_cnt=7, rnr_retry=7, max_rd_atomic=1))
        out = native.VerbsOutChannel(a, 256, slot_stride(256), 2, 0, 0)
        inbound = native.VerbsInChannel(b, 256, slot_stride(256), 2, 0)
        hooks.soft_verbs_hold_send_completions(1)  # the adapter has not reported any write yet
        assert out.try_send(0, 0, 0, 0, 0, b"a") and len(inbound.poll()) == 1
        inbound.release(0)  # b's one send request: this credit
        assert out.try_send(0, 0, 1, 0, 0, b"b") and len(inbound.poll()) == 1
        inbound.release(1)  # no room: the credit waits in the core
        assert not out.try_send(0, 0, 0, 0, 0, b"c") and not out.failed  # a's queue is full: held back
        assert out.unreleased() == 1  # slot 1's credit has not gone
        hooks.soft_verbs_hold_send_completions(0)
        assert inbound.poll() == [] and out.unreleased() == 0  # b's completion freed room, the credit went
        for seq, (mb, data) in enumerate(((0, b"c"), (1, b"d")), start=2):  # b keeps one receive posted
            assert out.try_send(0, 0, mb, 0, 0, data)
            assert [Header._make(f).seq for _, f in inbound.poll()] == [seq]
        assert not out.failed and inbound.violation == 0
    finally:
        hooks.soft_verbs_hold_send_completions(0)
        a.close()
        b.close()


def test_a_closed_channels_region_stays_mapped_while_the_core_holds_it(pair):
    out, inbound, _, in_qp = pair()
    assert out.try_send(1, 0, 0, 0, 0, b"x") and len(inbound.poll()) == 1
    in_qp.close()  # another thread's close, while a round may still copy out of a payload
    assert not in_qp.map.closed and inbound.poll() == []  # the mapping outlives the queue pair
    assert inbound.violation == native.CLOSED


def test_a_header_that_breaks_a_rule_is_the_channels_violation(pair):
    out, inbound, _, _ = pair(rank=4, sender=3)  # the peer claims another rank
    assert out.try_send(1, 0, 0, 0, 0, b"x")
    assert inbound.poll() == [] and inbound.violation == native.BAD_HEADER
    out, inbound, _, _ = pair(out_slots=1)  # the peer's slots disagree: micro-batch 1 lands in slot 0
    assert out.try_send(1, 0, 1, 0, 0, b"x")
    assert inbound.poll() == [] and inbound.violation == native.WRONG_SLOT


def test_a_dead_peer_fails_the_channel_with_its_completion_status(pair, hooks):
    out, inbound, _, in_qp = pair()
    assert out.try_send(1, 0, 0, 0, 0, b"x") and len(inbound.poll()) == 1
    hooks.soft_verbs_break(in_qp.native.qp_num)  # the receiving side's adapter gives up its queue pair
    out.try_send(1, 0, 1, 0, 0, b"y")  # posted; the adapter reports the failure in a completion
    assert not out.try_send(1, 0, 1, 0, 0, b"y") and out.failed
    assert out.failure()[:2] == (native.COMPLETION_FAILED, 12)  # transport retry counter exceeded
    assert inbound.poll() == [] and inbound.violation_info()[:2] == (native.COMPLETION_FAILED, 5)  # flushed


# -- whole endpoints over the core's rdma channels --------------------------------------------
@pytest.fixture
def rdma_star(soft_verbs, monkeypatch):
    """A hub and n spokes that choose rdma, on the software provider's device."""
    soft_device(monkeypatch, soft_verbs)
    made: list[Endpoint] = []

    def build(n: int, slot_bytes: int = 4096, timeout_s: float = 5.0):
        def spec(name: str, rank: int) -> EndpointSpec:
            return EndpointSpec(name=name, rank=rank, secret=SECRET, backend="rdma", slot_bytes=slot_bytes,
                                num_slots=2, timeout_s=timeout_s, core="on")
        hub = Endpoint(spec("hub", 0))
        spokes = [Endpoint(spec(f"s{i}", i + 1)) for i in range(n)]
        made.extend([hub, *spokes])
        connect_all({"hub": hub, **{s.spec.name: s for s in spokes}},
                    {"hub": [s.spec.name for s in spokes], **{s.spec.name: ["hub"] for s in spokes}})
        return hub, spokes, tuple(s.spec.name for s in spokes)

    yield build
    for ep in made:
        ep.close()


def test_endpoints_wire_core_rdma_channels_and_run_rounds_both_ways(rdma_star, hooks):
    hub, spokes, names = rdma_star(3)
    assert all(isinstance(ch, CoreRdmaOutbound) for ch in hub.outbound.values())
    assert all(isinstance(ch, CoreRdmaInbound) for ch in hub.inbound.values())
    assert isinstance(hub._round_table.round_for(names), CoreRound) and hub.backend_of("s0") == "rdma"
    data = torch.arange(3 * 64, dtype=torch.uint8)
    for step in range(4):
        mb = step % 2
        hub.post_rows(names, data, [1, 2, 3], 32, step=step, layer=1, micro_batch=mb)
        for i, spoke in enumerate(spokes):
            with spoke.recv("hub", micro_batch=mb, timeout=5) as msg:
                first = sum((1, 2, 3)[:i]) * 32
                assert msg.header.token_count == i + 1 and bytes(msg.data) == bytes(data[first:first + 32 * (i + 1)])
            spoke.send("hub", bytes([i]) * 16, step=step, layer=1, micro_batch=mb, token_count=1)
        with hub.collect_round(names, micro_batch=mb, timeout=5) as arrivals:
            assert [bytes(arrivals.payload(i)) for i in range(3)] == [bytes([i]) * 16 for i in range(3)]
    assert hub.slots_in_use() == IDLE and all(s.slots_in_use() == IDLE for s in spokes)


def test_a_round_sleeps_on_the_completion_channel_and_wakes_for_a_late_peer(rdma_star, hooks):
    hub, spokes, names = rdma_star(2)
    events = hooks.soft_verbs_events()
    spokes[0].send("hub", b"early", micro_batch=0)

    def late():
        time.sleep(0.3)  # past the round's spin: it sleeps on the completion channel's descriptor
        spokes[1].send("hub", b"late", micro_batch=0)

    thread = threading.Thread(target=late)
    t0 = time.monotonic()  # before the start: the late write then comes 0.3 s after t0 at the earliest
    thread.start()
    with hub.collect_round(names, micro_batch=0, timeout=5) as arrivals:
        waited = time.monotonic() - t0
        assert bytes(arrivals.payload(1)) == b"late"
    thread.join()
    assert 0.25 < waited < 1.5
    assert hooks.soft_verbs_events() > events  # the late write's completion woke it, not a nap's end


def test_a_peer_whose_queue_pair_dies_fails_the_round_alone_within_the_timeout(rdma_star, hooks):
    hub, spokes, names = rdma_star(2, timeout_s=1.0)
    victim = spokes[1].inbound["hub"].qp.native.qp_num  # s1's side of hub -> s1
    hooks.soft_verbs_break(victim)
    t0 = time.monotonic()
    with pytest.raises(RoundFailed) as failed:
        for mb in (0, 1, 0):  # the write's failure comes back in a completion, seen by a later post
            hub.post_round(names, np.zeros(64, np.uint8), [0, 32], [32, 64], [1, 1], micro_batch=mb)
            with spokes[0].recv("hub", micro_batch=mb, timeout=2):
                pass
    assert time.monotonic() - t0 < 2.0
    assert set(failed.value.failures) == {"s1"}
    assert "work completion failed on the channel of s1: transport retry counter exceeded" in str(failed.value)


def test_violations_are_worded_as_the_reference_words_them(pair):
    from transport.core_rdma import verbs_error

    class Channel:
        peer, num_slots, slot_bytes = "e0", 2, 256
        rules = type("R", (), {"sender": 3})()

    assert isinstance(verbs_error(Channel, native.COMPLETION_FAILED, 12, 0, (0,) * 9), PeerClosed)
    assert "transport retry counter exceeded (status 12" in str(verbs_error(Channel, native.COMPLETION_FAILED, 12,
                                                                            0, (0,) * 9))
    wrong = verbs_error(Channel, native.WRONG_SLOT, 0, 0, (0, 1, 0, 1, 3, 0, 0, 0, 0))
    assert isinstance(wrong, ProtocolViolation) and "a write tagged for slot 0 carries a header for micro-batch 1" \
        in str(wrong)
    credit = verbs_error(Channel, native.BAD_IMMEDIATE, (0 << 30) | 1, 1, (0,) * 9)
    assert "where a credit for a slot in use was expected" in str(credit)


# -- payloads from registered memory: no staging copy; GPU memory through a dma-buf -------------
class DeviceBuffer:
    """What a post and a registration see of a CUDA tensor (rounds.send_span, its device):
    a device address this CPU must never dereference. The bytes live in a memfd the software
    provider maps, as an adapter reaches a GPU's memory through the exported dma-buf."""

    is_cuda = True
    device = SimpleNamespace(type="cuda", index=0)

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes

    def data_ptr(self) -> int:
        return self.address

    def is_contiguous(self) -> bool:
        return True


def posts(hooks) -> tuple[int, int]:
    longest, moved = ctypes.c_int(), ctypes.c_uint64()
    return hooks.soft_verbs_posts(ctypes.byref(longest), ctypes.byref(moved)), longest.value


def test_a_payload_in_a_registered_buffer_is_written_from_it_not_copied_into_staging(pair, hooks):
    out, inbound, out_qp, in_qp = pair()
    source = np.frombuffer(bytes(range(200)), dtype=np.uint8).copy()
    domain = pair.verbs.domain
    token = domain.register_host(source.__array_interface__["data"][0], source.nbytes)
    calls = posts(hooks)[0]
    assert out.try_send(1, 0, 0, 0, 2, memoryview(source)[10:110])
    made, longest = posts(hooks)
    assert made == calls + 1 and longest == 2  # one post carried both work requests: payload, then header
    got = inbound.poll()
    start = rdma.payload_offset(0, in_qp.stride)
    assert Header._make(got[0][1]).byte_length == 100 and bytes(in_qp.view[start:start + 100]) == bytes(range(10, 110))
    staged = rdma.payload_offset(0, out_qp.stride)
    assert bytes(out_qp.view[staged:staged + 100]) == bytes(100)  # the sender's staging slot never held it
    inbound.release(got[0][0])
    assert out.try_send(1, 0, 0, 0, 1, b"copied")  # anywhere else: through staging, as before
    assert bytes(out_qp.view[staged:staged + 6]) == b"copied"
    domain.unregister(token)
    with pytest.raises(IndexError):
        domain.unregister(token)


def test_gpu_memory_goes_from_a_registered_dmabuf_and_is_refused_from_anywhere_else(rdma_star, hooks):
    hub, spokes, names = rdma_star(2)
    pattern = bytes(np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8))
    fd = os.memfd_create("gpu-stand-in")
    try:
        os.write(fd, pattern)
        iova = 0x7F00_0000_0000  # never mapped in this process: a CPU read of it would crash the test
        domain = hub.backends.rdma.opened.domain
        domain.register_dmabuf(fd, 0, len(pattern), iova)
    finally:
        os.close(fd)  # the registration keeps its own reference
    hub.post_round(names, DeviceBuffer(iova, len(pattern)), [0, 4096], [4096, 8192], [1, 1], micro_batch=1)
    for i, spoke in enumerate(spokes):
        with spoke.recv("hub", micro_batch=1, timeout=5) as msg:
            assert bytes(msg.data) == pattern[i * 4096:(i + 1) * 4096]
    with pytest.raises(TypeError, match=r"peer 0's channel cannot send from GPU memory .*Endpoint\.register"):
        hub.post_round(names, DeviceBuffer(iova + (1 << 20), 64), [0, 32], [32, 64], [1, 1], micro_batch=0)
    assert hub.slots_in_use() == IDLE  # the refused post sent nothing


def test_endpoint_register_reaches_the_cores_rdma_domain(rdma_star):
    hub, spokes, names = rdma_star(1)
    source = torch.arange(4096, dtype=torch.uint8)
    assert not hub.reads_in_place(source)
    hub.register(source)
    assert hub.backends.rdma.opened.domain.sources == 1
    assert hub.reads_in_place(source) and not hub.reads_in_place(source.clone())  # that very buffer
    hub.post_round(names, source, [100], [1100], [1], micro_batch=0)
    with spokes[0].recv("hub", micro_batch=0, timeout=5) as msg:
        assert bytes(msg.data) == bytes(source[100:1100].numpy())
    domain = hub.backends.rdma.opened.domain
    hub.close()
    assert domain.sources == 0  # deregistered with the endpoint, before the buffer may go


def test_a_cuda_tensor_given_to_register_goes_through_the_drivers_dmabuf_and_is_posted_from_the_gpu(
        rdma_star, stand_in_cuda, monkeypatch):
    monkeypatch.setattr("transport.cuda_dmabuf.LIBRARY", stand_in_cuda.path)
    hub, spokes, names = rdma_star(2)
    base = stand_in_cuda.stand_in_alloc(1 << 16)  # a "GPU" allocation; the tensor starts 512 bytes in
    pattern = bytes(np.random.default_rng(5).integers(0, 256, 8192, dtype=np.uint8))
    stand_in_cuda.stand_in_write(base + 512, pattern, len(pattern))
    tensor = DeviceBuffer(base + 512, len(pattern))
    hub.register(tensor)
    start, span = ctypes.c_uint64(), ctypes.c_size_t()
    stand_in_cuda.stand_in_last_export(ctypes.byref(start), ctypes.byref(span))
    assert (start.value, span.value) == (base, 3 * 4096)  # the host pages around [base + 512, + 8192)
    assert hub.backends.rdma.opened.domain.sources == 1
    hub.post_round(names, tensor, [0, 4096], [4096, 8192], [1, 1], micro_batch=0)
    for i, spoke in enumerate(spokes):
        with spoke.recv("hub", micro_batch=0, timeout=5) as msg:
            assert bytes(msg.data) == pattern[i * 4096:(i + 1) * 4096]


def test_a_gpu_whose_driver_cannot_export_is_said_once_and_its_posts_refused(rdma_star, stand_in_cuda, monkeypatch,
                                                                               caplog):
    monkeypatch.setattr("transport.cuda_dmabuf.LIBRARY", stand_in_cuda.path)
    stand_in_cuda.stand_in_set_dmabuf_supported(0)
    try:
        hub, spokes, names = rdma_star(1)
        tensor = DeviceBuffer(stand_in_cuda.stand_in_alloc(4096), 4096)
        hub.register(tensor)
    finally:
        stand_in_cuda.stand_in_set_dmabuf_supported(1)
    said = [r.getMessage() for r in caplog.records if "stays unregistered" in r.getMessage()]
    assert len(said) == 1 and "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0" in said[0]
    assert "cannot be sent from it (stage them through host memory)" in said[0]
    with pytest.raises(TypeError, match="cannot send from GPU memory"):
        hub.post_round(names, tensor, [0], [64], [1], micro_batch=0)


# -- writes into the regions peers exposed (device slots across hosts) -------------------------
def test_a_round_writes_into_the_regions_its_peers_exposed_and_their_headers_say_no_bytes(rdma_star, hooks):
    hub, spokes, names = rdma_star(3)
    regions = [torch.zeros(2, 512, dtype=torch.uint8) for _ in spokes]
    for spoke, region in zip(spokes[:2], regions):
        grant = spoke.expose(region)
        assert grant.address == region.data_ptr() and grant.nbytes == 1024 and not grant.device
        assert spoke.expose(region) == grant  # once per buffer
        hub.aim(spoke.spec.name, RegionGrant.from_plain(grant.to_plain()))  # as an owner's message carries it
    source = torch.arange(256, dtype=torch.uint8)
    for registered in (False, True):  # staged in the hub's slot first, then read where it lies
        if registered:
            hub.register(source)
        before = posts(hooks)[0]
        hub.post_round(names, source, [0, 100, 200], [100, 200, 256], [5, 6, 7], step=registered, layer=3,
                       micro_batch=1, targets=[512, 512 + 7, -1])  # spoke 2 takes its bytes in its slot
        made, longest = posts(hooks)
        assert made == before + 3 and longest == 2  # one post per peer; a region's is payload, then header
        for i, spoke in enumerate(spokes):
            with spoke.recv("hub", micro_batch=1, timeout=5) as msg:
                assert (msg.header.step, msg.header.layer, msg.header.token_count) == (registered, 3, 5 + i)
                if i < 2:
                    assert msg.header.byte_length == 0  # its bytes went to the region, placed before this arrived
                    at = 7 * i
                    assert bytes(regions[i][1, at:at + 100].numpy()) == bytes(source[100 * i:100 * (i + 1)].numpy())
                else:
                    assert bytes(msg.data) == bytes(source[200:256].numpy())
    assert bytes(regions[0][0].numpy()) == bytes(512)  # micro-batch 0's row untouched
    assert hub.slots_in_use() == IDLE and all(s.slots_in_use() == IDLE for s in spokes)


def test_a_region_write_leaves_its_mark_after_its_bytes_and_before_its_header(rdma_star, hooks):
    hub, spokes, names = rdma_star(2)
    regions = [torch.zeros(256, dtype=torch.uint8) for _ in spokes]
    for spoke, region in zip(spokes, regions):
        hub.aim(spoke.spec.name, spoke.expose(region))
    source = torch.arange(1, 41, dtype=torch.uint8)
    before = posts(hooks)[0]
    hub.post_round(names, source, [0, 40], [40, 40], [10, 0], step=7, layer=2, micro_batch=0, targets=[64, 128],
                   mark=0xDEADBEEF)
    made, longest = posts(hooks)
    assert made == before + 2 and longest == 3  # payload, mark, header in one chain; s1's header alone
    for spoke in spokes:
        with spoke.recv("hub", micro_batch=0, timeout=5) as msg:
            assert msg.header.byte_length == 0
    word = regions[0][64 - MARK_LEAD:64 - MARK_LEAD + 4].numpy().view(np.uint32)[0]
    assert word == 0xDEADBEEF and bytes(regions[0][64:104].numpy()) == bytes(source.numpy())
    assert not regions[0][64 - MARK_LEAD + 4:64].any()  # the mark's 4 bytes only
    assert not regions[1].any()  # no bytes for s1: no mark either (nothing of its row to wait for)
    with pytest.raises(ValueError, match="a mark .* goes with writes into exposed regions"):
        hub.post_round(names, source, [0, 0], [0, 0], [0, 0], mark=5)
    with pytest.raises(ValueError, match="a mark is a 32-bit word"):
        hub.post_round(names, source, [0, 0], [0, 0], [0, 0], targets=[64, 64], mark=1 << 32)
    with pytest.raises(PayloadTooLarge, match="no room for its mark"):
        hub.post_round(names, source, [0, 0], [40, 0], [10, 0], targets=[4, -1], mark=1)
    assert hub.slots_in_use() == IDLE


def test_a_post_into_a_region_is_refused_past_its_end_or_where_no_region_was_aimed(rdma_star):
    hub, spokes, names = rdma_star(2)
    hub.aim("s0", spokes[0].expose(torch.zeros(64, dtype=torch.uint8)))
    with pytest.raises(PayloadTooLarge, match="peer 0's 32 bytes at offset 40 lie past the region it exposed"):
        hub.post_round(names, torch.zeros(64, dtype=torch.uint8), [0, 32], [32, 64], [1, 1], targets=[40, -1])
    with pytest.raises(TypeError, match="peer 1's channel has no region of the peer's to write into"):
        hub.post_round(names, torch.zeros(64, dtype=torch.uint8), [0, 32], [32, 64], [1, 1], targets=[0, 0])
    with pytest.raises(ValueError, match="one region offset"):
        hub.post_round(names, torch.zeros(64, dtype=torch.uint8), [0, 32], [32, 64], [1, 1], targets=[0])
    hub.aim("s0", None)  # withdrawn
    with pytest.raises(TypeError, match="peer 0's channel has no region"):
        hub.post_round(names, torch.zeros(64, dtype=torch.uint8), [0, 32], [32, 64], [1, 1], targets=[0, -1])
    assert hub.slots_in_use() == IDLE  # nothing refused was sent
    with pytest.raises(TransportError, match="no peer 'nobody'"):
        hub.aim("nobody", None)


def test_a_round_into_regions_with_a_dead_peer_reaches_the_live_ones_and_names_the_dead(rdma_star, hooks):
    hub, spokes, names = rdma_star(2, timeout_s=1.0)
    regions = [torch.zeros(256, dtype=torch.uint8) for _ in spokes]
    for spoke, region in zip(spokes, regions):
        hub.aim(spoke.spec.name, spoke.expose(region))
    hooks.soft_verbs_break(spokes[1].inbound["hub"].qp.native.qp_num)  # s1's side of hub -> s1
    data = torch.arange(64, dtype=torch.uint8)
    with pytest.raises(RoundFailed) as failed:
        for mb in (0, 1, 0):  # the write's failure comes back in a completion, seen by a later post
            hub.post_round(names, data, [0, 32], [32, 64], [1, 1], micro_batch=mb, targets=[0, 0])
            with spokes[0].recv("hub", micro_batch=mb, timeout=2):
                pass
    assert set(failed.value.failures) == {"s1"}
    with spokes[0].recv("hub", timeout=2) as msg:  # the failed round's message to s0 went out
        mb = msg.header.micro_batch
    regions[0].zero_()
    assert "s1" in hub._dead  # dropped: the next targeted round goes to the live peers alone
    with pytest.raises(RoundFailed, match="failed for 1 peer") as failed:  # s1 known dead: the others still go
        hub.post_round(names, data, [0, 32], [32, 64], [3, 3], micro_batch=mb, targets=[64, 64])
    assert set(failed.value.failures) == {"s1"}
    with spokes[0].recv("hub", micro_batch=mb, timeout=2) as msg:
        assert msg.header.token_count == 3 and msg.header.byte_length == 0
    assert torch.equal(regions[0][64:96], data[:32])


def test_only_the_cores_rdma_channels_expose_and_aim(tmp_path):
    endpoints = {n: Endpoint(EndpointSpec(name=n, rank=i, secret=SECRET, backend="shm", slot_bytes=256, num_slots=2,
                                          timeout_s=5.0)) for i, n in enumerate(("a", "b"))}
    try:
        connect_all(endpoints, {"a": ["b"], "b": ["a"]})
        assert endpoints["b"].expose(torch.zeros(64, dtype=torch.uint8)) is None  # no peer could write into it
        source = torch.zeros(64, dtype=torch.uint8)
        endpoints["a"].register(source)
        assert not endpoints["a"].reads_in_place(source)  # shm copies it: no adapter reads it
        gpu = DeviceBuffer(0x7F00_0000_0000, 64)  # a round posted from GPU memory, whose shm peer's bytes go elsewhere
        endpoints["a"].post_round(("b",), gpu, [0], [0], [2], micro_batch=1)
        with endpoints["b"].recv("a", micro_batch=1, timeout=5) as msg:
            assert msg.header.byte_length == 0 and msg.header.token_count == 2
        with pytest.raises(TypeError, match="cannot send from GPU memory"):
            endpoints["a"].post_round(("b",), gpu, [0], [32], [1], micro_batch=0)
        with pytest.raises(TransportError, match="peer b's channel \\(shm\\) cannot write into a region"):
            endpoints["a"].aim("b", RegionGrant(0x1000, 64, 7, False))
    finally:
        for ep in endpoints.values():
            ep.close()


def test_gpu_memory_exposed_through_its_dmabuf_takes_a_peers_writes(rdma_star, stand_in_cuda, monkeypatch):
    monkeypatch.setattr("transport.cuda_dmabuf.LIBRARY", stand_in_cuda.path)
    hub, spokes, names = rdma_star(1)
    base = stand_in_cuda.stand_in_alloc(1 << 16)
    region = DeviceBuffer(base + 1024, 8192)  # never read by this CPU: the adapter writes it
    grant = spokes[0].expose(region)
    assert grant.device and grant.address == base + 1024 and grant.nbytes == 8192
    hub.aim("s0", grant)
    pattern = bytes(np.random.default_rng(7).integers(0, 256, 3000, dtype=np.uint8))
    hub.post_round(names, torch.frombuffer(bytearray(pattern), dtype=torch.uint8), [0], [3000], [3], micro_batch=0,
                   targets=[4096])
    with spokes[0].recv("hub", micro_batch=0, timeout=5) as msg:
        assert msg.header.byte_length == 0 and msg.header.token_count == 3
    landed = ctypes.create_string_buffer(3000)
    assert stand_in_cuda.stand_in_read(base + 1024 + 4096, landed, 3000) == 0
    assert landed.raw == pattern
    flushes = stand_in_cuda.stand_in_flushes()
    spokes[0].settle()
    assert stand_in_cuda.stand_in_flushes() == flushes  # the device orders the writes itself: no flush
    domain = spokes[0].backends.rdma.opened.domain
    spokes[0].close()
    assert domain.sources == 0  # the exposure ends with the endpoint


def test_a_gpu_that_does_not_order_rdma_writes_flushes_them_at_settle_or_is_refused(rdma_star, stand_in_cuda,
                                                                                    monkeypatch):
    monkeypatch.setattr("transport.cuda_dmabuf.LIBRARY", stand_in_cuda.path)
    hub, spokes, names = rdma_star(2)
    try:
        stand_in_cuda.stand_in_set_rdma_ordering(0, 1)  # CU_GPU_DIRECT_RDMA_WRITES_ORDERING_NONE, flush supported
        spokes[0].expose(DeviceBuffer(stand_in_cuda.stand_in_alloc(4096), 4096))
        flushes = stand_in_cuda.stand_in_flushes()
        spokes[0].settle()  # with no context current on this thread: the GPU's primary one is pushed around it
        assert stand_in_cuda.stand_in_flushes() == flushes + 1 and stand_in_cuda.stand_in_contexts_current() == 0
        stand_in_cuda.stand_in_set_rdma_ordering(0, 0)  # and no flush
        with pytest.raises(BackendUnavailable, match="neither orders GPUDirect RDMA writes .* nor can flush them"):
            spokes[1].expose(DeviceBuffer(stand_in_cuda.stand_in_alloc(4096), 4096))
    finally:
        stand_in_cuda.stand_in_set_rdma_ordering(100, 1)
    assert spokes[1].backends.rdma.opened.domain.sources == 0  # nothing registered


def test_the_waits_numpy_record_is_byte_for_byte_the_drivers_structure():
    """wait_values hands the driver a numpy record (wait_value_params); the driver reads
    CUstreamBatchMemOpParams (48 bytes each): the two agree on every byte, wide addresses and
    wrapped values too."""
    from transport.cuda_dmabuf import CU_STREAM_MEM_OP_WAIT_VALUE_32, _WaitValueParams, wait_value_params
    addresses = [0xFF7F_0000_0000 + 4096 * i for i in range(40)]
    values, flags = [1, -1, 2**32 + 5] + [7] * 37, 1 | 1 << 30
    structs = (_WaitValueParams * 40)()
    for param, address, value in zip(structs, addresses, values):
        param.operation, param.address, param.value, param.flags = (CU_STREAM_MEM_OP_WAIT_VALUE_32, address,
                                                                     value & 0xFFFFFFFF, flags)
    record = wait_value_params(addresses, values, flags)
    assert record.itemsize == ctypes.sizeof(_WaitValueParams) == 48
    assert record.tobytes() == bytes(structs)


@pytest.mark.parametrize("ordering, can_flush, flags, host_flushes", [
    (100, 0, 0x1, 0),  # the device orders the adapter's writes (Hopper): a plain EQ wait
    (0, 1, 0x1 | 1 << 30, 0),  # it does not and the stream can flush: EQ with CU_STREAM_WAIT_VALUE_FLUSH
    (0, 0, 0x1, 1),  # it does not and only the host can: the host flushes, then the stream waits
])
def test_a_stream_waits_on_the_marks_of_a_gpu_region_with_the_flush_its_device_needs(
        rdma_star, stand_in_cuda, monkeypatch, ordering, can_flush, flags, host_flushes):
    monkeypatch.setattr("transport.cuda_dmabuf.LIBRARY", stand_in_cuda.path)
    hub, spokes, names = rdma_star(1)
    try:
        stand_in_cuda.stand_in_set_rdma_ordering(ordering, 1)
        stand_in_cuda.stand_in_set_can_flush_remote_writes(can_flush)
        base = stand_in_cuda.stand_in_alloc(8192)
        hub.aim("s0", spokes[0].expose(DeviceBuffer(base, 8192)))
        hub.post_round(names, torch.arange(100, dtype=torch.uint8), [0], [100], [4], step=3, layer=1,
                       targets=[1024], mark=77)
        with spokes[0].recv("hub", micro_batch=0, timeout=5):
            pass
        waits, met = stand_in_cuda.stand_in_waits(), stand_in_cuda.stand_in_waits_met()
        flushes = stand_in_cuda.stand_in_flushes()
        spokes[0].hold_stream(0xABC, 0, [base + 1024 - MARK_LEAD, base + 1024 - MARK_LEAD], [77, 78])
        assert stand_in_cuda.stand_in_waits() == waits + 2  # one batch, both waits enqueued; the host went on
        assert stand_in_cuda.stand_in_waits_met() == met + 1  # the mark the adapter wrote; 78 never came
        assert stand_in_cuda.stand_in_last_wait_flags() == flags
        assert stand_in_cuda.stand_in_flushes() == flushes + host_flushes
        assert stand_in_cuda.stand_in_contexts_current() == 0
        # 300 words on torch's default stream (the NULL one): two calls, as a batch takes fewer than 256
        waits, batches = stand_in_cuda.stand_in_waits(), stand_in_cuda.stand_in_batches()
        spokes[0].hold_stream(0, 0, [base + 4 * i for i in range(300)], [0] * 300)
        assert stand_in_cuda.stand_in_waits() == waits + 300 and stand_in_cuda.stand_in_batches() == batches + 2
        with pytest.raises(ValueError, match="do not lie in one region of GPU 0 exposed"):
            spokes[0].hold_stream(0, 0, [base + 8190], [1])  # its 4 bytes run past the region
    finally:
        stand_in_cuda.stand_in_set_rdma_ordering(100, 1)
        stand_in_cuda.stand_in_set_can_flush_remote_writes(0)
    with pytest.raises(BackendUnavailable, match="no memory of GPU 1 is exposed"):
        spokes[0].hold_stream(0xABC, 1, [base], [1])
    with pytest.raises(BackendUnavailable, match="no memory of GPU 0 is exposed"):
        hub.hold_stream(0xABC, 0, [base], [1])  # the writer: it exposed nothing


def test_closing_the_endpoint_during_a_collect_ends_it_without_a_crash(rdma_star):
    """A deployment re-wiring closes a node's endpoint from another thread while its loop waits
    in a round (asleep on the completion channel): the wait ends in PeerClosed, and the regions
    stay mapped until the core lets go of them."""
    hub, spokes, names = rdma_star(2)
    spokes[0].send("hub", b"in", micro_batch=0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            hub.collect_round(names, micro_batch=0, timeout=5.0)
        except BaseException as exc:  # noqa: BLE001 - the test looks at what ended the wait
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    hub.close()
    waiter.join(3.0)
    assert not waiter.is_alive() and len(errors) == 1 and isinstance(errors[0], PeerClosed), errors


@pytest.mark.parametrize("wanted", ["auto", "on"])
def test_a_core_that_cannot_open_the_device_falls_back_loudly_unless_it_was_demanded(soft_verbs, monkeypatch, caplog,
                                                                                     wanted):
    soft_device(monkeypatch, "/nonexistent/libibverbs.so.1")
    reference = SimpleNamespace(close=lambda: None)  # stands for pyverbs' context
    monkeypatch.setattr(rdma.RdmaContext, "open", classmethod(lambda cls, environ=None, allowed=(): reference))
    ep = Endpoint(EndpointSpec(name="a0", rank=0, secret=SECRET, backend="rdma", core=wanted))
    try:
        if wanted == "on":
            with pytest.raises(HandshakeError, match=r"the M2N core cannot open soft0 through "
                                                     r"/nonexistent/libibverbs\.so\.1 \(cannot load"):
                ep.backends._rdma_resources()
        else:
            assert ep.backends._rdma_resources() is reference  # pyverbs' context: the reference's channels
            said = [r.getMessage() for r in caplog.records if "run on the pure-Python reference (pyverbs)" in
                    r.getMessage()]
            assert len(said) == 1 and "the M2N core cannot open soft0" in said[0]
    finally:
        ep.close()


def test_a_round_into_a_region_beside_a_peer_on_another_backend_posts_both(soft_verbs, monkeypatch):
    """A targeted round whose other peer's channel is not the core's (nixl): the rdma peer's
    bytes go into its region through the core, the other's per message, in one post_round."""
    available, reason = nixl.available()
    if not available:
        pytest.skip(reason)
    soft_device(monkeypatch, soft_verbs)

    def spec(name: str, rank: int, backend: str) -> EndpointSpec:
        return EndpointSpec(name=name, rank=rank, secret=SECRET, backend=backend, slot_bytes=4096, num_slots=2,
                            timeout_s=5.0, core="on")

    endpoints = {"hub": Endpoint(spec("hub", 0, "auto")), "s0": Endpoint(spec("s0", 1, "rdma")),
                 "s1": Endpoint(spec("s1", 2, "nixl"))}
    try:
        connect_all(endpoints, {"hub": ["s0", "s1"], "s0": ["hub"], "s1": ["hub"]})
        hub = endpoints["hub"]
        assert (hub.backend_of("s0"), hub.backend_of("s1")) == ("rdma", "nixl")
        assert hub.can_aim("s0") and not hub.can_aim("s1")
        region = torch.zeros(128, dtype=torch.uint8)
        hub.aim("s0", endpoints["s0"].expose(region))
        data = torch.arange(64, dtype=torch.uint8)
        hub.post_round(("s0", "s1"), data, [0, 32], [32, 64], [4, 5], micro_batch=1, targets=[16, -1])
        with endpoints["s0"].recv("hub", micro_batch=1, timeout=5) as msg:
            assert msg.header.byte_length == 0 and msg.header.token_count == 4
        with endpoints["s1"].recv("hub", micro_batch=1, timeout=5) as msg:
            assert bytes(msg.data) == bytes(data[32:64].numpy()) and msg.header.token_count == 5
        assert torch.equal(region[16:48], data[:32])
    finally:
        for ep in endpoints.values():
            ep.close()
