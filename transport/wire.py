"""Every byte layout the transport puts on a wire or in shared memory. Little-endian,
packed with `struct`; nothing received is ever unpickled.

Message header (32 bytes), in front of every payload (TCP stream, shm slot, RDMA slot):
    offset  size  field
    0       4     magic_version  0x4D324E01 ("M2N", version 1)
    4       4     step           engine step (iteration) number
    8       2     layer          model layer
    10      2     micro_batch    micro-batch index; selects the receiver's slot (mod slots)
    12      2     sender         the sending endpoint's rank
    14      2     flags          the sender's bit flags, passed through untouched (the
                                 transport reads none; megainfer's expert answers set
                                 BUSY = 1, see megainfer/disagg/expert_link.py); 0 by default
    16      4     token_count    tokens carried (0 for an empty message)
    20      4     seq            per-channel sequence number, from 0, wrapping at 2**32
                                 (what a receiver checks: transport/wire_rules.py)
    24      8     byte_length    payload bytes that follow

Handshake frames (TCP control connection, both directions, before anything else):
    frame := u32 length | body (at most MAX_FRAME bytes);  body of CHALLENGE is 32 random
    bytes, of PROOF is HMAC-SHA256(secret, b"m2n-proof" | role | own nonce | peer nonce)
    (32 bytes), of HELLO (`Hello`) and of the acknowledgement a UTF-8 JSON object of plain
    fields (names, numbers, strings: never code), each checked before it is used.

Credit frame (TCP, receiver -> sender on the data connection), 8 bytes:
    0  4  magic 0x43524454 ("CRDT")      4  2  slot      6  2  reserved

Doorbell datagram (shm, UNIX datagram socket), 8 bytes:
    0  1  kind (1 = data ready, 2 = slot freed)   1  1  reserved
    2  2  channel id at the recipient             4  2  slot    6  2  reserved

RDMA immediate data (32 bits, network byte order on the wire), the tag of a write:
    bits 31..30  kind (0 = data, 1 = credit)   bits 29..16  channel   bits 15..0  slot

RDMA queue-pair info (exchanged over the control connection), 46 bytes:
    0 4 qp_num   4 4 psn (the first PSN this side sends)   8 2 lid   10 1 port
    11 1 gid_index   12 16 gid   28 4 rkey   32 8 addr (base of this side's registered
    region; layout in transport/rdma.py)   40 4 slot_stride
    44 1 mtu (this port's active MTU, enum ibv_mtu: 1 = 256 ... 5 = 4096; 0 = not stated)
    45 1 link_layer (1 InfiniBand, 2 Ethernet; 0 = not stated)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple

from transport.errors import HandshakeError
from transport.selection import BACKENDS, Capabilities

MAGIC = 0x4D324E01
CREDIT_MAGIC = 0x43524454
HEADER = struct.Struct("<IIHHHHIIQ")
HEADER_BYTES = HEADER.size  # 32
CREDIT = struct.Struct("<IHH")
DOORBELL = struct.Struct("<BBHHH")
DOORBELL_DATA, DOORBELL_FREE = 1, 2
QP_INFO = struct.Struct("<IIHBB16sIQIBB")
MAX_FRAME = 1 << 16  # handshake frames are small; anything larger is not a peer of ours
SEQ_OFFSET = 20  # the header's seq field, in bytes from the magic
SEQ_MASK = (1 << 32) - 1  # sequence numbers wrap at 2**32
MAX_SLOTS = 1 << 16  # slots per channel: credits, doorbells and RDMA tags carry a u16 slot
MAX_SLOT_BYTES = 1 << 40  # what an acknowledgement may state as a slot's size
MAX_NAME = 256  # characters in an endpoint's name
DOORBELL_NAME = re.compile(r"megainfer-m2n-[0-9a-f]{24}\Z")  # transport.shm.Doorbell's names


class Header(NamedTuple):
    """Fields in wire order (after the magic), so packing is one call."""

    step: int = 0
    layer: int = 0
    micro_batch: int = 0
    sender: int = 0
    flags: int = 0
    token_count: int = 0
    seq: int = 0
    byte_length: int = 0

    def pack_into(self, buf, offset: int = 0) -> None:
        HEADER.pack_into(buf, offset, MAGIC, *self)

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, *self)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "Header":
        fields = HEADER.unpack_from(buf, offset)
        if fields[0] != MAGIC:
            raise HandshakeError(f"bad message header magic 0x{fields[0]:08x} (expected 0x{MAGIC:08x}): "
                                 "the peer speaks another protocol or version")
        return cls._make(fields[1:])


def check_header_fields(step: int, layer: int, micro_batch: int, sender: int, token_count: int) -> None:
    if 0 <= step < 1 << 32 and 0 <= layer < 1 << 16 and 0 <= micro_batch < 1 << 16 and 0 <= sender < 1 << 16 \
            and 0 <= token_count < 1 << 32:
        return
    for name, value, bits in (("step", step, 32), ("layer", layer, 16), ("micro_batch", micro_batch, 16),
                              ("sender", sender, 16), ("token_count", token_count, 32)):
        if not 0 <= value < (1 << bits):
            raise ValueError(f"header field {name}={value} does not fit {bits} unsigned bits")


# -- RDMA tags -------------------------------------------------------------------------
IMM_DATA, IMM_CREDIT = 0, 1


def pack_tag(kind: int, channel: int, slot: int) -> int:
    if kind not in (IMM_DATA, IMM_CREDIT) or not 0 <= channel < (1 << 14) or not 0 <= slot < (1 << 16):
        raise ValueError(f"tag out of range: kind={kind} channel={channel} slot={slot}")
    return (kind << 30) | (channel << 16) | slot


def unpack_tag(tag: int) -> tuple[int, int, int]:
    return (tag >> 30) & 0x3, (tag >> 16) & 0x3FFF, tag & 0xFFFF


@dataclass(frozen=True)
class QPInfo:
    qp_num: int
    psn: int
    lid: int
    port: int
    gid_index: int
    gid: bytes  # 16 raw bytes
    rkey: int
    addr: int
    slot_stride: int
    mtu: int = 0  # enum ibv_mtu; 0 = not stated (an RDMA channel refuses it)
    link_layer: int = 0  # 1 InfiniBand, 2 Ethernet; 0 = not stated

    def pack(self) -> bytes:
        return QP_INFO.pack(self.qp_num, self.psn, self.lid, self.port, self.gid_index, self.gid, self.rkey,
                            self.addr, self.slot_stride, self.mtu, self.link_layer)

    @classmethod
    def unpack(cls, data: bytes) -> "QPInfo":
        if len(data) != QP_INFO.size:
            raise HandshakeError(f"RDMA queue-pair info is {len(data)} bytes, expected {QP_INFO.size}")
        return cls(*QP_INFO.unpack(data))

    @property
    def gid_text(self) -> str:
        """The GID as verbs prints it: eight colon-separated groups of four hex digits."""
        h = self.gid.hex()
        return ":".join(h[i:i + 4] for i in range(0, 32, 4))


# A region write's mark (`post_round(..., targets=, mark=)`) lies this many bytes before the
# write's offset (transport/csrc/channels.h kMarkLead): a 4-byte word the owner waits on.
MARK_LEAD = 8


@dataclass(frozen=True)
class RegionGrant:
    """Memory an endpoint exposed for its rdma peers to write into (`Endpoint.expose`): its
    address as the endpoint's adapter names it (a device address for GPU memory registered
    through its dma-buf), its length and remote key. A peer given it (`Endpoint.aim`) may post
    a round's payload to an offset of it (`post_round(targets=...)`). It travels inside an
    owner's own message as plain fields (`to_plain`, `from_plain`), never pickled."""

    address: int
    nbytes: int
    rkey: int
    device: bool  # GPU memory

    def to_plain(self) -> list:
        return [self.address, self.nbytes, self.rkey, self.device]

    @classmethod
    def from_plain(cls, fields) -> "RegionGrant":
        """A grant from its plain fields, each checked; ValueError naming what is wrong."""
        if not isinstance(fields, (list, tuple)) or len(fields) != 4:
            raise ValueError(f"a region grant is [address, bytes, rkey, device], not {fields!r}")
        address, nbytes, rkey, device = fields
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (address, nbytes, rkey)) or \
                not isinstance(device, bool):
            raise ValueError(f"a region grant holds three integers and a flag, not {fields!r}")
        if not (0 < address < 1 << 64 and 0 < nbytes < 1 << 64 and 0 < rkey < 1 << 32):
            raise ValueError(f"a region grant out of range: address {address:#x}, {nbytes} bytes, rkey {rkey:#x}")
        return cls(address, nbytes, rkey, device)


