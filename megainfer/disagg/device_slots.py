"""Device slots: a round's bytes written straight into the receiver's device memory, the host
carrying only the headers (MegaScale-Infer's M2N without the host copies, between processes of
one host).

Every node that uses them owns one receive region on its device, [micro-batches, peers,
region_bytes] bytes: peer p's message of micro-batch j lands in [j, p]. At the first round
(and after every re-wire) each node posts an `SlotOffer` to all its peers over the link and
collects theirs: the region's sharing handle, and the handles of its own send events, one per
micro-batch. A pair of nodes writes directly where both offers say the same host and the same
kind of device (`SlotOffer.direct_with`); any other pair goes through the host as before, so
the choice is per pair and both ends of a pair make it alike.

On CUDA the region is shared by CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`, the
handles torch's own multiprocessing sends) and the events are interprocess CUDA events. A
sender enqueues one device-to-device copy per direct peer on its copy stream, after an event of
the compute stream (the copies read what the kernels launched so far produced), records its
send event of micro-batch j, and posts the round's headers with zero payload bytes for the
direct peers. The receiver makes its compute stream wait on that event (a driver wait: the
host never waits for the device) and reads the region in place. On the CPU the region is a
file in /dev/shm mapped by both (`torch.from_file(shared=True)`), the copies are synchronous
and no event is needed: the same protocol, exercised by the CPU tests.

Why a region is never overwritten while it is read, with no credit of its own: the next write
of [j, p] is the next round of micro-batch j, which p posts only after it collected the answer
to this round, and that answer was computed (stream order: after the receiver's read) before
it was sent. For the same reason a send event of micro-batch j is recorded again only after
every receiver has enqueued its wait on the previous record.

Across hosts the region is written by the adapter: where both nodes' links are rdma in the
compiled transport core, each exposes its region to its peers (`link.expose`: registered for
remote writes; GPU memory through its dma-buf, so the adapter writes the GPU's memory itself)
and the offer carries the grant and the peers its link's channel can write into. A pair not
local whose offers both carry a grant and name each other writes by rdma: the sender posts
the round as before, from the buffer it posts from anyway (its pinned staging on CUDA), with
each such peer's bytes aimed at its row of that peer's region
(`targets`); the core chains the payload write, a 4-byte mark (`round_mark` of the round's step
and layer) into the row's room before the payload (each row is MARK_ROOM bytes, then the
payload), and the header's write-with-immediate, so the header (0 bytes) arrives once the
bytes and the mark are placed. The receiver reads its region in place, with no host copy and
no upload: on CUDA its compute stream waits in the driver until each row's mark holds the
round's (`link.hold_stream`: cuStreamBatchMemOp, with the wait's FLUSH where the GPU does not
order the adapter's writes for its kernels, so no host flush), and the host goes on; on the
CPU each mark is checked, and a row without its round's mark is a DataPlaneError. On CUDA, where every peer of
a node is LOCAL or RDMA and its link's adapter reads the node's device send buffers
(DeviceStaging's, registered through their dma-buf), its rounds leave from GPU memory too
(`device_send_choice`): a device-to-device copy into that buffer on the copy stream replaces
the copy to pinned memory, and the adapter reads it, so no byte crosses host memory.

An offer travels as JSON of plain fields (`SlotOffer.to_json`, `from_json`), never pickled:
nothing a peer sends is unpickled (docs/reliability.md). The CUDA handles are the arguments
torch's own `reduce_tensor` gives its `rebuild_cuda_tensor`, written field by field, and the
classes among them are looked up in a fixed list on arrival.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from megainfer.disagg.expert_link import BYTE_LENGTH, FLAGS, LAYER, STEP
from megainfer.disagg.slot_marks import MARK_ROOM, RegionMarks, payload_offset, round_mark
from megainfer.disagg.staging_sizes import ALIGN
from megainfer.errors import DataPlaneError

logger = logging.getLogger(__name__)

OFFER = 2  # header flag of the offers' round (expert_link.BUSY is 1)
SHM_DIR = "/dev/shm"
LOCAL, RDMA, HOST = "local", "rdma", "host"  # a pair's path (SlotOffer.path_with)


def _grant_fields(value) -> tuple:
    """An offer's grant as it came: a list of plain scalars, or empty (the link checks the
    values when it aims at them)."""
    if not isinstance(value, list) or not all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        raise ValueError(f"grant {value!r} is not a list of plain fields")
    return tuple(value)


@dataclass(frozen=True)
class SlotOffer:
    """What a node tells each peer about its receive region and its send events."""

    name: str  # the node's name on the link
    host: str  # where it runs: the host name and boot id (a CPU region is a file of this host)
    device: str  # "cuda" or "cpu"
    device_uuid: str  # the GPU's UUID ("" on the CPU)
    peers: tuple[str, ...]  # the order of the region's peer rows
    micro_batches: int
    region_bytes: int  # per (micro-batch, peer)
    region: tuple  # CUDA: rebuild_cuda_tensor's arguments from reduce_tensor; CPU: (path of the /dev/shm file,)
    events: tuple[bytes, ...] = ()  # CUDA: the IPC handles of its send events, one per micro-batch
    grant: tuple = ()  # its region exposed on its link for rdma writes (the link's plain fields); (): not
    rdma_peers: tuple[str, ...] = ()  # the peers whose exposed regions its link can write into (`link.can_aim`)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self) | {"region": [_plain(v) for v in self.region],
                                          "events": [e.hex() for e in self.events]}).encode()

    @classmethod
    def from_json(cls, data: bytes, peer: str) -> "SlotOffer":
        """The offer `peer` sent, every field checked; DataPlaneError naming what is wrong."""
        try:
            raw = json.loads(data)
            offer = cls(str(raw["name"]), str(raw["host"]), str(raw["device"]), str(raw["device_uuid"]),
                        tuple(str(p) for p in raw["peers"]), int(raw["micro_batches"]), int(raw["region_bytes"]),
                        tuple(_from_plain(v) for v in raw["region"]), tuple(bytes.fromhex(e) for e in raw["events"]),
                        _grant_fields(raw.get("grant", [])), tuple(str(p) for p in raw.get("rdma_peers", [])))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataPlaneError(f"{peer} sent a malformed device-slot offer ({exc})") from None
        if offer.device not in ("cpu", "cuda") or offer.micro_batches <= 0 or offer.region_bytes <= 0:
            raise DataPlaneError(f"{peer} sent a device-slot offer out of range: device {offer.device!r}, "
                                 f"{offer.micro_batches} micro-batches, {offer.region_bytes} bytes")
        return offer

    def path_with(self, other: "SlotOffer") -> str:
        """How these two nodes' bytes travel, the same from either end: "local" (into each
        other's regions: `direct_with`), "rdma" (each region exposed on its link and each
        link's channel to the other able to write into it: rdma in the compiled core both
        ways; the adapters write them), or "host" (through the link's slots)."""
        if self.direct_with(other):
            return LOCAL
        both_ways = other.name in self.rdma_peers and self.name in other.rdma_peers
        return RDMA if self.grant and other.grant and both_ways else HOST

    def direct_with(self, other: "SlotOffer") -> bool:
        """Whether these two nodes write into each other's regions: one host, one kind of device
        (two GPUs of a host share memory through CUDA IPC where the driver allows peer access)."""
        if self.host != other.host or self.device != other.device:
            return False
        if self.device == "cpu" or self.device_uuid == other.device_uuid:
            return True
        return _peer_access(self.device_uuid, other.device_uuid)


# The classes and dtypes a CUDA region's handle may name (what reduce_tensor writes for a uint8
# tensor); nothing else is looked up.
_CLASSES = {f"{c.__module__}.{c.__qualname__}": c for c in
            (torch.Tensor, torch.UntypedStorage, torch.storage.TypedStorage, torch.storage.UntypedStorage)}
_DTYPES = {"torch.uint8": torch.uint8}


def _plain(value):
    """One argument of a handle as JSON: bytes as hex, sizes as lists, classes and dtypes by name."""
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if isinstance(value, type):
        return {"class": f"{value.__module__}.{value.__qualname__}"}
    if isinstance(value, (tuple, list, torch.Size)):
        return {"tuple": [_plain(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a device-slot handle holds a {type(value).__name__}, which an offer cannot carry")


def _from_plain(value):
    if isinstance(value, dict):
        if "bytes" in value:
            return bytes.fromhex(value["bytes"])
        if "dtype" in value:
            return _DTYPES[value["dtype"]]
        if "class" in value:
            return _CLASSES[value["class"]]
        if "tuple" in value:
            return tuple(_from_plain(v) for v in value["tuple"])
        raise ValueError(f"unknown field {sorted(value)}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"unexpected {type(value).__name__}")


def host_identity() -> str:
    """The host name and this boot's id: two containers may share a name, never a boot id and /dev/shm
    unless they share the host's memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _peer_access(uuid_a: str, uuid_b: str) -> bool:
    by_uuid = {_device_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
    if uuid_a not in by_uuid or uuid_b not in by_uuid:
        return False
    return torch.cuda.can_device_access_peer(by_uuid[uuid_a], by_uuid[uuid_b])


@dataclass
class _Peer:
    index: int  # in this node's peer order
    path: str  # LOCAL, RDMA or HOST
    remote: torch.Tensor | None = None  # LOCAL: [micro-batches, region_bytes], this node's rows of the peer's region
    events: list = field(default_factory=list)  # LOCAL on CUDA: the peer's send events, opened here


def some_direct(slots: "DeviceSlots | None") -> bool:
    """Whether some peer of the node takes device slots (its rounds then land by `slots.land`,
    not in the staging's landing buffer)."""
    return slots is not None and slots.any_direct


def sends_from_device(slots: "DeviceSlots | None") -> bool:
    """Whether the node's rounds leave from its device send buffers (`device_send_choice`)."""
    return slots is not None and slots.sends_from_device


def link_post(slots: "DeviceSlots", micro_batch: int, begins: np.ndarray, ends: np.ndarray, *, step: int,
              layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """What the link posts of the round (`step`, `layer`, `micro_batch`) whose peers' bytes are
    [begins, ends): the byte ranges (empty for LOCAL peers: their bytes went by `slots.write`),
    the `targets` (each RDMA peer's row of its region, -1 for the others; None where no peer is
    RDMA) and the `mark` the rdma writes leave before each row (`round_mark`; 0 with no
    targets). DataPlaneError where an RDMA peer's bytes would not fit its row."""
    begins, ends, targets, mark = np.asarray(begins), np.asarray(ends), None, 0
    if slots.rdma_targets is not None:
        over = ends - begins > slots.rdma_row_bytes
        if over.any():  # per round: the rare failure alone pays for finding which peer
            i = int(np.flatnonzero(over)[0])
            raise DataPlaneError(f"{slots.name}: {ends[i] - begins[i]} bytes for {slots.peers[i]} exceed its device "
                                 f"slot of {slots.rdma_row_bytes[i]} bytes")
        targets, mark = slots.rdma_targets[micro_batch], round_mark(step, layer)
    if slots.local.any():  # none across hosts: the ranges as they are
        begins, ends = np.where(slots.local, 0, begins), np.where(slots.local, 0, ends)
    return begins, ends, targets, mark


def land_round(arrivals, micro_batch: int, row_bytes: int, staging, slots: "DeviceSlots | None",
               tokens: int) -> torch.Tensor:
    """A collected round's rows (`tokens` of them, its checked token counts' sum), peer order,
    end to end, as flat bytes on the node's device: by `slots.land` where some peer is direct,
    else through the host (gathered into `staging`'s landing buffer for the micro-batch, then
    one copy to the device; on the CPU the buffer)."""
    if some_direct(slots):
        return slots.land(arrivals, micro_batch, row_bytes, staging)
    host = staging.landing(tokens * row_bytes, slot=micro_batch)
    arrivals.gather_into(host)
    return staging.upload(host, slot=micro_batch)


def round_mismatch(arrivals, step: int, layer: int, row_bytes: int, slots: "DeviceSlots | None",
                   token_counts: np.ndarray | None = None) -> int:
    """`Arrivals.mismatch` where a direct peer's header carries no payload: its byte length is
    not checked (its bytes went by the region), every host peer's is."""
    if not some_direct(slots):
        return arrivals.mismatch(step, layer, row_bytes, token_counts)
    k = arrivals.mismatch(step, layer, -1, token_counts)
    return k if k >= 0 else slots.length_mismatch(arrivals, row_bytes)


def device_slots_for(name: str, peers: tuple[str, ...], device, micro_batches: int, region_bytes: int,
                     tp_size: int) -> "DeviceSlots | None":
    """A node's device slots where it asks for them (`region_bytes` > 0), else None; refused for
    tensor-parallel nodes, whose ranks share each message (their shares stay on the host path)."""
    if not region_bytes:
        return None
    if tp_size > 1:
        raise ValueError(f"device slots serve nodes of tensor-parallel size 1, not {tp_size} ({name}): leave "
                         f"device_slot_bytes at 0")
    return DeviceSlots(name, peers, device, micro_batches, region_bytes)


def trade_offers(offer: SlotOffer, link) -> list[SlotOffer]:
    """`offer` posted to each of its peers over `link` and theirs collected, peer order (one
    round each way, micro-batch 0, header flag OFFER); DataPlaneError where a peer sent data."""
    blob = np.frombuffer(offer.to_json(), dtype=np.uint8).copy()
    peers, n = offer.peers, len(offer.peers)
    link.post_round(peers, torch.from_numpy(blob), np.zeros(n, np.int64), np.full(n, blob.size, np.int64),
                    np.zeros(n, np.int64), step=0, layer=0, micro_batch=0, flags=OFFER)
    arrivals = link.collect_round(peers, micro_batch=0)
    try:
        if ((arrivals.fields[:, FLAGS] & OFFER) == 0).any():
            raise DataPlaneError(f"{offer.name}: a peer sent a data round where the device slots' offers were due "
                                 f"(one end of a pair does not use device slots)")
        return [SlotOffer.from_json(bytes(arrivals.payload(i)), peers[i]) for i in range(n)]
    finally:
        arrivals.release()


def _paths_text(by_name: dict[str, "_Peer"]) -> str:
    """Each path's peers, for the log."""
    paths = {path: ", ".join(p for p, e in by_name.items() if e.path == path) or "none" for path in (LOCAL, RDMA, HOST)}
    return (f"device slots with {paths[LOCAL]} on this host, by rdma with {paths[RDMA]}; through the host with "
            f"{paths[HOST]}")


def device_send_choice(slots: "DeviceSlots", link, make_sources: Callable[[], list[torch.Tensor]]) -> tuple[bool, str]:
    """Whether a node's rounds leave from its device send buffers (`make_sources()`, made only
    here, where they may serve), and why (words for the log): on CUDA, where some peer is RDMA,
    every peer is LOCAL or RDMA (a HOST peer needs the bytes in host memory: one post carries
    the round) and the link's adapter reads every such buffer in place (registered through
    its dma-buf). Else from pinned host memory."""
    if not slots.on_cuda or slots.local.all() or not slots.direct.any():
        return False, "rounds leave from " + ("pinned host memory" if slots.on_cuda else "host memory")
    if not slots.direct.all():
        return False, "rounds leave from pinned host memory (some peer goes through the host)"
    reads = getattr(link, "reads_in_place", None)
    sources = make_sources() if reads is not None else []
    if not sources or not all(reads(buffer) for buffer in sources):
        return False, ("rounds leave from pinned host memory (the link's adapter cannot read this GPU's send buffers: "
                       "see the transport's warning)")
    return True, "rounds leave from GPU memory (the adapter reads the device send buffers)"


def _new_region(name: str, device: torch.device, shape: tuple[int, int, int]) -> tuple[torch.Tensor, tuple, str]:
    """A node's zeroed receive region (`shape`: [micro-batches, peers, MARK_ROOM + payload bytes]),
    how a peer opens it (`SlotOffer.region`) and the path of its /dev/shm file ("" on CUDA, where
    CUDA IPC shares it)."""
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        region = torch.zeros(shape, dtype=torch.uint8, device=device)
        rebuild, args = reduce_tensor(region)
        if rebuild.__name__ != "rebuild_cuda_tensor":
            raise RuntimeError(f"torch shares this region through {rebuild.__name__}, not rebuild_cuda_tensor")
        return region, tuple(args), ""
    path = os.path.join(SHM_DIR, f"megainfer-slots-{name}-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.truncate(int(np.prod(shape)))
    return torch.from_file(path, shared=True, size=int(np.prod(shape)), dtype=torch.uint8).view(shape), (path,), path


def _open_region(offer: SlotOffer) -> torch.Tensor:
    """A peer's whole region on this host (its rows' MARK_ROOM included), as its offer says."""
    shape = (offer.micro_batches, len(offer.peers), MARK_ROOM + offer.region_bytes)
    if offer.device == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*offer.region)
    return torch.from_file(offer.region[0], shared=True, size=int(np.prod(shape)), dtype=torch.uint8).view(shape)


def _expose_region(name: str, link, region: torch.Tensor) -> list | None:
    """`region` exposed on `link` for the peers' rdma writes: the grant's plain fields, or None
    (said, with the reason, where the link has rdma but cannot expose it)."""
    expose = getattr(link, "expose", None)  # links of tests and tools may have no rdma at all
    if expose is None:
        return None
    try:
        grant = expose(region)
        return None if grant is None else grant.to_plain()
    except Exception as exc:  # the memory cannot be registered, or the GPU cannot order the writes
        logger.warning("%s: peers on other hosts cannot write into this node's device slots (%s); their rounds "
                       "go through the host", name, exc)
        return None


class DeviceSlots:
    """One node's receive region and send events, and its pairs' choice of path."""

    def __init__(self, name: str, peers: tuple[str, ...], device: torch.device | str, micro_batches: int,
                 region_bytes: int) -> None:
        if region_bytes <= 0:
            raise ValueError(f"device slots of {region_bytes} bytes: give the largest message a peer sends")
        self.name = name
        self.peers = tuple(peers)
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda and self.device.index is None:  # IPC events are opened on a numbered device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.micro_batches = micro_batches
        # Every row starts aligned, so any dtype view of a peer's bytes is valid.
        self.region_bytes = region_bytes = -(-region_bytes // ALIGN) * ALIGN
        shape = (micro_batches, len(self.peers), MARK_ROOM + region_bytes)
        self._memory, shared, self._path = _new_region(name, self.device, shape)  # exposed whole, marks and all
        self.region = self._memory[:, :, MARK_ROOM:]  # [micro-batch, peer]: that peer's payload
        self.marks = RegionMarks(name, self.peers, self._memory)
        handles, uuid_ = (), ""
        if self.on_cuda:
            # The writes' own stream: a round's copies wait only for their own data, never behind
            # the staging copies of later micro-batches.
            self.copy_stream = torch.cuda.Stream(self.device)
            self.send_events = [torch.cuda.Event(interprocess=True) for _ in range(micro_batches)]
            handles, uuid_ = tuple(bytes(e.ipc_handle()) for e in self.send_events), _device_uuid(self.device)
        self.offer = SlotOffer(name, host_identity(), self.device.type, uuid_, self.peers, micro_batches,
                               region_bytes, shared, handles)
        self._by_name: dict[str, _Peer] = {}
        # per peer, in peer order: bytes not through the link's slots (LOCAL or RDMA); LOCAL only
        self.direct = np.zeros(len(self.peers), dtype=bool)
        self.local = np.zeros(len(self.peers), dtype=bool)
        # per micro-batch, each RDMA peer's row in its region (-1: not RDMA), and those rows' sizes (link_post)
        self.rdma_targets: list[np.ndarray] | None = None
        self.rdma_row_bytes = np.full(len(self.peers), np.iinfo(np.int64).max, dtype=np.int64)
        self._link, self.sends_from_device = None, False  # the last exchange's link; device_send_choice's

    # -- wiring ---------------------------------------------------------------------------------
    def exchange(self, link, device_sources: Callable[[], list[torch.Tensor]] = list) -> None:
        """Trade offers with every peer over `link` (this node's region exposed on it first, where
        it can be), open the LOCAL peers' regions and events and aim at the RDMA peers'. Both
        ends of every pair call it at the same point of their protocol: the first round of a
        wiring. Any failure is a DataPlaneError. `device_sources()`: the node's device send
        buffers (made at the first call), which its rounds leave from where they can
        (`sends_from_device`)."""
        self._link = link
        try:
            grant = _expose_region(self.name, link, self._memory)
            aimable = tuple(p for p in self.peers if grant and link.can_aim(p))
            self.offer = dataclasses.replace(self.offer, grant=tuple(grant or ()), rdma_peers=aimable)
            offers = trade_offers(self.offer, link)
            self.attach(offers)
            for peer, offer in zip(self.peers, offers):
                if self._by_name[peer].path == RDMA:
                    link.aim(peer, list(offer.grant))
        except DataPlaneError:
            raise
        except Exception as exc:
            raise DataPlaneError(f"{self.name}: cannot trade device-slot offers with {', '.join(self.peers)}: "
                                 f"{exc}") from exc
        self.sends_from_device, why = device_send_choice(self, link, device_sources)
        logger.info("%s: %s; %s", self.name, _paths_text(self._by_name), why)

    def attach(self, offers: list[SlotOffer]) -> None:
        """Open what each peer offered (peer order); each pair's path from here on."""
        self.close_peers()
        targets = np.full((self.micro_batches, len(self.peers)), -1, dtype=np.int64)
        for i, (peer, offer) in enumerate(zip(self.peers, offers, strict=True)):
            if offer.name != peer:
                raise DataPlaneError(f"{self.name}: the offer from {peer} names {offer.name}")
            entry = _Peer(i, self.offer.path_with(offer))
            if entry.path != HOST:
                if self.name not in offer.peers:
                    raise DataPlaneError(f"{self.name}: {peer}'s region has no row for this node")
                if offer.micro_batches != self.micro_batches:
                    raise DataPlaneError(f"{self.name}: {peer} has {offer.micro_batches} micro-batches, this node "
                                         f"{self.micro_batches}")
                row = offer.peers.index(self.name)
            if entry.path == LOCAL:
                entry.remote = _open_region(offer)[:, row, MARK_ROOM:]
                if self.on_cuda:
                    entry.events = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in offer.events]
            elif entry.path == RDMA:  # its rows from the grant's start, row-major: `payload_offset`
                self.rdma_row_bytes[i] = offer.region_bytes
                targets[:, i] = payload_offset(np.arange(self.micro_batches), row, len(offer.peers), offer.region_bytes)
            self._by_name[peer] = entry
            self.direct[i] = entry.path != HOST
            self.local[i] = entry.path == LOCAL
        self.rdma_targets = list(targets) if (targets >= 0).any() else None

    def direct_peers(self) -> list[str]:
        """The peers this node reaches device to device (none before the offers are traded)."""
        return [peer for peer, direct in zip(self.peers, self.direct) if direct]

    @property
    def any_direct(self) -> bool:
        return bool(self.direct.any())

    @property
    def needs_host_copy(self) -> bool:
        """Whether some peer's bytes leave from host memory through the link (a HOST peer's, or
        an RDMA peer's, which the link's post writes into its region)."""
        return not self.local.all()

    # -- the data path --------------------------------------------------------------------------
    def write(self, micro_batch: int, data: torch.Tensor, begins: np.ndarray, ends: np.ndarray, *,
              ready=None) -> None:
        """Bytes [begins[i], ends[i]) of `data` (flat uint8 on this node's device) into direct
        peer i's region for `micro_batch`; host peers are skipped. On CUDA: copies on the slots'
        copy stream once `ready` fired (a CUDA event recorded where `data` was produced; None:
        after what the current stream launched so far), then this micro-batch's send event;
        returns without waiting. (An RDMA peer's bytes go with the link's post: `targets`.)"""
        peers = [(p, int(begins[p.index]), int(ends[p.index])) for p in self._by_name.values() if p.path == LOCAL]
        for p, begin, end in peers:
            if end - begin > p.remote.shape[1]:
                raise DataPlaneError(f"{self.name}: {end - begin} bytes for {self.peers[p.index]} exceed its device "
                                     f"slot of {p.remote.shape[1]} bytes")
        if not self.on_cuda:
            for p, begin, end in peers:
                p.remote[micro_batch, :end - begin].copy_(data[begin:end])
            return
        if ready is None:
            ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            for p, begin, end in peers:
                if end > begin:
                    p.remote[micro_batch, :end - begin].copy_(data[begin:end], non_blocking=True)
            data.record_stream(self.copy_stream)  # the allocator reuses it only after the copies read it
            self.send_events[micro_batch].record(self.copy_stream)

    def read(self, micro_batch: int, i: int, nbytes: int) -> torch.Tensor:
        """Peer i's bytes of `micro_batch` in this node's region, in place; on CUDA the current
        stream first waits on the peer's send event (no host wait)."""
        if nbytes > self.region_bytes:
            raise DataPlaneError(f"{self.name}: {self.peers[i]} announced {nbytes} bytes, past its device slot of "
                                 f"{self.region_bytes}")
        if self.on_cuda and self.local[i]:  # an RDMA peer's bytes were placed before its header came
            torch.cuda.current_stream(self.device).wait_event(self._by_name[self.peers[i]].events[micro_batch])
        return self.region[micro_batch, i, :nbytes]

    def land(self, arrivals, micro_batch: int, row_bytes: int, staging) -> torch.Tensor:
        """Every peer's rows of a collected round, peer order, end to end, as flat bytes on this
        node's device: direct peers' read in place from the region, host peers' gathered into
        `staging`'s landing buffer and uploaded in one copy, then one concatenation (none where
        only one peer had rows). Call before `arrivals.release()`."""
        nbytes = arrivals.token_counts * row_bytes
        host_dev, offsets = None, None
        if (nbytes[~self.direct] > 0).any():
            host = staging.landing(int(nbytes[~self.direct].sum()), slot=micro_batch)
            offsets = arrivals.gather_into(host)
            host_dev = staging.upload(host, slot=micro_batch)
        rdma_rows = np.flatnonzero((nbytes > 0) & self.direct & ~self.local)
        if rdma_rows.size:
            self.marks.hold(self._link, micro_batch, rdma_rows, round_mark(arrivals.fields[rdma_rows, STEP],
                                                                          arrivals.fields[rdma_rows, LAYER]))
        pieces = []
        for i in np.flatnonzero(nbytes):
            if self.direct[i]:
                pieces.append(self.read(micro_batch, int(i), int(nbytes[i])))
            else:
                pieces.append(host_dev[int(offsets[i]):int(offsets[i + 1])])
        if not pieces:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def length_mismatch(self, arrivals, row_bytes: int) -> int:
        """The first peer whose message is not its token count x `row_bytes` bytes (a host
        peer's) or not 0 bytes (a direct peer's header carries no payload), or -1."""
        due = np.where(self.direct, 0, arrivals.token_counts * row_bytes)
        bad = arrivals.fields[:, BYTE_LENGTH] != due
        where = np.flatnonzero(bad)
        return int(where[0]) if where.size else -1

    # -- end --------------------------------------------------------------------------------------
    def close_peers(self) -> None:
        self._by_name.clear()
        self.direct[:] = False
        self.local[:] = False
        self.rdma_targets = None
        self.rdma_row_bytes[:] = np.iinfo(np.int64).max

    def close(self) -> None:
        self.close_peers()
        if self._path:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = ""

    def __del__(self) -> None:
        self.close()
