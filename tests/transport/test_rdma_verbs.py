"""The RDMA channel's verbs objects and data path without a device.

pyverbs' work requests, SGEs, QP attributes, address vectors and work completions are real
(they need no device); only the calls that reach an adapter are emulated: `SoftQueuePair`
runs transport.rdma._QueuePair's own code (attributes, write plans, completion decoding,
the channels on top) with `_build` and `_post` replaced, and its `_post` does what the
adapter would with a write-with-immediate plan: check the keys and bounds, copy the bytes
from the local address to the remote address, and complete a receive at the peer."""

from __future__ import annotations

import ctypes
import mmap
import socket
import struct
from types import SimpleNamespace

import pytest

pytest.importorskip("pyverbs.wr", reason="pyverbs is not installed (pip install --pre --only-binary=:all: pyverbs)")

import pyverbs.enums as e  # noqa: E402
from pyverbs.cq import WC  # noqa: E402
from pyverbs.pyverbs_error import PyverbsUserError  # noqa: E402
from pyverbs.wr import SendWR  # noqa: E402

from transport import rdma  # noqa: E402
from transport.cuda_dmabuf import CudaDriver  # noqa: E402
from transport import rdma_port as rp  # noqa: E402
from transport.errors import BackendUnavailable, HandshakeError, PeerClosed  # noqa: E402
from transport.shm import slot_stride  # noqa: E402
from transport.wire import (HEADER_BYTES, IMM_CREDIT, IMM_DATA, QP_INFO, Header, QPInfo, pack_tag,  # noqa: E402
                            unpack_tag)

ROCE_GID = rp.GidEntry(3, "0000:0000:0000:0000:0000:ffff:0a00:0005", rp.ROCE_V2, "ens1f0np0")
IB_GID = rp.GidEntry(0, "fe80:0000:0000:0000:b83f:d203:00a1:b2c4", rp.IB)
ROCE = rp.PortChoice("mlx5_0", 1, rp.LINK_ETHERNET, 0, 5, ROCE_GID)
IB = rp.PortChoice("mlx5_2", 1, rp.LINK_INFINIBAND, 17, 5, IB_GID)


def peer_info(**changes) -> QPInfo:
    fields = dict(qp_num=0x1C2, psn=0x5A5A5, lid=0, port=1, gid_index=3,
                  gid=bytes.fromhex("00000000000000000000ffff0a000007"), rkey=0x2233, addr=0x7F12_3456_0000,
                  slot_stride=slot_stride(4096), mtu=3, link_layer=rp.LINK_ETHERNET)
    return QPInfo(**{**fields, **changes})


def sge_of(wr) -> tuple[int, int, int] | None:
    """(addr, length, lkey) of a WR's first SGE where this pyverbs exposes sg_list (>= v63)."""
    try:
        address = wr.sg_list
    except AttributeError:
        return None
    sge = ctypes.cast(address, ctypes.POINTER(ctypes.c_uint64 * 2)).contents
    return sge[0], sge[1] & 0xFFFFFFFF, sge[1] >> 32


def imm_on_the_wire(wr) -> bytes:
    return struct.pack("=I", wr.imm_data)  # the bytes as they sit in ibv_send_wr (a __be32)


# -- layout -----------------------------------------------------------------------------------
def test_slots_never_overlap_the_scratch_bytes():
    stride = slot_stride(1000)
    for scratch in (rdma.RECV_SINK, rdma.CREDIT_SOURCE, rdma.CREDIT_SINK):
        assert scratch + rdma.SCRATCH_BYTES <= rdma.SLOTS_OFFSET == rdma.slot_offset(0, stride)
    assert rdma.header_offset(2, stride) == 64 + 2 * stride + 64
    assert rdma.payload_offset(2, stride) == rdma.header_offset(2, stride) + HEADER_BYTES
    assert rdma.payload_offset(3, stride) + 1000 <= rdma.region_bytes(stride, 4)


