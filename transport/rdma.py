"""RDMA channels through pyverbs: RC queue pairs, write-with-immediate into the peer's slot.

The receiver registers its slot region (remote-writable) and posts receive work requests;
the sender copies header and payload into its own registered staging slot and posts one
RDMA write-with-immediate to the same slot offset on the receiver, the immediate carrying
the tag (kind, channel, slot; `transport.wire.pack_tag`). The receiver learns of the
message from its completion queue, reads it in place, and on release returns a credit:
a zero-byte write-with-immediate back to the sender. Queue-pair numbers, PSNs, GIDs,
rkeys and addresses cross over the authenticated TCP control connection (`wire.QPInfo`).

Where pyverbs or a verbs device is missing, `available()` says why and `Endpoint` picks
another backend (`auto`) or refuses (`rdma` requested). Device and port come from
MEGAINFER_RDMA_DEVICE (default: the first device), MEGAINFER_RDMA_PORT (1) and
MEGAINFER_RDMA_GID_INDEX (0; RoCE v2 often needs 3).
"""

from __future__ import annotations

import os
import random
import socket

from transport.errors import BackendUnavailable, HandshakeError, PeerClosed
from transport.shm import PAYLOAD_OFFSET, slot_stride
from transport.wire import HEADER_BYTES, IMM_CREDIT, IMM_DATA, Header, QPInfo, pack_tag, recv_json, send_json, unpack_tag

PATH_MTU = 5  # IBV_MTU_4096
RECV_DEPTH_PER_SLOT = 2


def available() -> tuple[bool, str]:
    """(True, "") where pyverbs finds a verbs device; otherwise (False, the reason)."""
    try:
        from pyverbs.device import get_device_list
    except ImportError:
        return False, "pyverbs is not installed (pip install --pre --only-binary=:all: pyverbs)"
    try:
        devices = get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when the kernel has no verbs support
        return False, f"no RDMA device ({exc})"
    if not devices:
        return False, "no RDMA device (the verbs device list is empty)"
    return True, ""


class RdmaContext:
    """This endpoint's device context and protection domain."""

    def __init__(self, ctx, pd, port: int, gid_index: int) -> None:
        self.ctx, self.pd, self.port, self.gid_index = ctx, pd, port, gid_index
        self.lid = ctx.query_port(port).lid
        self.gid = bytes.fromhex(ctx.query_gid(port, gid_index).gid.replace(":", ""))

    @classmethod
    def open(cls) -> "RdmaContext":
        ok, reason = available()
        if not ok:
            raise BackendUnavailable(f"rdma: {reason}")
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD

        name = os.environ.get("MEGAINFER_RDMA_DEVICE") or get_device_list()[0].name.decode()
        ctx = Context(name=name)
        return cls(ctx, PD(ctx), int(os.environ.get("MEGAINFER_RDMA_PORT", "1")),
                   int(os.environ.get("MEGAINFER_RDMA_GID_INDEX", "0")))

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


