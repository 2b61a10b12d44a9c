"""Shared-memory segments are allocated when they are made: a /dev/shm too small for them is a
clear error at creation (the path, the bytes wanted and free, the fix), never a SIGBUS on the
first write past the limit, and the partial segment is removed."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import threading

import pytest

from transport import Endpoint, EndpointSpec
from transport import shm
from transport.errors import BackendUnavailable

SECRET = b"s" * 32
SMALL_TMPFS_BYTES = 1 << 20  # the mount's size; a segment of two 1 MiB slots does not fit


def segment_bytes(slot_bytes: int, num_slots: int) -> int:
    return shm.SLOTS_OFFSET + shm.slot_stride(slot_bytes) * num_slots


@pytest.fixture
def doorbell():
    bell = shm.Doorbell()
    yield bell
    bell.close()


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A 1 MiB tmpfs standing in for a container's small /dev/shm (needs root and mount)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command to make a small tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_TMPFS_BYTES}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {done.stderr.strip()}")
    try:
        monkeypatch.setattr(shm, "SHM_DIR", str(folder))
        yield folder
    finally:
        # lazy: a mapping a failed test left open must not keep the mount (and this test) stuck
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def test_a_segment_owns_its_bytes_when_made(doorbell):
    inbound = shm.ShmInbound("peer", 0, slot_bytes=1 << 20, num_slots=3, doorbell=doorbell, sender=0)
    try:
        size = segment_bytes(1 << 20, 3)
        stat = os.stat(inbound.segment.path)
        assert stat.st_size == size
        assert stat.st_blocks * 512 >= size  # allocated, not sparse
    finally:
        inbound.close()
    assert not os.path.exists(inbound.segment.path)


def test_a_segment_too_large_for_shm_is_a_clear_error_and_leaves_nothing(small_shm, doorbell):
    wanted = segment_bytes(1 << 20, 2)
    with pytest.raises(BackendUnavailable) as caught:
        shm.ShmInbound("peer", 0, slot_bytes=1 << 20, num_slots=2, doorbell=doorbell, sender=0)
    message = str(caught.value)
    assert str(small_shm / "megainfer-m2n-") in message  # the segment's path
    assert f"{wanted:,} bytes" in message
    assert f"{SMALL_TMPFS_BYTES:,} bytes free" in message  # the failed allocation was given back
    assert "--shm-size" in message and "medium: Memory" in message and "tcp backend" in message
    assert os.listdir(small_shm) == []


def test_a_segment_that_fits_the_small_shm_is_made(small_shm, doorbell):
    inbound = shm.ShmInbound("peer", 0, slot_bytes=1 << 18, num_slots=2, doorbell=doorbell, sender=0)
    try:
        assert os.stat(inbound.segment.path).st_blocks * 512 >= segment_bytes(1 << 18, 2)
    finally:
        inbound.close()


def test_endpoints_on_a_small_shm_fail_to_connect_with_the_fix(small_shm):
    """The endpoints' connect() surfaces the allocation error with its fix (the acceptor tells
    its peer why it refused), not a handshake timeout."""
    endpoints = {name: Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, backend="shm",
                                             slot_bytes=1 << 20, num_slots=2, timeout_s=2.0))
                 for rank, name in enumerate(["a", "e"])}
    errors: list[BaseException] = []

    def connect(name: str, peer: str) -> None:
        try:
            endpoints[name].connect({peer: endpoints[peer].address})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=pair) for pair in (("a", "e"), ("e", "a"))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for ep in endpoints.values():
            ep.close()
    assert errors and all("--shm-size" in str(exc) for exc in errors), errors
    assert os.listdir(small_shm) == []


def test_a_file_system_that_cannot_preallocate_falls_back_to_sparse_and_says_so(monkeypatch, tmp_path, doorbell,
                                                                               caplog):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm, "_warned_sparse", set())
    with caplog.at_level(logging.WARNING, logger="transport.shm"):
        channels = [shm.ShmInbound("peer", i, slot_bytes=1 << 16, num_slots=2, doorbell=doorbell, sender=0)
                    for i in range(2)]
    try:
        assert all(os.stat(c.segment.path).st_size == segment_bytes(1 << 16, 2) for c in channels)
        warnings = [r for r in caplog.records if "cannot preallocate" in r.getMessage()]
        assert len(warnings) == 1  # once per folder, not per segment
    finally:
        for c in channels:
            c.close()


def test_other_allocation_errors_are_not_swallowed_and_leave_nothing(monkeypatch, tmp_path, doorbell):
    def failing(fd, offset, length):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "posix_fallocate", failing)
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    with pytest.raises(OSError) as caught:
        shm.ShmInbound("peer", 0, slot_bytes=1 << 16, num_slots=2, doorbell=doorbell, sender=0)
    assert caught.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []
