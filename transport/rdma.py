"""RDMA channels through pyverbs: RC queue pairs, write-with-immediate into the peer's slot.

Each channel (one direction, one peer) has its own RC queue pair, completion queue and one
registered region of memory this module allocates (an anonymous shared mmap, registered
with `MR(pd, length, access, address=...)`), read and written through a memoryview on it:
headers are read and payloads handed out in place, never copied out of the region.

Region layout (offsets from the region's base; the same on both sides of a channel):
    0    8   receive sink: the 1-byte SGE of every posted receive. A write-with-immediate
             places no bytes in the receive buffer, but verbs wants a valid SGE there.
    8    8   credit source: the byte a credit write carries
    16   8   credit sink: where the peer's credit writes land (never read)
    24   40  reserved
    64   then `num_slots` slots of `stride` bytes (`transport.shm.slot_stride`), each:
             0  64 reserved   64  32 message header   96  ... payload (slot_bytes)
Slots never overlap the scratch bytes, so a credit can never clobber a message.

Work requests (every one carries exactly one SGE; pyverbs refuses WRs without one):
    receive        1 byte at the receive sink; one posted per expected immediate, reposted
                   as each completes (2 * num_slots + 8 outstanding)
    data write     RDMA write-with-immediate of header + payload (the header alone for an
                   empty message) from this side's staging slot to the same offset in the
                   peer's slot; the immediate is the tag (`wire.pack_tag`: data, channel,
                   slot) in network byte order; signaled
    credit write   RDMA write-with-immediate of the 1-byte credit source to the peer's
                   credit sink, tag (credit, 0, slot); signaled
The sender copies the payload into its staging slot with one slice assignment, writes the
header in front and posts the data write. The receiver learns of it from a receive
completion (the bytes are in place before the completion is seen), hands out a view of the
slot, and on release posts a credit write; the sender frees the slot when that credit's
receive completion arrives. Send completions are checked for errors and dropped.

What the peer's writes say is checked before it is trusted: a data immediate must name a
slot of the channel that its header's micro-batch selects, the header must pass
transport/wire_rules.py (magic, sender, length, in sequence, a slot not still held), and a
credit must name a slot in use; anything else on the wrong queue pair is refused. A write
lands before its completion is seen, so a write into a held slot has spoiled that slot when
it is caught: the peer's own slots only, since every channel has its own region.

Connection (queue-pair numbers, PSNs, LID, GID, rkey, region address, stride, active MTU
and link layer cross over the authenticated TCP control connection as `wire.QPInfo`):
    RESET -> INIT  at creation: port, pkey index 0, access LOCAL_WRITE | REMOTE_WRITE
                   (pyverbs applies qp_access_flags at this transition only)
    INIT  -> RTR   dest_qp_num, rq_psn (the peer's first send PSN), path_mtu = min(this
                   port's active MTU, the peer's), max_dest_rd_atomic 1, min_rnr_timer 12,
                   address vector: RoCE: is_global with dgid = the peer's GID, sgid_index =
                   ours, hop_limit 64; InfiniBand: dlid = the peer's LID, no GRH (one subnet)
    RTR   -> RTS   sq_psn (ours), timeout 14, retry_cnt 7, rnr_retry 7, max_rd_atomic 1
The accepting side reaches RTS last and then sends {"rdma_ready": true}; the connecting
side returns only after it, so no write reaches a queue pair that is not yet ready.

Device, port and GID (`transport.rdma_port`): MEGAINFER_RDMA_DEVICE (default: of the devices
`rdma_devices` allows, the one nearest this process's GPU whose port is usable:
`transport.rdma_host`), MEGAINFER_RDMA_PORT (1), MEGAINFER_RDMA_GID_INDEX (default:
chosen from the port's GID table: RoCE v2 IPv4-mapped, else RoCE v2 IPv6, else RoCE v2
link-local; on InfiniBand the port GID). `available()` is the cheap check (pyverbs and a
device exist); `probe()` is the one to select a backend by: an ACTIVE port, a usable GID,
room under RLIMIT_MEMLOCK for what the endpoint's channels will register (`Wiring`: one
region per channel, two channels per peer), and a loopback write-with-immediate between two
queue pairs that completes within 1 s.
`register_cuda_tensor` registers GPU memory through dma-buf (transport/cuda_dmabuf.py exports it); the
channels themselves still stage through host memory.

What has been checked: none of this has run on RDMA hardware (nor the dma-buf path on a
GPU). The tests (tests/transport/test_rdma*.py) need no device: they build the real pyverbs
work requests and QP attributes (SGE count, opcode, immediate in network byte order; the
SGE and remote addresses through the `Write` plans, since pyverbs before v63 cannot read
them back from a WR; access flags at INIT; path MTU, PSNs, address vector at RTR; RTS),
run the whole channel (write plans, completion decoding, credits, zero-copy views) over an
emulated adapter that copies each plan's bytes between two registered-looking regions,
choose GIDs, MTUs and ports over recorded GID tables and fake contexts, order devices over a
fake sysfs tree, check the locked-memory arithmetic against monkeypatched limits, and check
probe's reasons. Queue-pair creation, the state transitions on a device, memory registration and
the loopback check are untested here. API facts come from rdma-core's pyverbs sources.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import mmap
import os
import random
import socket
import time
from dataclasses import dataclass
from typing import NamedTuple

from transport import rdma_host as rh
from transport import rdma_port as rp
from transport.cuda_dmabuf import CudaDriver, dmabuf_span
from transport.errors import BackendUnavailable, HandshakeError, PayloadTooLarge, PeerClosed, TransportError
from transport.shm import PAYLOAD_OFFSET, slot_stride
from transport.wire import (HEADER, HEADER_BYTES, IMM_CREDIT, IMM_DATA, Header, QPInfo, pack_tag, recv_json, send_json,
                            unpack_tag)
from transport.wire_rules import MICRO_BATCH_AT, InboundRules, broke

PYVERBS_HINT = "pip install --pre --only-binary=:all: pyverbs"

RECV_SINK, CREDIT_SOURCE, CREDIT_SINK = 0, 8, 16
SLOTS_OFFSET = 64
HEADER_IN_SLOT = PAYLOAD_OFFSET - HEADER_BYTES
SCRATCH_BYTES = 1

RECV_DEPTH_PER_SLOT = 2
EXTRA_DEPTH = 8
# rdma-core's tests (and ibv_rc_pingpong) use these; retries give a dead peer ~0.5 s.
MIN_RNR_TIMER, TIMEOUT, RETRY_CNT, RNR_RETRY = 12, 14, 7, 7
MAX_RD_ATOMIC = 1
HOP_LIMIT = 64  # RoCE v2 packets are routed IP: a TTL of 1 would stop at the first router
LOOPBACK_BYTES = 64
LOOPBACK_TIMEOUT_S = 1.0


# -- region layout ---------------------------------------------------------------------------
def region_bytes(stride: int, num_slots: int) -> int:
    return SLOTS_OFFSET + stride * num_slots


def pinned_bytes(slot_bytes: int, num_slots: int) -> int:
    """What one channel's queue pair registers (its region), in the whole pages the kernel pins."""
    nbytes = region_bytes(slot_stride(slot_bytes), num_slots)
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass(frozen=True)
class Wiring:
    """What an endpoint's rdma channels will register once wired: per peer, an inbound channel
    over this endpoint's slots and an outbound one staging into a copy of the peer's slots."""

    peers: int
    slot_bytes: int  # this endpoint's receive slots
    peer_slot_bytes: int  # the peers' receive slots, which this endpoint writes into
    num_slots: int  # per channel (both ends of a deployment use the same)

    @property
    def bytes(self) -> int:
        return self.peers * (pinned_bytes(self.slot_bytes, self.num_slots) +
                             pinned_bytes(self.peer_slot_bytes, self.num_slots))

    def describe(self) -> str:
        inbound, outbound = (pinned_bytes(n, self.num_slots) for n in (self.slot_bytes, self.peer_slot_bytes))
        return (f"wiring {self.peers} peer(s) ({2 * self.peers} channels: {self.num_slots} slots each, "
                f"{rh.size_text(inbound, exact=False)} per inbound and {rh.size_text(outbound, exact=False)} per "
                f"outbound region)")