# -- handshake frames --------------------------------------------------------------------
def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack("<I", len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise HandshakeError("connection closed during the handshake")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (length,) = struct.unpack("<I", recv_exact(sock, 4))
    if length > MAX_FRAME:
        raise HandshakeError(f"handshake frame of {length} bytes refused (limit {MAX_FRAME})")
    return recv_exact(sock, length)


def proof(secret: bytes, role: bytes, own_nonce: bytes, peer_nonce: bytes) -> bytes:
    return hmac.new(secret, b"m2n-proof" + role + own_nonce + peer_nonce, hashlib.sha256).digest()


def send_json(sock: socket.socket, obj: dict) -> None:
    send_frame(sock, json.dumps(obj, separators=(",", ":")).encode())


def recv_json(sock: socket.socket) -> dict:
    try:
        obj = json.loads(recv_frame(sock).decode())
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, an int past the digit limit, nested too deep
        raise HandshakeError(f"malformed handshake message ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(obj, dict):
        raise HandshakeError(f"malformed handshake message (a JSON {type(obj).__name__}, not an object)")
    return obj


def _bounded_int(obj: dict, key: str, low: int, high: int, what: str) -> int:
    value = obj.get(key)
    if type(value) is not int or not low <= value <= high:  # bool is no int here, nor a float
        raise HandshakeError(f"{what} field {key!r} must be an integer in [{low}, {high}], got {value!r:.60}")
    return value


@dataclass(frozen=True)
class Hello:
    """The connecting endpoint's first message after authentication. `parse` checks every field
    the acceptor uses, since a peer that holds the secret may still be buggy."""

    name: str  # the connecting endpoint's name (EndpointSpec.name)
    rank: int  # the sender rank every header it sends will carry
    backend: str  # what it asked for: one of selection.BACKENDS
    channel: int  # its id for this channel (its shm doorbell rings name it)
    doorbell: str  # its shm doorbell's name, "" where it has none
    capabilities: Capabilities  # what it can do (selection.py chooses from it)

    def fields(self) -> dict:
        return {"name": self.name, "rank": self.rank, "backend": self.backend, "channel": self.channel,
                "doorbell": self.doorbell, **self.capabilities.hello_fields()}

    @classmethod
    def parse(cls, obj: dict) -> "Hello":
        name = obj.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or "/" in name:
            raise HandshakeError(f"hello field 'name' must be an endpoint name (1 to {MAX_NAME} characters, no "
                                 f"'/'), got {name!r:.60}")
        backend = obj.get("backend", "auto")
        if backend not in BACKENDS:
            raise HandshakeError(f"hello field 'backend' must be one of {', '.join(BACKENDS)}, got {backend!r:.60}")
        doorbell = obj.get("doorbell", "")
        if not isinstance(doorbell, str) or doorbell and not DOORBELL_NAME.match(doorbell):
            raise HandshakeError(f"hello field 'doorbell' is not a doorbell name: {doorbell!r:.60}")
        return cls(name, _bounded_int(obj, "rank", 0, 0xFFFF, "hello"), backend,
                   _bounded_int(obj, "channel", 0, 0xFFFF, "hello"), doorbell, Capabilities.from_hello(obj))


def ack_sizes(ack: dict) -> tuple[int, int]:
    """(slot_bytes, num_slots) of an acceptor's acknowledgement, checked."""
    return (_bounded_int(ack, "slot_bytes", 1, MAX_SLOT_BYTES, "acknowledgement"),
            _bounded_int(ack, "num_slots", 1, MAX_SLOTS, "acknowledgement"))
