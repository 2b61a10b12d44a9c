"""The compiled M2N core (transport/csrc/verbs_channels.cpp) as rdma channels.

The core does per round what transport/rdma.py does per message: the same region layout,
work requests, queue-pair attributes and rules, in C++ with the GIL released, so a round to
32 rdma peers is one call and a work request costs no Python call (rdma.py builds a pyverbs
SGE and WR objects per write). The set-up stays here and in rdma.py: the device, port and GID
the probe chose (`rdma.select_port`), the region (an anonymous shared mapping, as
`rdma.HostRegion`), the queue-pair info exchanged over the control connection
(`rdma.accepted_queue_pair`, `connected_queue_pair`). The core opens its own device context by
name in the libibverbs that pyverbs loaded (`verbs_library`), because pyverbs does not hand
out its objects' pointers; one per endpoint (`CoreVerbs`), with a completion channel its
rounds sleep on.

Whether an endpoint's rdma channels are the core's is `EndpointSpec.core`, as for shm and tcp
(transport/core.py). What has run: the tests drive these channels, whole endpoints and rounds
through a software verbs provider (tests/transport/verbs/soft_verbs.cpp); nothing has run on
an RDMA adapter.
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import random
import re
import socket

from transport import rdma
from transport import rdma_port as rp
from transport.core import CoreInbound, CoreOutbound, native
from transport.core_tcp import tcp_error
from transport.cuda_dmabuf import CudaDriver, MarkWait, dmabuf_span
from transport.errors import BackendUnavailable, HandshakeError, PeerClosed, TransportError
from transport.rdma import RdmaInbound, RdmaOutbound
from transport.rounds import send_span
from transport.shm import slot_stride
from transport.transport_settings import LIBIBVERBS
from transport.wire import QPInfo, RegionGrant
from transport.wire_rules import broke

__all__ = ["CoreRdmaInbound", "CoreRdmaOutbound", "CoreVerbs", "verbs_library"]

logger = logging.getLogger(__name__)

# Send and receive queue entries per slot: a message from registered memory takes two send
# requests, and a slot may be written again (its credit came back) before the completion of
# its last message was polled; the core holds a message back while the send queue is full.
QUEUE_DEPTH_PER_SLOT = 4

# libibverbs.so.1, or a wheel's renamed copy (libibverbs-1de1263b.so.1.14.48.0); not pyverbs'
# own modules (libibverbs.cpython-311-x86_64-linux-gnu.so)
LIBRARY_NAME = re.compile(r"libibverbs(-[0-9a-f]+)?\.so(\.[0-9.]+)?$")

# ibv_wc_status_str's words, for the statuses an RC write-with-immediate channel meets.
WC_STATUS = {1: "local length error", 2: "local QP operation error", 4: "local protection error",
             5: "Work Request Flushed Error", 10: "remote access error", 11: "remote operation error",
             12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
             20: "fatal error", 21: "response timeout error", 22: "general error"}


def verbs_library(environ=None) -> str:
    """The libibverbs the core loads: MEGAINFER_LIBIBVERBS where set, else the one pyverbs has
    loaded in this process (its wheel bundles one, with its providers: the same library then
    serves the probe and the channels), else the system's libibverbs.so.1."""
    named = LIBIBVERBS.read(environ)
    if named:
        return named
    try:
        pyverbs = importlib.import_module("pyverbs.device")  # loads pyverbs' libibverbs and what that needs
    except ImportError:
        return "libibverbs.so.1"
    try:
        with open("/proc/self/maps") as maps:
            loaded = [path for line in maps if LIBRARY_NAME.match(os.path.basename(
                path := line.split(maxsplit=5)[-1].strip()))]
    except OSError:
        loaded = []
    # pyverbs' own (beside its package: pyverbs.libs/), where another library (NCCL, UCX) loaded
    # the system's too; else the one loaded
    site = os.path.dirname(os.path.dirname(os.path.abspath(pyverbs.__file__)))
    ours = [path for path in loaded if path.startswith(site + os.sep)]
    return (ours or loaded or ["libibverbs.so.1"])[0]