def slot_offset(slot: int, stride: int) -> int:
    return SLOTS_OFFSET + slot * stride


def header_offset(slot: int, stride: int) -> int:
    return slot_offset(slot, stride) + HEADER_IN_SLOT


def payload_offset(slot: int, stride: int) -> int:
    return slot_offset(slot, stride) + PAYLOAD_OFFSET


def buffer_address(buf) -> int:
    """The address of a writable buffer's first byte (the mapping outlives this call)."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # releases the buffer export, so the mapping can be closed later


def byte_view(payload) -> memoryview:
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class HostRegion:
    """Anonymous shared memory registered with the protection domain. Shared, not private:
    a fork must not turn the registered pages copy-on-write under the adapter."""

    def __init__(self, pd, nbytes: int, access: int) -> None:
        from pyverbs.mr import MR

        self.nbytes = nbytes
        self.map = mmap.mmap(-1, nbytes)  # page-aligned and zero-filled
        self.addr = buffer_address(self.map)
        try:
            self.mr = MR(pd, nbytes, access, address=self.addr)
        except BaseException:
            self.map.close()
            raise
        self.view = memoryview(self.map)

    def close(self) -> None:
        if self.mr is not None:
            self.mr.close()  # deregister first: the adapter must stop using the pages
            self.mr = None
        release_mapping(self.view, self.map)


def release_mapping(view: memoryview, mapping: mmap.mmap) -> None:
    """Unmaps a channel's region once nothing else holds it (both kinds of channel)."""
    try:
        view.release()
        mapping.close()
    except BufferError:
        pass  # a payload view (or the core's export) still holds it: the mapping goes with the last one