class _QueuePair:
    """One RC queue pair with its own completion queue and one registered region of slots."""

    def __init__(self, rc: RdmaContext, slot_bytes: int, num_slots: int) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.mr import MR
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.rc = rc
        self.stride = slot_stride(slot_bytes)
        self.num_slots = num_slots
        depth = num_slots * RECV_DEPTH_PER_SLOT + 8
        self.cq = CQ(rc.ctx, 2 * depth)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.mr = MR(rc.pd, self.stride * num_slots, access)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(rc.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap),
                     QPAttr(port_num=rc.port))
        self.psn = random.getrandbits(24)
        self.remote: QPInfo | None = None
        for _ in range(depth - 8):
            self.post_recv()

    def info(self) -> QPInfo:
        return QPInfo(self.qp.qp_num, self.psn, self.rc.lid, self.rc.port, self.rc.gid_index, self.rc.gid,
                      self.mr.rkey, self.mr.buf, self.stride)

    def to_rts(self, remote: QPInfo) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.rc.port)
        attr.dest_qp_num = remote.qp_num
        attr.path_mtu = PATH_MTU
        attr.rq_psn = self.psn
        attr.sq_psn = remote.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        gr = GlobalRoute(dgid=GID(remote.gid_text), sgid_index=self.rc.gid_index)
        attr.ah_attr = AHAttr(port_num=self.rc.port, is_global=1, gr=gr, dlid=remote.lid)
        self.qp.to_rts(attr)
        self.remote = remote

    def post_recv(self) -> None:
        from pyverbs.wr import RecvWR

        self.qp.post_recv(RecvWR(wr_id=0, num_sge=0))

    def write_with_imm(self, local_offset: int, length: int, remote_offset: int, tag: int) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        sge = [SGE(self.mr.buf + local_offset, length, self.mr.lkey)] if length else []
        wr = SendWR(wr_id=tag, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=len(sge), sg=sge or None,
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.imm_data = socket.htonl(tag)
        wr.set_wr_rdma(self.remote.rkey, self.remote.addr + remote_offset)
        self.qp.post_send(wr)

    def completions(self, peer: str) -> list[tuple[int, int, int]]:
        """Received immediates as (kind, channel, slot); send completions are checked and dropped."""
        import pyverbs.enums as e

        out = []
        while True:
            n, wcs = self.cq.poll(16)
            if n == 0:
                return out
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise PeerClosed(f"rdma: work completion with status {wc.status} on the channel of {peer}")
                if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                    self.post_recv()
                    out.append(unpack_tag(socket.ntohl(wc.imm_data)))

    def close(self) -> None:
        self.qp.close()
        self.mr.close()
        self.cq.close()


class RdmaInbound:
    """peer -> this endpoint: the peer writes into this side's registered slots."""

    kind = "rdma"

    def __init__(self, peer: str, slot_bytes: int, num_slots: int, qp: _QueuePair, control: socket.socket) -> None:
        self.peer, self.slot_bytes, self.num_slots, self.qp, self.control = peer, slot_bytes, num_slots, qp, control
        self.ready: list[int] = []

    @classmethod
    def accept(cls, rc: RdmaContext, peer: str, slot_bytes: int, num_slots: int, sock: socket.socket,
               ack: dict) -> "RdmaInbound":
        qp = _QueuePair(rc, slot_bytes, num_slots)
        send_json(sock, {**ack, "rdma": qp.info().pack().hex()})
        reply = recv_json(sock)
        try:
            qp.to_rts(QPInfo.unpack(bytes.fromhex(reply["rdma"])))
        except (KeyError, ValueError) as exc:
            raise HandshakeError(f"rdma: malformed queue-pair info from {peer} ({exc})") from None
        return cls(peer, slot_bytes, num_slots, qp, sock)

    def poll(self) -> list[tuple[int, Header]]:
        done = []
        view = self.qp.mr.read(self.qp.stride * self.num_slots, 0)
        for kind, _, slot in self.qp.completions(self.peer):
            if kind == IMM_DATA:
                done.append((slot, Header.unpack_from(view, slot * self.qp.stride + PAYLOAD_OFFSET - HEADER_BYTES)))
        return done

    def payload(self, slot: int, length: int) -> memoryview:
        start = slot * self.qp.stride + PAYLOAD_OFFSET
        return memoryview(self.qp.mr.read(length, start))

    def release(self, slot: int) -> None:
        self.qp.write_with_imm(0, 0, 0, pack_tag(IMM_CREDIT, 0, slot))

    def close(self) -> None:
        self.qp.close()


class RdmaOutbound:
    """this endpoint -> peer: stages each message in a registered slot, then writes it across."""

    kind = "rdma"

    def __init__(self, peer: str, channel_id: int, slot_bytes: int, num_slots: int, qp: _QueuePair,
                 control: socket.socket) -> None:
        self.peer, self.channel_id, self.slot_bytes, self.num_slots = peer, channel_id, slot_bytes, num_slots
        self.qp, self.control = qp, control
        self.busy = [False] * num_slots

    @classmethod
    def connect(cls, rc: RdmaContext, peer: str, channel_id: int, slot_bytes: int, num_slots: int,
                sock: socket.socket, remote_hex: str) -> "RdmaOutbound":
        qp = _QueuePair(rc, slot_bytes, num_slots)
        try:
            qp.to_rts(QPInfo.unpack(bytes.fromhex(remote_hex)))
        except ValueError as exc:
            raise HandshakeError(f"rdma: malformed queue-pair info from {peer} ({exc})") from None
        send_json(sock, {"rdma": qp.info().pack().hex()})
        return cls(peer, channel_id, slot_bytes, num_slots, qp, sock)

    def try_send(self, header: Header, payload) -> bool:
        slot = header.micro_batch % self.num_slots
        if self.busy[slot]:
            for kind, _, freed in self.qp.completions(self.peer):
                if kind == IMM_CREDIT:
                    self.busy[freed] = False
            if self.busy[slot]:
                return False
        offset = slot * self.qp.stride + PAYLOAD_OFFSET - HEADER_BYTES
        self.qp.mr.write(header.pack() + bytes(payload), HEADER_BYTES + header.byte_length, offset)
        self.qp.write_with_imm(offset, HEADER_BYTES + header.byte_length, offset, pack_tag(IMM_DATA, self.channel_id, slot))
        self.busy[slot] = True
        return True

    def close(self) -> None:
        self.qp.close()