# -- work requests ------------------------------------------------------------------------------
def test_data_write_plan_and_its_work_request():
    remote, stride = peer_info(), slot_stride(4096)
    plan = rdma.data_write(2, 1000, stride, 0x10_0000, 0x77, remote, channel=5)
    offset = 64 + 2 * stride + 64
    assert plan == rdma.Write(0x10_0000 + offset, HEADER_BYTES + 1000, 0x77, remote.addr + offset, remote.rkey,
                              pack_tag(IMM_DATA, 5, 2))
    wr = rdma.send_wr(plan)
    assert (wr.num_sge, wr.opcode, wr.send_flags, wr.wr_id) == \
        (1, e.IBV_WR_RDMA_WRITE_WITH_IMM, e.IBV_SEND_SIGNALED, plan.tag)
    assert imm_on_the_wire(wr) == struct.pack(">I", plan.tag)  # network byte order
    assert unpack_tag(socket.ntohl(wr.imm_data)) == (IMM_DATA, 5, 2)  # what the receiver decodes
    if hasattr(wr, "rdma_remote_addr"):  # pyverbs >= v63 reads these back
        assert (wr.rdma_remote_addr, wr.rdma_rkey) == (plan.remote_addr, plan.rkey)
    if sge_of(wr) is not None:
        assert sge_of(wr) == (plan.local_addr, plan.length, plan.lkey)
    wr.close()


def test_a_header_only_message_still_carries_the_header():
    plan = rdma.data_write(0, 0, slot_stride(64), 0x1000, 1, peer_info(), channel=0)
    assert plan.length == HEADER_BYTES
    assert rdma.send_wr(plan).num_sge == 1


def test_credit_write_is_one_scratch_byte_into_the_peers_credit_sink():
    remote = peer_info()
    tag = pack_tag(IMM_CREDIT, 0, 7)
    plan = rdma.credit_write(tag, 0x20_0000, 0x99, remote)
    assert plan == rdma.Write(0x20_0000 + rdma.CREDIT_SOURCE, 1, 0x99, remote.addr + rdma.CREDIT_SINK, remote.rkey, tag)
    assert plan.remote_addr + plan.length <= remote.addr + rdma.SLOTS_OFFSET
    wr = rdma.send_wr(plan)
    assert (wr.num_sge, wr.opcode) == (1, e.IBV_WR_RDMA_WRITE_WITH_IMM)
    assert unpack_tag(socket.ntohl(wr.imm_data)) == (IMM_CREDIT, 0, 7)


def test_receive_work_request_has_a_one_byte_sge():
    wr = rdma.recv_wr(0x30_0000, 0x42)
    assert wr.num_sge == 1
    if sge_of(wr) is not None:
        assert sge_of(wr) == (0x30_0000 + rdma.RECV_SINK, 1, 0x42)


def test_pyverbs_refuses_a_send_wr_without_an_sge():
    # why every WR here carries one (pyverbs/wr.pyx, SendWR.__init__)
    with pytest.raises(PyverbsUserError, match="A WR needs at least one SGE"):
        SendWR(opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=0)


# -- queue-pair attributes -------------------------------------------------------------------------
def test_init_attr_carries_the_access_flags():
    attr = rdma.init_attr(2)
    assert attr.qp_access_flags == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    assert (attr.qp_state, attr.port_num, attr.pkey_index) == (e.IBV_QPS_INIT, 2, 0)


def test_rtr_attr_over_roce():
    remote = peer_info(mtu=3)
    attr = rdma.rtr_attr(ROCE, remote)
    assert (attr.qp_state, attr.path_mtu, attr.dest_qp_num, attr.rq_psn) == (e.IBV_QPS_RTR, 3, 0x1C2, 0x5A5A5)
    assert (attr.max_dest_rd_atomic, attr.min_rnr_timer, attr.port_num) == (1, 12, 1)
    ah = attr.ah_attr
    assert (ah.is_global, ah.sgid_index, ah.dgid, ah.hop_limit, ah.port_num) == \
        (1, 3, "0000:0000:0000:0000:0000:ffff:0a00:0007", 64, 1)
    assert rdma.rtr_attr(ROCE, peer_info(mtu=5)).path_mtu == 5  # both 4096: 4096


def test_rtr_attr_over_infiniband_routes_by_lid():
    remote = peer_info(lid=23, mtu=4, link_layer=rp.LINK_INFINIBAND)
    attr = rdma.rtr_attr(IB, remote)
    assert (attr.path_mtu, attr.ah_attr.is_global, attr.ah_attr.dlid) == (4, 0, 23)
    with pytest.raises(HandshakeError, match="LID 0"):
        rdma.rtr_attr(IB, peer_info(lid=0, link_layer=rp.LINK_INFINIBAND))