# -- work requests ----------------------------------------------------------------------------
class Write(NamedTuple):
    """One RDMA write-with-immediate, as plain numbers (`send_wr` makes the pyverbs WR)."""

    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int
    tag: int


def data_write(slot: int, length: int, stride: int, local_base: int, lkey: int, remote: QPInfo,
               channel: int) -> Write:
    """Header + `length` payload bytes from this side's slot to the same slot of the peer."""
    offset = header_offset(slot, stride)
    return Write(local_base + offset, HEADER_BYTES + length, lkey, remote.addr + offset, remote.rkey,
                 pack_tag(IMM_DATA, channel, slot))


def credit_write(tag: int, local_base: int, lkey: int, remote: QPInfo) -> Write:
    """The 1-byte scratch write that carries a bare immediate (a credit: tag (credit, 0, slot))."""
    return Write(local_base + CREDIT_SOURCE, SCRATCH_BYTES, lkey, remote.addr + CREDIT_SINK, remote.rkey, tag)


def send_wr(write: Write):
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    sge = SGE(write.local_addr, write.length, write.lkey)
    wr = SendWR(wr_id=write.tag, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[sge],
                send_flags=e.IBV_SEND_SIGNALED)
    sge.close()  # SendWR copied it; older pyverbs never frees an SGE on its own
    wr.imm_data = socket.htonl(write.tag)  # the wire carries the immediate big-endian
    wr.set_wr_rdma(write.rkey, write.remote_addr)
    return wr


def recv_wr(local_base: int, lkey: int):
    from pyverbs.wr import SGE, RecvWR

    sge = SGE(local_base + RECV_SINK, SCRATCH_BYTES, lkey)
    wr = RecvWR(wr_id=0, num_sge=1, sg=[sge])
    sge.close()
    return wr


# -- queue-pair attributes --------------------------------------------------------------------
def access_flags() -> int:
    import pyverbs.enums as e

    return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE


def init_attr(port: int):
    """RESET -> INIT (given to QP() at creation)."""
    import pyverbs.enums as e
    from pyverbs.qp import QPAttr

    attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=port)
    attr.pkey_index = 0
    attr.qp_access_flags = access_flags()
    return attr


def address_vector(local: rp.PortChoice, remote: QPInfo):
    from pyverbs.addr import GID, AHAttr, GlobalRoute

    if local.link_layer == rp.LINK_ETHERNET:  # RoCE: addressed by GID, every packet has a GRH
        route = GlobalRoute(dgid=GID(remote.gid_text), sgid_index=local.gid.index, hop_limit=HOP_LIMIT,
                            traffic_class=local.traffic_class)
        return AHAttr(port_num=local.port, is_global=1, gr=route, dlid=0, sl=local.service_level)
    return AHAttr(port_num=local.port, is_global=0, dlid=remote.lid, sl=local.service_level)


def check_reachable(local: rp.PortChoice, remote: QPInfo) -> None:
    """HandshakeError where no RDMA path joins this port to the peer's (both channel kinds)."""
    if remote.link_layer != local.link_layer:
        theirs = rp.LINK_NAMES.get(remote.link_layer, f"link layer {remote.link_layer}")
        raise HandshakeError(f"the peer's RDMA port is {theirs}, {local.where} is {local.link_name}: "
                             "no RDMA path between them")
    if local.link_layer != rp.LINK_ETHERNET and remote.lid == 0:
        raise HandshakeError("the peer's InfiniBand port has LID 0 (no subnet manager?)")


