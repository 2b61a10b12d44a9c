"""Shared-memory channels: peers on one host.

The receiver owns one segment per sending peer (a 0600 file under /dev/shm, named with a
random token sent only over the authenticated handshake, its bytes allocated when it is made
so that a /dev/shm too small fails at connect rather than with SIGBUS on a write). Layout:
    0   4  receiver asleep (1 while the receiver sleeps on its doorbell)
    4   4  sender asleep   (1 while the sender sleeps waiting for a free slot)
    8   56 reserved
    64  then `slots` slots of `stride` bytes, each:
        0   4  state (0 free, 1 full)     4  60  reserved
        64  32 message header             96  ...  payload (slot_bytes)
The sender copies the payload in, writes the header, sets state to full, and rings the
receiver's doorbell only if the receiver is asleep; the receiver reads the payload in
place and, on release, sets state to free and rings the sender only if it sleeps. State
words are the truth; doorbells only wake. A side about to sleep sets its asleep word and
re-checks the slots before it sleeps, and every store that precedes a load of the other
side's word is fenced (x86 may otherwise reorder the two), so no wakeup is lost.

The sending peer maps this memory and can write anything into it, so nothing read from it is
trusted unchecked: each header meets transport/wire_rules.py before its slot is handed out
(magic, sender, length, in sequence, the slot its micro-batch names), a state word that is
neither free nor full is refused, and on release the slot must still hold the message handed
out (a sender that wrote another header into a held slot is caught then; payload bytes are
not hashed, so a rewrite of those alone goes unseen). What such a peer can spoil is its
own segment only: every sending peer has a segment of its own.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import socket
import struct
import threading

from transport.errors import BackendUnavailable, ProtocolViolation
from transport.wire import DOORBELL, DOORBELL_DATA, DOORBELL_FREE, DOORBELL_NAME, HEADER, SEQ_MASK, SEQ_OFFSET, Header
from transport.wire_rules import MICRO_BATCH_AT, SEQ_AT, InboundRules, broke

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where segments live; a module constant so tests can point it at a small tmpfs
# posix_fallocate's errors for a file system that cannot preallocate (EINVAL included: len > 0 here)
FALLOCATE_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
STATE = struct.Struct("<I")
SEQ = struct.Struct("<I")  # a header's seq field, read alone on release
FREE, FULL = 0, 1
HEADER_OFFSET, PAYLOAD_OFFSET = 64, 96  # within a slot
SLOTS_OFFSET = 64  # within a segment
RECEIVER_ASLEEP, SENDER_ASLEEP = 0, 4
_FENCE = threading.Lock()  # an uncontended lock round trip is a locked instruction: a full fence


def fence() -> None:
    _FENCE.acquire()
    _FENCE.release()


def slot_stride(slot_bytes: int) -> int:
    return PAYLOAD_OFFSET + -(-slot_bytes // 64) * 64


def shm_available() -> tuple[bool, str]:
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return False, f"{SHM_DIR} is not a writable directory"
    return True, ""


class Doorbell:
    """This endpoint's UNIX datagram socket (abstract namespace): wakeups from local peers."""

    def __init__(self) -> None:
        self.name = f"megainfer-m2n-{secrets.token_hex(12)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.sock.setblocking(False)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)  # a full queue already guarantees the peer a wakeup

    def ring(self, peer_doorbell: str, kind: int, channel: int, slot: int) -> None:
        try:
            self._out.sendto(DOORBELL.pack(kind, 0, channel, slot, 0), "\0" + peer_doorbell)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            # A full queue still wakes the peer; a vanished peer is caught by its control socket.
            pass

    def drain(self) -> None:
        while True:
            try:
                self.sock.recv(64)
            except BlockingIOError:
                return

    def close(self) -> None:
        self.sock.close()
        self._out.close()