class CoreVerbs:
    """An endpoint's device context, protection domain and completion channel in the core, on
    the port the probe chose."""

    def __init__(self, choice: rp.PortChoice, library: str | None = None) -> None:
        self.choice = choice
        self.library = library or verbs_library()
        try:
            self.domain = native.VerbsDomain(self.library, choice.device)
        except RuntimeError as exc:
            raise HandshakeError(f"rdma: the M2N core cannot open {choice.device} through {self.library} "
                                 f"({exc})") from None
        self.registered: list = []  # (buffer, handle): a buffer stays alive while registered
        self.flushes: dict[int, CudaDriver] = {}  # GPU ordinal -> its driver, where exposed memory needs flushing
        self.mark_waits: dict[int, tuple[CudaDriver, MarkWait]] = {}  # GPU ordinal -> how its streams wait on marks
        self.exposed_gpu: list[tuple[int, int, int]] = []  # (GPU ordinal, start, end) of each exposed GPU region

    def register(self, buffer) -> None:
        """A buffer payloads will be sent from (Endpoint.register): the adapter then reads a
        payload lying in it straight from it, with no copy into staging. Host memory (what a
        round posts: a CPU tensor, a numpy array; `rounds.send_span`) by address; a CUDA tensor
        through the dma-buf its driver exports (GPUDirect RDMA), named by its device address. A
        buffer that cannot be registered is said once and sent through staging (host) or
        refused at the post (GPU)."""
        address, nbytes, device = send_span(buffer)
        try:
            if device:
                handle = register_cuda_memory(self.domain, buffer, address, nbytes)
            else:
                handle = self.domain.register_host(address, nbytes)
        except (RuntimeError, BackendUnavailable) as exc:
            logger.warning("rdma: a %d-byte %s buffer stays unregistered on %s, so its payloads %s: %s", nbytes,
                           "GPU" if device else "host", self.choice.device,
                           "cannot be sent from it (stage them through host memory)" if device else
                           "are copied into staging", exc)
            return
        self.registered.append((buffer, handle))

    def expose(self, buffer) -> RegionGrant:
        """Registers `buffer` (a contiguous CPU or CUDA tensor) for this endpoint's rdma peers to
        write into, and returns the grant they need (`Endpoint.expose`); a CUDA tensor through
        its dma-buf, so the adapter writes GPU memory itself. Raises BackendUnavailable, with
        the reason, where it cannot be registered."""
        address, nbytes, device = send_span(buffer)
        try:
            if device:
                driver, ordinal = CudaDriver(), buffer.device.index or 0
                wait = driver.mark_wait(ordinal)
                handle, rkey = register_cuda_memory(self.domain, buffer, address, nbytes, driver, expose=True)
                if driver.needs_flush(ordinal):
                    self.flushes.setdefault(ordinal, driver)
                self.mark_waits.setdefault(ordinal, (driver, wait))
                self.exposed_gpu.append((ordinal, address, address + nbytes))
            else:
                handle, rkey = self.domain.expose_host(address, nbytes)
        except RuntimeError as exc:
            raise BackendUnavailable(f"rdma: cannot expose a {nbytes}-byte {'GPU' if device else 'host'} region "
                                     f"on {self.choice.device} ({exc})") from None
        self.registered.append((buffer, handle))
        return RegionGrant(address, nbytes, rkey, device)

    def settle(self) -> None:
        """After a message into exposed GPU memory arrived, before a kernel reads the bytes: the
        adapter's writes flushed where the device does not order them itself (Endpoint.settle)."""
        for ordinal, driver in self.flushes.items():  # each GPU exposed memory lies on that needs one
            driver.flush_rdma_writes(ordinal)

    def hold_stream(self, stream: int, ordinal: int, addresses, values) -> None:
        """GPU `ordinal`'s stream `stream` waits, in the driver, until each word at `addresses`
        (marks in memory exposed here) holds its value; its later work then sees what the
        adapter wrote before each mark (Endpoint.hold_stream). BackendUnavailable where no
        memory of that GPU was exposed here, or the driver refuses the wait; ValueError where
        the words do not lie in one region exposed here."""
        held = self.mark_waits.get(ordinal)
        if held is None:
            raise BackendUnavailable(f"rdma: no memory of GPU {ordinal} is exposed on this endpoint: no mark of it "
                                     "can be waited on")
        driver, wait = held
        if addresses:  # the span of the words, inside one region exposed on that GPU (checked per call: two ints)
            low, high = min(addresses), max(addresses) + 4
            if not any(o == ordinal and start <= low and high <= end for o, start, end in self.exposed_gpu):
                raise ValueError(f"rdma: marks at [{low:#x}, {high:#x}) do not lie in one region of GPU {ordinal} "
                                 "exposed on this endpoint")
        if wait.host_flush:  # the stream cannot flush the adapter's writes: the host does, as settle()
            driver.flush_rdma_writes(ordinal)
        driver.wait_values(ordinal, stream, addresses, values, wait.flags)

    def close(self) -> None:
        for _, handle in self.registered:  # deregistered before the buffers may go
            self.domain.unregister(handle)
        self.registered.clear()
        self.domain = None  # the context closes with the last channel that holds it