def check_stride(remote: QPInfo, stride: int) -> None:
    if remote.slot_stride != stride:
        raise HandshakeError(f"rdma: the peer's slot stride is {remote.slot_stride} bytes, this side's "
                             f"{stride}: the two ends disagree on slot_bytes")


def rtr_attr(local: rp.PortChoice, remote: QPInfo):
    """INIT -> RTR: whom to receive from, at which PSN, over which path."""
    import pyverbs.enums as e
    from pyverbs.qp import QPAttr

    check_reachable(local, remote)
    attr = QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT, port_num=local.port,
                  path_mtu=rp.path_mtu(local.mtu, remote.mtu))
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = MAX_RD_ATOMIC
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.ah_attr = address_vector(local, remote)
    return attr


def rts_attr(psn: int):
    """RTR -> RTS: this side's first send PSN and its retry policy."""
    import pyverbs.enums as e
    from pyverbs.qp import QPAttr

    attr = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RTR)
    attr.sq_psn = psn
    attr.timeout = TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    attr.max_rd_atomic = MAX_RD_ATOMIC
    return attr


# -- devices, probe ---------------------------------------------------------------------------
def verbs_devices() -> list[rp.DeviceInfo]:
    """The verbs devices pyverbs sees; BackendUnavailable says why there are none."""
    try:
        from pyverbs.device import get_device_list
    except ImportError:
        raise BackendUnavailable(f"pyverbs is not installed ({PYVERBS_HINT})") from None
    try:
        devices = get_device_list()
    except Exception as exc:  # noqa: BLE001 - PyverbsRDMAError where the kernel has no verbs support
        raise BackendUnavailable(f"no RDMA device ({exc})") from None
    if not devices:
        raise BackendUnavailable("no RDMA device (the verbs device list is empty)")
    return [rp.DeviceInfo(_text(d.name), d.node_type, d.transport_type) for d in devices]


def available() -> tuple[bool, str]:
    """(True, "") where pyverbs finds a verbs device; otherwise (False, the reason). Cheap:
    opens nothing. `probe()` says whether the device can actually carry a channel."""
    try:
        verbs_devices()
    except BackendUnavailable as exc:
        return False, str(exc)
    return True, ""


def open_context(name: str):
    from pyverbs.device import Context

    return Context(name=name)


def select_port(environ, list_devices=verbs_devices, open_ctx=open_context, allowed: tuple[str, ...] = (),
                locate=None) -> tuple[object, rp.PortChoice]:
    """(opened context, port choice) of the first candidate device whose port is usable, the
    candidates nearest this process's GPU first (`locate` orders them: rdma_host.nearest_first)."""
    settings = rp.settings_from_env(environ)
    candidates = rp.candidate_devices(list_devices(), settings.device, allowed)
    ranked = [(d, f"{rp.ENV_DEVICE} names it") for d in candidates] if settings.device else \
        (locate or rh.nearest_first)(candidates)
    reasons = []
    for dev, place in ranked:
        why = rp.rc_unsupported_reason(dev)
        if why:
            reasons.append(why)
            continue
        try:
            ctx = open_ctx(dev.name)
        except Exception as exc:  # noqa: BLE001 - pyverbs' errors carry the errno text
            reasons.append(f"cannot open {dev.name} ({exc})")
            continue
        try:
            choice = rp.inspect_port(ctx, dev.name, settings.port, settings.gid_index)
        except BackendUnavailable as exc:
            ctx.close()
            reasons.append(str(exc))
            continue
        skipped = f"; passed over: {'; '.join(reasons)}" if reasons else ""
        return ctx, dataclasses.replace(choice, reason=place + skipped, traffic_class=settings.traffic_class,
                                        service_level=settings.service_level)
    raise BackendUnavailable("; ".join(reasons))


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str = ""  # why not, when not ok
    device: str = ""
    port: int = 0
    gid_index: int = -1
    gid_type: str = ""
    link_layer: str = ""
    mtu: int = 0  # the port's active MTU in bytes
    note: str = ""  # what to know about a usable choice (e.g. a link-local GID)
    device_reason: str = ""  # why this device (rdma_port.PortChoice.reason)