def allocate(fd: int, path: str, size: int) -> None:
    """Gives the segment its `size` bytes of shared memory now. A sparse file would take its
    pages on first touch, and where /dev/shm is too small (Docker's default is 64 MB) that touch
    is a SIGBUS in whichever process writes, not an error here."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise BackendUnavailable(no_space_message(path, size)) from None
        if exc.errno not in FALLOCATE_UNSUPPORTED:
            raise
        _warn_sparse(path, exc)


def no_space_message(path: str, size: int) -> str:
    stats = os.statvfs(os.path.dirname(path))
    free = stats.f_bavail * stats.f_frsize
    return (f"shared-memory segment {path} needs {size:,} bytes but {os.path.dirname(path)} has "
            f"{free:,} bytes free: enlarge /dev/shm (Docker: `docker run --shm-size=...`; Ray's cluster "
            f"launcher: `--shm-size=...` in docker run_options; Kubernetes/KubeRay: an emptyDir volume with "
            f"medium: Memory mounted at /dev/shm), use fewer or smaller slots, or use the tcp backend")


_warned_sparse: set[str] = set()  # file systems already reported as unable to preallocate


def _warn_sparse(path: str, exc: OSError) -> None:
    folder = os.path.dirname(path)
    if folder not in _warned_sparse:
        _warned_sparse.add(folder)
        logger.warning("%s cannot preallocate (%s): shared-memory segments there stay sparse, and a full "
                       "file system shows as SIGBUS on first write instead of an error at connect", folder, exc)


class _Segment:
    def __init__(self, path: str, size: int, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                allocate(fd, path, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(path)  # a partial segment must not outlive its failed creation
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self.map)

    def close(self) -> None:
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            pass  # a consumer still holds a view (e.g. a tensor): the mapping goes with it


class ShmInbound:
    """peer -> this endpoint: owns the segment the peer writes into."""

    kind = "shm"

    def __init__(self, peer: str, channel_id: int, slot_bytes: int, num_slots: int, doorbell: Doorbell, *,
                 sender: int) -> None:
        self.peer = peer
        self.channel_id = channel_id
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.stride = slot_stride(slot_bytes)
        self.doorbell = doorbell
        path = os.path.join(SHM_DIR, f"megainfer-m2n-{secrets.token_hex(12)}")
        self.segment = _Segment(path, SLOTS_OFFSET + self.stride * num_slots, create=True)
        self.rules = InboundRules(peer, sender, slot_bytes, num_slots)  # its held slots: handed out, not released
        self.violation = ""  # found on a release or after messages a poll returned; raised by the next poll
        self.peer_doorbell = ""
        self.peer_channel = 0
        self.control: socket.socket | None = None

    @property
    def outstanding(self) -> int:
        return len(self.rules.held)

    def handshake_info(self) -> dict:
        return {"segment": self.segment.path, "doorbell": self.doorbell.name, "channel": self.channel_id}

    def bind_peer(self, doorbell: str, channel: int, control: socket.socket) -> None:
        self.peer_doorbell, self.peer_channel, self.control = doorbell, channel, control

    def poll(self) -> list[tuple[int, Header]]:
        """Full slots not yet handed out, in send order. A sender writes them in sequence, but a
        scan may read a slot just before its message lands and a later slot just after its own
        did; so where a gap shows, the slots are read once more after a fence, and then every
        message before the newest one seen must be there (else one was skipped)."""
        if self.violation:
            raise ProtocolViolation(self.violation)
        found = self._full_slots()
        if not found:
            return found
        rules = self.rules
        if len(found) == 1:  # the common case, in one look
            slot, fields = found[0]
            if fields[SEQ_AT] == rules.next_seq and fields[MICRO_BATCH_AT] % self.num_slots == slot:
                return [rules.admit(fields)]
        first = rules.next_seq
        done: list[tuple[int, Header]] = []
        try:
            self._in_order(found, done)
            if len(done) < len(found):
                newest = max((fields[SEQ_AT] - first) & SEQ_MASK for _, fields in found)
                fence()
                self._in_order(self._full_slots(), done)
                if (self.rules.next_seq - first) & SEQ_MASK <= newest:  # still short of the newest seen
                    raise broke(self.peer, f"message seq {self.rules.next_seq} never arrived, yet seq "
                                           f"{(first + newest) & SEQ_MASK} did (a message was skipped)")
        except ProtocolViolation as exc:
            if not done:
                raise
            self.violation = str(exc)  # raised by the next poll, once these are handed out
        return done

    def _full_slots(self) -> list[tuple[int, tuple]]:
        """(slot, unpacked header fields) of full slots not handed out yet."""
        found = []
        view, stride, held = self.segment.view, self.stride, self.rules.held
        for slot in range(self.num_slots):
            base = SLOTS_OFFSET + slot * stride
            state = STATE.unpack_from(view, base)[0]
            if state == FULL:
                if slot not in held:
                    found.append((slot, HEADER.unpack_from(view, base + HEADER_OFFSET)))
            elif state != FREE:
                raise broke(self.peer, f"slot {slot}'s state word is {state} (0 free, 1 full)")
        return found

    def _in_order(self, found: list[tuple[int, tuple]], done: list) -> None:
        """Admits into `done` the run of `found` that continues the sequence; stops at a gap."""
        rules = self.rules
        for _, fields in found:
            if rules.ahead(fields[SEQ_AT]) >= self.num_slots:  # behind (a replay), or further ahead than slots allow
                raise rules.sequence_refusal(fields[SEQ_AT])
        if len(found) > 1:
            found.sort(key=lambda item: rules.ahead(item[1][SEQ_AT]))
        for slot, fields in found:
            if fields[SEQ_AT] != rules.next_seq:
                break
            if fields[MICRO_BATCH_AT] % self.num_slots != slot:
                raise broke(self.peer, f"message seq {fields[SEQ_AT]} for micro-batch {fields[MICRO_BATCH_AT]} lies in "
                                       f"slot {slot}, not {fields[MICRO_BATCH_AT] % self.num_slots}")
            done.append(rules.admit(fields))

    def payload(self, slot: int, length: int) -> memoryview:
        base = SLOTS_OFFSET + slot * self.stride + PAYLOAD_OFFSET
        return self.segment.view[base:base + length]

    def release(self, slot: int) -> None:
        seq = self.rules.held.pop(slot, None)
        view = self.segment.view
        base = SLOTS_OFFSET + slot * self.stride
        if SEQ.unpack_from(view, base + HEADER_OFFSET + SEQ_OFFSET)[0] != seq and seq is not None:
            self.violation = str(broke(self.peer, f"slot {slot} was rewritten while this endpoint held message seq "
                                                  f"{seq} in it"))
        STATE.pack_into(view, base, FREE)
        fence()
        if STATE.unpack_from(view, SENDER_ASLEEP)[0]:
            self.doorbell.ring(self.peer_doorbell, DOORBELL_FREE, self.peer_channel, slot)

    def set_asleep(self, asleep: bool) -> None:
        STATE.pack_into(self.segment.view, RECEIVER_ASLEEP, int(asleep))
        fence()

    def close(self) -> None:
        self.segment.close()
        try:
            os.unlink(self.segment.path)  # the owner removes the name; mappings stay valid
        except FileNotFoundError:
            pass


class ShmOutbound:
    """this endpoint -> peer: maps the segment the peer created for us."""

    kind = "shm"

    def __init__(self, peer: str, channel_id: int, slot_bytes: int, num_slots: int, doorbell: Doorbell,
                 info: dict, control: socket.socket) -> None:
        self.peer = peer
        self.channel_id = channel_id
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.stride = slot_stride(slot_bytes)
        self.doorbell = doorbell
        path = str(info["segment"])  # info is the peer's acknowledgement's "shm" object
        if not path.startswith(os.path.join(SHM_DIR, "megainfer-m2n-")) or "/" in path[len(SHM_DIR) + 1:]:
            raise BackendUnavailable(f"peer {peer} named an unexpected shared-memory segment {path!r}")
        doorbell, channel = info["doorbell"], info["channel"]
        if not isinstance(doorbell, str) or not DOORBELL_NAME.match(doorbell) or type(channel) is not int or \
                not 0 <= channel <= 0xFFFF:
            raise BackendUnavailable(f"peer {peer} named a malformed doorbell {doorbell!r:.60} or channel "
                                     f"{channel!r:.20}")
        self.segment = _Segment(path, SLOTS_OFFSET + self.stride * num_slots, create=False)
        self.peer_doorbell, self.peer_channel = doorbell, channel
        self.control = control

    def try_send(self, header: Header, payload) -> bool:
        base = SLOTS_OFFSET + header.micro_batch % self.num_slots * self.stride
        view = self.segment.view
        if STATE.unpack_from(view, base)[0] != FREE:
            return False
        n = header.byte_length
        if n:
            view[base + PAYLOAD_OFFSET:base + PAYLOAD_OFFSET + n] = payload
        header.pack_into(view, base + HEADER_OFFSET)
        STATE.pack_into(view, base, FULL)
        fence()
        if STATE.unpack_from(view, RECEIVER_ASLEEP)[0]:
            self.doorbell.ring(self.peer_doorbell, DOORBELL_DATA, self.peer_channel,
                               header.micro_batch % self.num_slots)
        return True

    def set_asleep(self, asleep: bool) -> None:
        STATE.pack_into(self.segment.view, SENDER_ASLEEP, int(asleep))
        fence()

    def unreleased(self) -> int:
        """Slots sent into that the peer has not released (state words are the truth)."""
        view = self.segment.view
        return sum(STATE.unpack_from(view, SLOTS_OFFSET + slot * self.stride)[0] != FREE
                   for slot in range(self.num_slots))

    def close(self) -> None:
        self.segment.close()