def test_rtr_attr_refuses_peers_it_cannot_reach():
    with pytest.raises(HandshakeError, match="the peer's RDMA port is InfiniBand, port 1 of mlx5_0 is Ethernet"):
        rdma.rtr_attr(ROCE, peer_info(link_layer=rp.LINK_INFINIBAND))
    with pytest.raises(HandshakeError, match="invalid RDMA MTU"):
        rdma.rtr_attr(ROCE, peer_info(mtu=0))


def test_rts_attr():
    attr = rdma.rts_attr(0xABCDE)
    assert (attr.qp_state, attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic) == \
        (e.IBV_QPS_RTS, 0xABCDE, 14, 7, 7, 1)


def test_qp_info_carries_mtu_and_link_layer():
    info = peer_info()
    packed = info.pack()
    assert len(packed) == QP_INFO.size == 46
    assert QPInfo.unpack(packed) == info and (info.mtu, info.link_layer) == (3, rp.LINK_ETHERNET)


# -- the data path over an emulated adapter -------------------------------------------------------
class SoftRegion:
    def __init__(self, nbytes: int, key: int) -> None:
        self.nbytes, self.map = nbytes, mmap.mmap(-1, nbytes)
        self.addr, self.view = rdma.buffer_address(self.map), memoryview(self.map)
        self.mr = SimpleNamespace(lkey=key, rkey=key + 1)

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.nbytes

    def close(self) -> None:
        self.view.release()


class SoftCQ:
    def __init__(self) -> None:
        self.queue: list[WC] = []

    def poll(self, n: int):
        taken, self.queue = self.queue[:n], self.queue[n:]
        return len(taken), taken

    def close(self) -> None:
        pass


class SoftQP:
    qp_num = 0x100

    def __init__(self) -> None:
        self.receives, self.attrs = 0, []

    def post_recv(self, wr) -> None:
        assert wr.num_sge == 1
        self.receives += 1

    def to_rtr(self, attr) -> None:
        self.attrs.append(attr)

    def to_rts(self, attr) -> None:
        self.attrs.append(attr)

    def close(self) -> None:
        pass


class SoftQueuePair(rdma._QueuePair):
    """rdma._QueuePair with the adapter emulated; `peer` is the other end."""

    keys = iter(range(0x100, 0x10000, 0x10))
    peer: "SoftQueuePair"

    def _build(self, depth: int) -> None:
        self.region = SoftRegion(rdma.region_bytes(self.stride, self.num_slots), next(self.keys))
        self.cq, self.qp = SoftCQ(), SoftQP()
        self._recv_wr = rdma.recv_wr(self.region.addr, self.mr.lkey)
        for _ in range(depth):
            self.qp.post_recv(self._recv_wr)

    def _post(self, write: rdma.Write) -> None:
        target = self.peer.region
        assert write.lkey == self.mr.lkey and self.region.contains(write.local_addr, write.length)
        if write.rkey != target.mr.rkey or not target.contains(write.remote_addr, write.length):
            self.cq.queue.append(WC(wr_id=write.tag, status=e.IBV_WC_REM_ACCESS_ERR, opcode=e.IBV_WC_RDMA_WRITE))
            return
        ctypes.memmove(write.remote_addr, write.local_addr, write.length)
        self.peer.cq.queue.append(WC(status=e.IBV_WC_SUCCESS, opcode=e.IBV_WC_RECV_RDMA_WITH_IMM,
                                     imm_data=socket.htonl(write.tag), byte_len=write.length,
                                     wc_flags=e.IBV_WC_WITH_IMM))
        self.cq.queue.append(WC(wr_id=write.tag, status=e.IBV_WC_SUCCESS, opcode=e.IBV_WC_RDMA_WRITE))


def soft_channel(slot_bytes=256, num_slots=2, choice=ROCE):
    rc = rdma.RdmaContext(None, None, choice)
    a, b = SoftQueuePair(rc, slot_bytes, num_slots), SoftQueuePair(rc, slot_bytes, num_slots)
    a.peer, b.peer = b, a
    a.to_rts(b.info())
    b.to_rts(a.info())
    out = rdma.RdmaOutbound("e0", 3, slot_bytes, num_slots, a, control=None)
    inbound = rdma.RdmaInbound("a0", slot_bytes, num_slots, b, control=None, sender=0)
    return out, inbound