def probe(environ=None, *, list_devices=verbs_devices, open_ctx=open_context, loopback=None,
          allowed: tuple[str, ...] = (), locate=None, wiring: Wiring | None = None,
          locked=None) -> ProbeResult:
    """Whether this host can carry RDMA channels, and on what; for backend selection. With
    `wiring`, also whether RLIMIT_MEMLOCK (read by `locked`) leaves room for what the
    endpoint's channels will register: the loopback alone would pass under any limit."""
    try:
        ctx, choice = select_port(environ, list_devices, open_ctx, allowed, locate)
    except BackendUnavailable as exc:
        return ProbeResult(False, str(exc))
    try:
        failure = memlock_shortfall(wiring, (locked or rh.locked_memory)()) if wiring is not None else ""
        failure = failure or (loopback or loopback_check)(ctx, choice)
    finally:
        ctx.close()
    found = dict(device=choice.device, port=choice.port, gid_index=choice.gid.index, gid_type=choice.gid.type,
                 link_layer=choice.link_name, mtu=choice.mtu_bytes, note=choice.note, device_reason=choice.reason)
    return ProbeResult(not failure, failure, **found)


def memlock_shortfall(wiring: Wiring, mem: rh.LockedMemory) -> str:
    """"" where RLIMIT_MEMLOCK leaves room for `wiring`'s regions; else why not, and the fix."""
    return rh.memlock_shortfall(wiring.bytes, wiring.describe(), mem)


def wait_until(poll, timeout_s: float, clock=time.monotonic) -> bool:
    """Call `poll` until it returns something true (True) or `timeout_s` passes (False)."""
    deadline = clock() + timeout_s
    while not poll():
        if clock() >= deadline:
            return False
    return True


def loopback_check(ctx, choice: rp.PortChoice, timeout_s: float = LOOPBACK_TIMEOUT_S) -> str:
    """"" if two RC queue pairs on `choice`'s port, connected to each other, carry one
    write-with-immediate within `timeout_s`; otherwise the reason."""
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError

    try:
        pd = PD(ctx)
    except PyverbsError as exc:
        return f"cannot allocate a protection domain on {choice.device} ({exc})"
    try:
        return loopback_write(RdmaContext(ctx, pd, choice), timeout_s)
    finally:
        pd.close()


def loopback_write(rc: "RdmaContext", timeout_s: float, queue_pair=None) -> str:
    """The loopback check on an open context: 64 bytes from one queue pair to the other."""
    from pyverbs.pyverbs_error import PyverbsError

    choice, pair = rc.choice, []
    try:
        pair.append((queue_pair or _QueuePair)(rc, LOOPBACK_BYTES, 1))
        pair.append((queue_pair or _QueuePair)(rc, LOOPBACK_BYTES, 1))
        a, b = pair
        a.to_rts(b.info())
        b.to_rts(a.info())
        offset = payload_offset(0, a.stride)
        pattern = bytes(range(LOOPBACK_BYTES))
        a.view[offset:offset + LOOPBACK_BYTES] = pattern
        a.write_with_imm(offset, LOOPBACK_BYTES, offset, pack_tag(IMM_DATA, 0, 0))

        def arrived():
            a.completions("its loopback peer")  # raises on a failed send (e.g. retries exhausted)
            return b.completions("its loopback peer")

        if not wait_until(arrived, timeout_s):
            return f"loopback write did not complete within {timeout_s:g} s on {choice.describe()}"
        if bytes(b.view[offset:offset + LOOPBACK_BYTES]) != pattern:
            return f"loopback write completed on {choice.where} but delivered other bytes"
        return ""
    except (PyverbsError, TransportError) as exc:
        return f"loopback queue-pair check failed on {choice.describe()}: {exc}"
    finally:
        for qp in pair:
            qp.close()


# -- context and queue pairs ------------------------------------------------------------------
def choose_port(environ=None, allowed: tuple[str, ...] = ()) -> rp.PortChoice:
    """The port `RdmaContext.open` would use, with pyverbs' context closed again: for the M2N
    core's channels, which open their own (transport/core_rdma.py)."""
    try:
        ctx, choice = select_port(environ, allowed=allowed)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"rdma: {exc}") from None
    ctx.close()
    return choice