def register_cuda_memory(domain, tensor, address: int, nbytes: int, driver: CudaDriver | None = None, *,
                         expose: bool = False):
    """Registers a CUDA tensor's memory with the core's domain through the dma-buf the CUDA
    driver exports for its host-page-aligned range (transport/cuda_dmabuf.py), named by its
    device address (iova), so SGEs carry device pointers as they are. Returns the handle; with
    `expose`, registered for the peers' writes too, (handle, rkey)."""
    if not domain.dmabuf_supported:
        raise BackendUnavailable("this libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or later has it)")
    driver = driver or CudaDriver()
    driver.check_export(tensor.device.index or 0)
    start, span, offset = dmabuf_span(address, nbytes)
    fd = driver.export(start, span)
    try:
        return (domain.expose_dmabuf if expose else domain.register_dmabuf)(fd, offset, nbytes, address)
    finally:
        os.close(fd)  # the registration holds its own reference to the dma-buf


class CoreQueuePair:
    """A channel's region and queue pair in the core: what rdma._QueuePair is to the reference,
    for the handshake (`info`, `to_rts`, `close`) and for payload views (`view`)."""

    def __init__(self, verbs: CoreVerbs, slot_bytes: int, num_slots: int) -> None:
        self.choice = verbs.choice
        self.stride = slot_stride(slot_bytes)
        self.num_slots = num_slots
        self.psn = random.getrandbits(24)
        self.map = mmap.mmap(-1, rdma.region_bytes(self.stride, num_slots))  # shared, page-aligned, zeroed
        self.view = memoryview(self.map)
        try:
            self.native = native.VerbsQueuePair(verbs.domain, self.map, self.choice.port,
                                                num_slots * QUEUE_DEPTH_PER_SLOT + rdma.EXTRA_DEPTH)
        except RuntimeError as exc:
            rdma.release_mapping(self.view, self.map)
            raise HandshakeError(f"rdma: cannot set up a queue pair on {self.choice.where} ({exc})") from None

    def info(self) -> QPInfo:
        c = self.choice
        return QPInfo(self.native.qp_num, self.psn, c.lid, c.port, c.gid.index, c.gid.raw, self.native.rkey,
                      self.native.address, self.stride, c.mtu, c.link_layer)

    def to_rts(self, remote: QPInfo) -> None:
        rdma.check_stride(remote, self.stride)
        local = self.choice
        rdma.check_reachable(local, remote)
        route = native.VerbsRoute(
            qp_num=remote.qp_num, psn=remote.psn, addr=remote.addr, rkey=remote.rkey,
            path_mtu=rp.path_mtu(local.mtu, remote.mtu), is_global=local.link_layer == rp.LINK_ETHERNET,
            dgid=remote.gid, dlid=remote.lid, sgid_index=local.gid.index, hop_limit=rdma.HOP_LIMIT,
            traffic_class=local.traffic_class, service_level=local.service_level, port=local.port,
            sq_psn=self.psn, min_rnr_timer=rdma.MIN_RNR_TIMER, timeout=rdma.TIMEOUT, retry_cnt=rdma.RETRY_CNT,
            rnr_retry=rdma.RNR_RETRY, max_rd_atomic=rdma.MAX_RD_ATOMIC)
        try:
            self.native.connect(route)
        except RuntimeError as exc:
            raise HandshakeError(f"rdma: cannot connect the queue pair on {local.where} to queue pair "
                                 f"{remote.qp_num} at {remote.gid_text} ({exc})") from None

    def close(self) -> None:
        self.native.close()  # deregisters the region; its export keeps the mapping while the core holds it
        rdma.release_mapping(self.view, self.map)