def test_queue_pairs_connect_with_each_others_numbers():
    out, inbound = soft_channel()
    a, b = out.qp, inbound.qp
    rtr, rts = a.qp.attrs
    assert (rtr.dest_qp_num, rtr.rq_psn, rtr.path_mtu, rtr.ah_attr.sgid_index) == (b.qp.qp_num, b.psn, 5, 3)
    assert rts.sq_psn == a.psn == b.qp.attrs[0].rq_psn  # what a sends from is what b expects
    assert a.qp.receives == 2 * 2 + rdma.EXTRA_DEPTH  # receives posted before RTR, one WR for all
    info = a.info()
    assert (info.addr, info.rkey, info.mtu, info.link_layer, info.gid) == \
        (a.region.addr, a.mr.rkey, 5, rp.LINK_ETHERNET, ROCE_GID.raw)


def test_messages_arrive_in_place_and_slots_return_on_credit():
    out, inbound = soft_channel(slot_bytes=256, num_slots=2)
    payload = bytes(range(200))
    assert out.try_send(Header(step=1, micro_batch=0, token_count=4, seq=0, byte_length=200), memoryview(payload))
    assert out.try_send(Header(step=1, micro_batch=1, seq=1, byte_length=0), b"")  # header only
    got = inbound.poll()
    assert [(slot, h.seq, h.byte_length) for slot, h in got] == [(0, 0, 200), (1, 1, 0)]
    view = inbound.payload(0, 200)
    assert bytes(view) == payload
    # a view of the registered slot, not a copy: the region's bytes are the payload's bytes
    assert ctypes.addressof(ctypes.c_char.from_buffer(view)) == \
        inbound.qp.region.addr + rdma.payload_offset(0, inbound.qp.stride)
    del view
    assert not out.try_send(Header(micro_batch=2, seq=2, byte_length=3), b"abc")  # slot 0 is still held
    inbound.release(0)
    assert out.try_send(Header(micro_batch=2, seq=2, byte_length=3), b"abc")
    assert [(slot, h.seq) for slot, h in inbound.poll()] == [(0, 2)]
    assert bytes(inbound.payload(0, 3)) == b"abc"
    # the credit landed in the sender's credit sink, not in a slot
    assert out.qp.region.view[rdma.CREDIT_SINK] == out.qp.region.view[rdma.CREDIT_SOURCE]


def test_sender_copies_any_byte_buffer_into_its_staging_slot():
    out, inbound = soft_channel(slot_bytes=64, num_slots=1)
    words = memoryview(struct.pack("<4I", 1, 2, 3, 4)).cast("I")  # not a byte view
    assert out.try_send(Header(byte_length=16), words)
    slot, header = inbound.poll()[0]
    assert bytes(inbound.payload(slot, header.byte_length)) == struct.pack("<4I", 1, 2, 3, 4)


def test_zero_length_write_with_imm_becomes_a_scratch_write():
    out, inbound = soft_channel()
    out.qp.write_with_imm(0, 0, 0, pack_tag(IMM_DATA, 0, 0))  # the bench's bare acknowledgement
    assert inbound.qp.completions("a0") == [(IMM_DATA, 0, 0)]
    assert inbound.qp.region.view[rdma.SLOTS_OFFSET:].tobytes() == bytes(inbound.qp.region.nbytes - rdma.SLOTS_OFFSET)
    with pytest.raises(ValueError, match="outside the slots"):
        out.qp.write_with_imm(0, 8, 0, 0)  # would clobber the peer's scratch bytes


def test_a_failed_completion_names_the_peer():
    out, inbound = soft_channel()
    out.qp.remote = QPInfo(**{**out.qp.remote.__dict__, "rkey": 1})  # a stale key: the adapter refuses
    out.try_send(Header(byte_length=1), b"x")
    with pytest.raises(PeerClosed, match="work completion failed on the channel of e0: remote access error"):
        out.try_send(Header(micro_batch=1, byte_length=1), b"y")