class RdmaContext:
    """This endpoint's device context, protection domain and chosen port."""

    def __init__(self, ctx, pd, choice: rp.PortChoice) -> None:
        self.ctx, self.pd, self.choice = ctx, pd, choice
        self.port, self.lid = choice.port, choice.lid
        self.gid_index, self.gid = choice.gid.index, choice.gid.raw

    @classmethod
    def open(cls, environ=None, allowed: tuple[str, ...] = ()) -> "RdmaContext":
        """The first usable device of those `allowed` (empty: any), nearest the GPU first."""
        try:
            ctx, choice = select_port(environ, allowed=allowed)
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"rdma: {exc}") from None
        from pyverbs.pd import PD

        try:
            return cls(ctx, PD(ctx), choice)
        except BaseException:
            ctx.close()
            raise

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


@contextlib.contextmanager
def _verbs_failure(what: str):
    """pyverbs' errors while setting up a channel, as the HandshakeError the endpoint reports."""
    from pyverbs.pyverbs_error import PyverbsError

    try:
        yield
    except PyverbsError as exc:
        raise HandshakeError(f"rdma: {what} ({exc})") from None


class _QueuePair:
    """One RC queue pair with its own completion queue and registered region (layout above).
    Offsets taken by `write_with_imm` are from the region's base."""

    def __init__(self, rc: RdmaContext, slot_bytes: int, num_slots: int) -> None:
        self.rc = rc
        self.stride = slot_stride(slot_bytes)
        self.num_slots = num_slots
        self.psn = random.getrandbits(24)
        self.remote: QPInfo | None = None
        self.region = self.cq = self.qp = self._recv_wr = None
        try:
            with _verbs_failure(f"cannot set up a queue pair on {rc.choice.where}"):
                self._build(num_slots * RECV_DEPTH_PER_SLOT + EXTRA_DEPTH)
        except BaseException:
            self.close()
            raise

    def _build(self, depth: int) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        rc = self.rc
        self.region = HostRegion(rc.pd, region_bytes(self.stride, self.num_slots), access_flags())
        self.cq = CQ(rc.ctx, 2 * depth)  # every send and every receive may be outstanding
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(rc.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap), init_attr(rc.port))
        self._recv_wr = recv_wr(self.region.addr, self.mr.lkey)
        for _ in range(depth):
            self.qp.post_recv(self._recv_wr)  # ibv_post_recv copies it: one WR serves every post

    @property
    def mr(self):
        return self.region.mr

    @property
    def view(self) -> memoryview:
        return self.region.view

    def info(self) -> QPInfo:
        c = self.rc.choice
        return QPInfo(self.qp.qp_num, self.psn, c.lid, c.port, c.gid.index, c.gid.raw, self.mr.rkey,
                      self.region.addr, self.stride, c.mtu, c.link_layer)

    def to_rts(self, remote: QPInfo) -> None:
        check_stride(remote, self.stride)
        rtr = rtr_attr(self.rc.choice, remote)
        with _verbs_failure(f"cannot connect the queue pair on {self.rc.choice.where} to queue pair "
                            f"{remote.qp_num} at {remote.gid_text}"):
            self.qp.to_rtr(rtr)
            self.qp.to_rts(rts_attr(self.psn))
        self.remote = remote

    def write_with_imm(self, local_offset: int, length: int, remote_offset: int, tag: int) -> None:
        """`length` bytes at `local_offset` to `remote_offset` on the peer, with immediate `tag`;
        length 0 sends the 1-byte scratch write instead (a WR needs an SGE)."""
        if length == 0:
            self.post_credit(tag)
            return
        if local_offset < SLOTS_OFFSET or remote_offset < SLOTS_OFFSET or \
                max(local_offset, remote_offset) + length > self.region.nbytes:
            raise ValueError(f"write of {length} bytes at {local_offset}->{remote_offset} is outside the slots")
        self._post(Write(self.region.addr + local_offset, length, self.mr.lkey, self.remote.addr + remote_offset,
                         self.remote.rkey, tag))

    def post_credit(self, tag: int) -> None:
        self._post(credit_write(tag, self.region.addr, self.mr.lkey, self.remote))

    def _post(self, write: Write) -> None:
        wr = send_wr(write)
        try:
            self.qp.post_send(wr)
        finally:
            wr.close()  # ibv_post_send has copied it; older pyverbs never frees a WR on its own

    def completions(self, peer: str) -> list[tuple[int, int, int]]:
        """Received immediates as (kind, channel, slot); send completions are checked and dropped."""
        import pyverbs.enums as e
        from pyverbs.cq import cqe_status_to_str

        out = []
        while True:
            n, wcs = self.cq.poll(16)
            if n == 0:
                return out
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise PeerClosed(f"rdma: work completion failed on the channel of {peer}: "
                                     f"{cqe_status_to_str(wc.status)} (status {wc.status}; the peer closed or "
                                     "is unreachable)")
                if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                    self.qp.post_recv(self._recv_wr)
                    out.append(unpack_tag(socket.ntohl(wc.imm_data)))

    def close(self) -> None:
        for name in ("qp", "_recv_wr", "region", "cq"):  # the QP before what it uses
            obj = getattr(self, name, None)
            if obj is not None:
                setattr(self, name, None)
                obj.close()