def verbs_error(channel, code: int, a: int, b: int, fields: tuple) -> TransportError:
    """A core rdma channel's failure in the reference's words (transport/rdma.py): PeerClosed
    where the link or the peer failed, a ProtocolViolation where the peer broke a rule."""
    peer = channel.peer
    if code == native.COMPLETION_FAILED:
        what = WC_STATUS.get(a, "the completion queue could not be read" if a > 0xFFFF else f"status {a}")
        return PeerClosed(f"rdma: work completion failed on the channel of {peer}: {what} (status {a}; the peer "
                          "closed or is unreachable)")
    if code == native.POST_FAILED:
        return PeerClosed(f"rdma: posting a work request to {peer} failed ({os.strerror(a)})")
    if code == native.CLOSED:
        return PeerClosed(f"rdma: the channel of {peer} was closed")
    if code == native.BAD_IMMEDIATE:
        kind, slot = a >> 30, a & 0xFFFF
        if b:  # on an outbound channel, where only credits come back
            return broke(peer, f"rdma: an immediate of kind {kind} for slot {slot} where a credit for a slot in "
                               "use was expected")
        return broke(peer, f"rdma: an immediate of kind {kind} for slot {slot} on a data channel of "
                           f"{channel.num_slots} slots (data, slot < {channel.num_slots} expected)")
    if code == native.WRONG_SLOT:
        return broke(peer, f"rdma: a write tagged for slot {a} carries a header for micro-batch {fields[3]} "
                           f"(slot {fields[3] % channel.num_slots})")
    return tcp_error(channel, code, a, b, fields)  # the header rules: the same words for every kind


class CoreRdmaInbound(CoreInbound, RdmaInbound):
    """peer -> this endpoint over rdma, admitted by the core from its completion queue."""

    core_driven = True

    def __init__(self, peer: str, slot_bytes: int, num_slots: int, qp: CoreQueuePair, control: socket.socket, *,
                 sender: int) -> None:
        super().__init__(peer, slot_bytes, num_slots, qp, control, sender=sender)
        self.core = native.VerbsInChannel(qp.native, slot_bytes, qp.stride, num_slots, sender)

    @classmethod
    def accept(cls, verbs: CoreVerbs, peer: str, sender: int, slot_bytes: int, num_slots: int, sock: socket.socket,
               ack: dict) -> "CoreRdmaInbound":
        qp = rdma.accepted_queue_pair(CoreQueuePair(verbs, slot_bytes, num_slots), peer, sock, ack)
        return cls(peer, slot_bytes, num_slots, qp, sock, sender=sender)

    def error(self) -> TransportError:
        return verbs_error(self, *self.core.violation_info())

    def set_asleep(self, asleep: bool) -> None:
        self.core.set_asleep(asleep)

    def close(self) -> None:
        self.core.close()
        self.qp.close()


class CoreRdmaOutbound(CoreOutbound, RdmaOutbound):
    """this endpoint -> peer over rdma, staged and posted by the core (which stamps the
    sequence numbers and takes the credits)."""

    core_driven = True

    def __init__(self, peer: str, channel_id: int, slot_bytes: int, num_slots: int, qp: CoreQueuePair,
                 control: socket.socket, rank: int) -> None:
        super().__init__(peer, channel_id, slot_bytes, num_slots, qp, control)
        self.core = native.VerbsOutChannel(qp.native, slot_bytes, qp.stride, num_slots, rank, channel_id)

    @classmethod
    def connect(cls, verbs: CoreVerbs, peer: str, channel_id: int, slot_bytes: int, num_slots: int,
                sock: socket.socket, remote_hex: str, rank: int) -> "CoreRdmaOutbound":
        qp = rdma.connected_queue_pair(CoreQueuePair(verbs, slot_bytes, num_slots), peer, sock, remote_hex)
        return cls(peer, channel_id, slot_bytes, num_slots, qp, sock, rank)

    def aim(self, grant: RegionGrant | None) -> None:
        """The region the peer exposed for this channel's writes (`Endpoint.aim`); None: none."""
        if grant is None:
            self.core.aim(0, 0, 0)
        else:
            self.core.aim(grant.address, grant.nbytes, grant.rkey)

    def failure(self) -> TransportError:
        return verbs_error(self, *self.core.failure(), (0,) * 9)

    def close(self) -> None:
        self.core.close()
        self.qp.close()