def test_a_header_beyond_the_slot_is_refused():
    out, inbound = soft_channel(slot_bytes=64, num_slots=1)
    region = out.qp.region
    Header(byte_length=65).pack_into(region.view, rdma.header_offset(0, out.qp.stride))
    out.qp.write_with_imm(rdma.header_offset(0, out.qp.stride), HEADER_BYTES, rdma.header_offset(0, out.qp.stride),
                          pack_tag(IMM_DATA, 3, 0))
    with pytest.raises(PeerClosed, match="header announces 65 payload bytes for a 64-byte slot"):
        inbound.poll()


def test_slot_stride_mismatch_is_a_handshake_error():
    rc = rdma.RdmaContext(None, None, ROCE)
    qp = SoftQueuePair(rc, 256, 1)
    with pytest.raises(HandshakeError, match="disagree on slot_bytes"):
        qp.to_rts(peer_info(slot_stride=slot_stride(512)))


# -- memory ------------------------------------------------------------------------------------------
def test_buffer_address_is_the_memory_the_view_writes():
    region = mmap.mmap(-1, mmap.PAGESIZE)
    addr = rdma.buffer_address(region)
    assert addr % mmap.PAGESIZE == 0  # registration wants page-aligned memory
    memoryview(region)[100:105] = b"hello"
    assert ctypes.string_at(addr + 100, 5) == b"hello"
    region.close()  # no export left behind


def test_dmabuf_span_is_host_page_aligned():
    assert rdma.dmabuf_span(0x7F00_0000_1010, 100, page=4096) == (0x7F00_0000_1000, 4096, 0x10)
    assert rdma.dmabuf_span(0x7F00_0000_1FF0, 0x20, page=4096) == (0x7F00_0000_1000, 8192, 0xFF0)
    assert rdma.dmabuf_span(0x7F00_0000_2000, 4096, page=4096) == (0x7F00_0000_2000, 4096, 0)


def test_dmabuf_registration_reasons_without_cuda():
    torch = pytest.importorskip("torch")
    with pytest.raises(BackendUnavailable, match="dma-buf registration takes a CUDA tensor; this one is on cpu"):
        rdma.register_cuda_tensor(None, torch.zeros(16, dtype=torch.uint8))
    try:
        CudaDriver()
    except BackendUnavailable as exc:
        assert str(exc).startswith("no CUDA driver to export GPU memory as a dma-buf (libcuda.so.1")
    else:
        pytest.skip("a CUDA driver is installed here")


# -- the probe's loopback check, over the emulated adapter ------------------------------------------
class LoopbackPair(SoftQueuePair):
    """Soft queue pairs that find each other by queue-pair number, as the adapter does."""

    by_number: dict = {}

    def _build(self, depth: int) -> None:
        super()._build(depth)
        self.qp.qp_num = 0x200 + len(self.by_number)
        self.by_number[self.qp.qp_num] = self

    def to_rts(self, remote: QPInfo) -> None:
        super().to_rts(remote)
        self.peer = self.by_number[remote.qp_num]


class DroppingPair(LoopbackPair):
    def _post(self, write: rdma.Write) -> None:
        pass  # the packet never arrives (e.g. RoCE loopback blocked)


class RetryExceededPair(LoopbackPair):
    def _post(self, write: rdma.Write) -> None:
        self.cq.queue.append(WC(wr_id=write.tag, status=e.IBV_WC_RETRY_EXC_ERR, opcode=e.IBV_WC_RDMA_WRITE))


def test_loopback_write_passes_over_a_working_port():
    assert rdma.loopback_write(rdma.RdmaContext(None, None, ROCE), 1.0, queue_pair=LoopbackPair) == ""


def test_loopback_write_reasons():
    rc = rdma.RdmaContext(None, None, ROCE)
    assert rdma.loopback_write(rc, 0.05, queue_pair=DroppingPair) == (
        "loopback write did not complete within 0.05 s on port 1 of mlx5_0 "
        "(Ethernet, MTU 4096, GID 3 (RoCE v2 ::ffff:10.0.0.5 on ens1f0np0))")
    reason = rdma.loopback_write(rc, 1.0, queue_pair=RetryExceededPair)
    assert reason.startswith("loopback queue-pair check failed on port 1 of mlx5_0")
    assert "retry exceeded error" in reason