# -- channels -------------------------------------------------------------------------------------
def _peer_info(text: str, peer: str) -> QPInfo:
    try:
        return QPInfo.unpack(bytes.fromhex(text))
    except (TypeError, ValueError) as exc:
        raise HandshakeError(f"rdma: malformed queue-pair info from {peer} ({exc})") from None


def accepted_queue_pair(qp, peer: str, sock: socket.socket, ack: dict):
    """The accepting side's handshake for a new queue pair (this module's or the core's): its
    info out with the acknowledgement, the peer's in, RTS, then "ready"; closed on failure."""
    try:
        send_json(sock, {**ack, "rdma": qp.info().pack().hex()})
        reply = recv_json(sock)
        qp.to_rts(_peer_info(reply.get("rdma"), peer))
        send_json(sock, {"rdma_ready": True})
    except BaseException:
        qp.close()
        raise
    return qp


def connected_queue_pair(qp, peer: str, sock: socket.socket, remote_hex: str):
    """The connecting side's: RTS towards the peer's info, this side's info out, and back only
    once the peer's queue pair is ready too; closed on failure."""
    try:
        qp.to_rts(_peer_info(remote_hex, peer))
        send_json(sock, {"rdma": qp.info().pack().hex()})
        if not recv_json(sock).get("rdma_ready"):
            raise HandshakeError(f"rdma: {peer} did not confirm its queue pair is ready")
    except BaseException:
        qp.close()
        raise
    return qp


class RdmaInbound:
    """peer -> this endpoint: the peer writes into this side's registered slots."""

    kind = "rdma"

    def __init__(self, peer: str, slot_bytes: int, num_slots: int, qp: _QueuePair, control: socket.socket, *,
                 sender: int) -> None:
        self.peer, self.slot_bytes, self.num_slots, self.qp, self.control = peer, slot_bytes, num_slots, qp, control
        self.rules = InboundRules(peer, sender, slot_bytes, num_slots)
        self._failure: PeerClosed | None = None  # met after messages that the last poll returned

    @property
    def outstanding(self) -> int:
        return len(self.rules.held)

    @classmethod
    def accept(cls, rc: RdmaContext, peer: str, sender: int, slot_bytes: int, num_slots: int, sock: socket.socket,
               ack: dict) -> "RdmaInbound":
        qp = accepted_queue_pair(_QueuePair(rc, slot_bytes, num_slots), peer, sock, ack)
        return cls(peer, slot_bytes, num_slots, qp, sock, sender=sender)

    def poll(self) -> list[tuple[int, Header]]:
        """Slots written since the last poll, in arrival order (RC delivers in send order). A
        violation after some messages is raised by the next poll, once they are handed out."""
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        done: list[tuple[int, Header]] = []
        try:
            for kind, _, slot in self.qp.completions(self.peer):
                done.append(self._admit(kind, slot))
        except PeerClosed as exc:
            if not done:
                raise
            self._failure = exc
        return done

    def _admit(self, kind: int, slot: int) -> tuple[int, Header]:
        if kind != IMM_DATA or slot >= self.num_slots:
            raise broke(self.peer, f"rdma: an immediate of kind {kind} for slot {slot} on a data channel of "
                                   f"{self.num_slots} slots (data, slot < {self.num_slots} expected)")
        fields = HEADER.unpack_from(self.qp.view, header_offset(slot, self.qp.stride))
        if fields[MICRO_BATCH_AT] % self.num_slots != slot:
            raise broke(self.peer, f"rdma: a write tagged for slot {slot} carries a header for micro-batch "
                                   f"{fields[MICRO_BATCH_AT]} (slot {fields[MICRO_BATCH_AT] % self.num_slots})")
        return self.rules.admit(fields)

    def payload(self, slot: int, length: int) -> memoryview:
        start = payload_offset(slot, self.qp.stride)
        return self.qp.view[start:start + length]

    def release(self, slot: int) -> None:
        self.rules.free(slot)
        self.qp.post_credit(pack_tag(IMM_CREDIT, 0, slot))

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
        qp = connected_queue_pair(_QueuePair(rc, slot_bytes, num_slots), peer, sock, remote_hex)
        return cls(peer, channel_id, slot_bytes, num_slots, qp, sock)

    def _take_credits(self) -> None:
        for kind, _, freed in self.qp.completions(self.peer):
            if kind != IMM_CREDIT or freed >= self.num_slots or not self.busy[freed]:
                raise broke(self.peer, f"rdma: an immediate of kind {kind} for slot {freed} where a credit for a slot "
                                       "in use was expected")
            self.busy[freed] = False

    def unreleased(self) -> int:
        """Slots written whose credit has not come back, after taking the completions waiting."""
        self._take_credits()
        return sum(self.busy)

    def try_send(self, header: Header, payload) -> bool:
        self._take_credits()  # on every send: frees slots and keeps the send queue short
        slot = header.micro_batch % self.num_slots
        if self.busy[slot]:
            return False
        n = header.byte_length
        if n > self.slot_bytes:
            raise PayloadTooLarge(f"payload of {n} bytes exceeds the {self.slot_bytes}-byte slot of peer {self.peer}")
        view, offset = self.qp.view, header_offset(slot, self.qp.stride)
        header.pack_into(view, offset)
        if n:
            view[offset + HEADER_BYTES:offset + HEADER_BYTES + n] = byte_view(payload)
        self.qp.write_with_imm(offset, HEADER_BYTES + n, offset, pack_tag(IMM_DATA, self.channel_id, slot))
        self.busy[slot] = True
        return True

    def close(self) -> None:
        self.qp.close()


