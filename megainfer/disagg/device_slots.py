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

An offer travels as JSON of plain fields (`SlotOffer.to_json`, `from_json`), never pickled:
nothing a peer sends is unpickled (docs/reliability.md). The CUDA handles are the arguments
torch's own `reduce_tensor` gives its `rebuild_cuda_tensor`, written field by field, and the
classes among them are looked up in a fixed list on arrival.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from megainfer.disagg.expert_link import BYTE_LENGTH, FLAGS
from megainfer.disagg.staging_sizes import ALIGN
from megainfer.errors import DataPlaneError

logger = logging.getLogger(__name__)

OFFER = 2  # header flag of the offers' round (expert_link.BUSY is 1)
SHM_DIR = "/dev/shm"


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
                        tuple(_from_plain(v) for v in raw["region"]), tuple(bytes.fromhex(e) for e in raw["events"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataPlaneError(f"{peer} sent a malformed device-slot offer ({exc})") from None
        if offer.device not in ("cpu", "cuda") or offer.micro_batches <= 0 or offer.region_bytes <= 0:
            raise DataPlaneError(f"{peer} sent a device-slot offer out of range: device {offer.device!r}, "
                                 f"{offer.micro_batches} micro-batches, {offer.region_bytes} bytes")
        return offer

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
    direct: bool
    remote: torch.Tensor | None = None  # [micro-batches, region_bytes]: this node's rows of the peer's region
    events: list = field(default_factory=list)  # CUDA: the peer's send events, opened here


def some_direct(slots: "DeviceSlots | None") -> bool:
    """Whether some peer of the node takes device slots (its rounds then land by `slots.land`,
    not in the staging's landing buffer)."""
    return slots is not None and slots.any_direct


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
        shape = (micro_batches, len(self.peers), region_bytes)
        self._path = ""
        if self.on_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            self.region = torch.zeros(shape, dtype=torch.uint8, device=self.device)
            # The writes' own stream: a round's copies wait only for their own data, never behind
            # the staging copies of later micro-batches.
            self.copy_stream = torch.cuda.Stream(self.device)
            self.send_events = [torch.cuda.Event(interprocess=True) for _ in range(micro_batches)]
            handles = tuple(bytes(e.ipc_handle()) for e in self.send_events)
            rebuild, args = reduce_tensor(self.region)
            if rebuild.__name__ != "rebuild_cuda_tensor":
                raise RuntimeError(f"torch shares this region through {rebuild.__name__}, not rebuild_cuda_tensor")
            shared, uuid_ = tuple(args), _device_uuid(self.device)
        else:
            self._path = os.path.join(SHM_DIR, f"megainfer-slots-{name}-{uuid.uuid4().hex}")
            with open(self._path, "wb") as f:
                f.truncate(int(np.prod(shape)))
            self.region = torch.from_file(self._path, shared=True, size=int(np.prod(shape)),
                                          dtype=torch.uint8).view(shape)
            handles, shared, uuid_ = (), (self._path,), ""
        self.offer = SlotOffer(name, host_identity(), self.device.type, uuid_, self.peers, micro_batches,
                               region_bytes, shared, handles)
        self._by_name: dict[str, _Peer] = {}
        self.direct = np.zeros(len(self.peers), dtype=bool)  # per peer, in peer order

    # -- wiring ---------------------------------------------------------------------------------
    def exchange(self, link) -> None:
        """Trade offers with every peer over `link` (one round each way, micro-batch 0) and open
        the direct peers' regions and events. Both ends of every pair call it at the same point
        of their protocol: the first round of a wiring. Any failure is a DataPlaneError."""
        try:
            self._exchange(link)
        except DataPlaneError:
            raise
        except Exception as exc:
            raise DataPlaneError(f"{self.name}: cannot trade device-slot offers with {', '.join(self.peers)}: "
                                 f"{exc}") from exc
        direct = self.direct_peers()
        logger.info("%s: device slots with %s; through the host with %s", self.name, ", ".join(direct) or "no peer",
                    ", ".join(p for p in self.peers if p not in direct) or "none")

    def _exchange(self, link) -> None:
        blob = np.frombuffer(self.offer.to_json(), dtype=np.uint8).copy()
        n = len(self.peers)
        link.post_round(self.peers, torch.from_numpy(blob), np.zeros(n, np.int64), np.full(n, blob.size, np.int64),
                        np.zeros(n, np.int64), step=0, layer=0, micro_batch=0, flags=OFFER)
        arrivals = link.collect_round(self.peers, micro_batch=0)
        try:
            if ((arrivals.fields[:, FLAGS] & OFFER) == 0).any():
                raise DataPlaneError(f"{self.name}: a peer sent a data round where the device slots' offers were due "
                                     f"(one end of a pair does not use device slots)")
            offers = [SlotOffer.from_json(bytes(arrivals.payload(i)), self.peers[i]) for i in range(n)]
        finally:
            arrivals.release()
        self.attach(offers)

    def attach(self, offers: list[SlotOffer]) -> None:
        """Open what each peer offered (peer order); direct pairs from here on."""
        self.close_peers()
        for i, (peer, offer) in enumerate(zip(self.peers, offers, strict=True)):
            if offer.name != peer:
                raise DataPlaneError(f"{self.name}: the offer from {peer} names {offer.name}")
            entry = _Peer(i, self.offer.direct_with(offer))
            if entry.direct:
                if self.name not in offer.peers:
                    raise DataPlaneError(f"{self.name}: {peer}'s region has no row for this node")
                if offer.micro_batches != self.micro_batches:
                    raise DataPlaneError(f"{self.name}: {peer} has {offer.micro_batches} micro-batches, this node "
                                         f"{self.micro_batches}")
                row = offer.peers.index(self.name)
                entry.remote = self._open(offer)[:, row, :]
                if self.on_cuda:
                    entry.events = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in offer.events]
            self._by_name[peer] = entry
            self.direct[i] = entry.direct

    def _open(self, offer: SlotOffer) -> torch.Tensor:
        shape = (offer.micro_batches, len(offer.peers), offer.region_bytes)
        if offer.device == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            return rebuild_cuda_tensor(*offer.region)
        return torch.from_file(offer.region[0], shared=True, size=int(np.prod(shape)), dtype=torch.uint8).view(shape)

    def direct_peers(self) -> list[str]:
        """The peers this node reaches device to device (none before the offers are traded)."""
        return [peer for peer, direct in zip(self.peers, self.direct) if direct]

    @property
    def any_direct(self) -> bool:
        return bool(self.direct.any())

    # -- the data path --------------------------------------------------------------------------
    def write(self, micro_batch: int, data: torch.Tensor, begins: np.ndarray, ends: np.ndarray, *,
              ready=None) -> None:
        """Bytes [begins[i], ends[i]) of `data` (flat uint8 on this node's device) into direct
        peer i's region for `micro_batch`; host peers are skipped. On CUDA: copies on the slots'
        copy stream once `ready` fired (a CUDA event recorded where `data` was produced; None:
        after what the current stream launched so far), then this micro-batch's send event;
        returns without waiting."""
        peers = [(p, int(begins[p.index]), int(ends[p.index])) for p in self._by_name.values() if p.direct]
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
        if self.on_cuda:
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
        """The first host peer whose message is not its token count x `row_bytes` bytes (direct
        peers' headers carry no payload), or -1."""
        bad = ~self.direct & (arrivals.fields[:, BYTE_LENGTH] != arrivals.token_counts * row_bytes)
        where = np.flatnonzero(bad)
        return int(where[0]) if where.size else -1

    def host_ranges(self, begins: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges the link posts: empty for direct peers (their bytes went by `write`)."""
        return np.where(self.direct, 0, begins), np.where(self.direct, 0, ends)

    # -- end --------------------------------------------------------------------------------------
    def close_peers(self) -> None:
        self._by_name.clear()
        self.direct[:] = False

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