# -- GPU memory through dma-buf -----------------------------------------------------------------
@dataclass(frozen=True)
class DeviceRegion:
    """GPU memory registered for RDMA. `addr` is what SGEs and the peer's remote address use
    for the tensor's first byte: pyverbs registers a dma-buf MR with iova = its offset."""

    mr: object
    addr: int
    length: int

    @property
    def lkey(self) -> int:
        return self.mr.lkey

    @property
    def rkey(self) -> int:
        return self.mr.rkey

    def close(self) -> None:
        self.mr.close()


def register_cuda_tensor(pd, tensor, access: int | None = None) -> DeviceRegion:
    """Register a contiguous CUDA tensor's memory with `pd` through dma-buf (no host staging).
    The host-page-rounded range around it must lie in one CUDA allocation (PyTorch's caching
    allocator's segments are 2 MiB-aligned, so a tensor of its own does). BackendUnavailable
    says why not: no DmaBufMR in pyverbs, not a CUDA tensor, no CUDA driver, no dma-buf
    support in the GPU driver or in the RDMA driver."""
    try:
        from pyverbs.mr import DmaBufMR
        from pyverbs.pyverbs_error import PyverbsRDMAError
    except ImportError:
        raise BackendUnavailable(f"this pyverbs has no DmaBufMR (rdma-core >= 34 has it; {PYVERBS_HINT})") from None
    if not getattr(tensor, "is_cuda", False):
        raise BackendUnavailable(f"dma-buf registration takes a CUDA tensor; this one is on {tensor.device} "
                                 "(host memory registers as a plain MR)")
    if not tensor.is_contiguous():
        raise BackendUnavailable("dma-buf registration takes a contiguous tensor")
    driver = CudaDriver()
    driver.check_export(tensor.device.index or 0)
    nbytes = tensor.numel() * tensor.element_size()
    start, span, offset = dmabuf_span(tensor.data_ptr(), nbytes)
    fd = driver.export(start, span)
    try:
        mr = DmaBufMR(pd, nbytes, access_flags() if access is None else access, dmabuf=fd, offset=offset)
    except PyverbsRDMAError as exc:
        if exc.error_code == errno.EOPNOTSUPP:
            raise BackendUnavailable("the RDMA driver cannot register dma-buf memory (EOPNOTSUPP)") from None
        raise BackendUnavailable(f"dma-buf registration failed ({exc})") from None
    finally:
        os.close(fd)  # the registration holds its own reference to the dma-buf
    return DeviceRegion(mr, offset, nbytes)


def _text(name) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)
