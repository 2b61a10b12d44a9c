"""GPU memory exported as a dma-buf, for an RDMA adapter to register (GPUDirect RDMA).

Through the CUDA driver API in libcuda.so.1, called with ctypes: every machine with the NVIDIA
driver has that library, so no cuda-python is needed (the GPU machines this project borrows
have none). Three calls for the export: `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_
SUPPORTED)` (1 where the driver can export: the open kernel modules),
`cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` for a
host-page-aligned range inside one allocation, and `cuGetErrorName` for the words of a
failure; and for memory an adapter writes into, the device's GPUDirect RDMA write ordering
(`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`) and `cuFlushGPUDirectRDMAWrites`
where it needs one; and a stream held until words in that memory hold given values
(`cuStreamBatchMemOp` of `CU_STREAM_MEM_OP_WAIT_VALUE_32`, with the FLUSH flag where the device
does not order the adapter's writes and can flush them in the stream:
`CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES`). Values and signatures are CUDA's `cuda.h` (checked against the copy
Triton ships; the test builds a stand-in libcuda from the same declarations and checks what
it is called with).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transport.errors import BackendUnavailable

__all__ = ["CudaDriver", "MarkWait", "dmabuf_span"]

LIBRARY = "libcuda.so.1"
CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES = 98
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS = 117
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING = 118
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST = 1
CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER = 100
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 0x1
CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1
CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WAIT_VALUE_FLUSH = 1 << 30
MAX_BATCH = 255  # wait operations per cuStreamBatchMemOp call (its count "must be less than 256")


class _WaitValueParams(ctypes.Structure):
    """CUstreamBatchMemOpParams as its waitValue member (48 bytes: the union's pad[6]); `value`
    holds the 32-bit value in its low bytes, as the union's value/value64 overlap."""

    _fields_ = [("operation", ctypes.c_uint), ("address", ctypes.c_uint64), ("value", ctypes.c_uint64),
                ("flags", ctypes.c_uint), ("alias", ctypes.c_uint64), ("pad", ctypes.c_uint64)]


# The same layout as a numpy record: a round's waits are filled column by column (32 words in 5.9 us
# on a 2-core AMD EPYC, where setting each structure's fields from Python took 20.1).
_WAIT_VALUE_RECORD = np.dtype({
    "names": [name for name, _ in _WaitValueParams._fields_],
    "formats": [np.uint32 if kind is ctypes.c_uint else np.uint64 for _, kind in _WaitValueParams._fields_],
    "offsets": [getattr(_WaitValueParams, name).offset for name, _ in _WaitValueParams._fields_],
    "itemsize": ctypes.sizeof(_WaitValueParams)})


def wait_value_params(addresses: Sequence[int], values: Sequence[int], flags: int) -> np.ndarray:
    """The waits of wait_values as the driver reads them: one CUstreamBatchMemOpParams
    (WAIT_VALUE_32) per word, each value wrapped to its low 32 bits."""
    params = np.zeros(len(addresses), _WAIT_VALUE_RECORD)
    params["operation"] = CU_STREAM_MEM_OP_WAIT_VALUE_32
    params["address"] = addresses
    params["value"] = np.asarray(values, dtype=np.int64) & 0xFFFFFFFF
    params["flags"] = flags
    return params


@dataclass(frozen=True)
class MarkWait:
    """How a GPU's stream waits for a word an adapter wrote after a payload, so that its later
    work sees the payload: `flags` of the wait (EQ, with FLUSH where the device may reorder the
    adapter's writes and can flush them in the stream) and whether the host must flush them
    first instead (`cuFlushGPUDirectRDMAWrites`, where the stream cannot)."""

    flags: int
    host_flush: bool


def dmabuf_span(addr: int, nbytes: int, page: int = mmap.PAGESIZE) -> tuple[int, int, int]:
    """(start, length, offset): the host-page-aligned range cuMemGetHandleForAddressRange needs
    around [addr, addr + nbytes), and where `addr` lies in it."""
    start = addr - addr % page
    end = -(-(addr + nbytes) // page) * page
    return start, end - start, addr - start


class CudaDriver:
    """The driver calls dma-buf export needs; BackendUnavailable says why one failed."""

    def __init__(self, library: str | None = None) -> None:
        try:
            self.lib = ctypes.CDLL(library or LIBRARY)
        except OSError as exc:
            raise BackendUnavailable(f"no CUDA driver to export GPU memory as a dma-buf ({exc})") from None
        self.lib.cuInit.argtypes = [ctypes.c_uint]
        self.lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.lib.cuMemGetHandleForAddressRange.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                                           ctypes.c_int, ctypes.c_ulonglong]
        self.lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.lib.cuFlushGPUDirectRDMAWrites.argtypes = [ctypes.c_int, ctypes.c_int]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self.lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cuStreamBatchMemOp_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(_WaitValueParams),
                                                   ctypes.c_uint]
        self._contexts: dict[int, ctypes.c_void_p] = {}  # GPU ordinal -> its primary context, retained
        self._call("cuInit", self.lib.cuInit, 0)

    def _call(self, what: str, fn, *args) -> None:
        err = fn(*args)
        if err:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(name))
            raise BackendUnavailable(f"{what} failed ({(name.value or b'CUDA error %d' % err).decode()})")

    def _attribute(self, ordinal: int, attribute: int) -> int:
        device, value = ctypes.c_int(), ctypes.c_int()
        self._call("cuDeviceGet", self.lib.cuDeviceGet, ctypes.byref(device), ordinal)
        self._call("cuDeviceGetAttribute", self.lib.cuDeviceGetAttribute, ctypes.byref(value), attribute, device)
        return value.value

    def check_export(self, ordinal: int) -> None:
        """BackendUnavailable unless GPU `ordinal`'s driver exports memory as dma-bufs."""
        if not self._attribute(ordinal, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED):
            raise BackendUnavailable(f"GPU {ordinal}'s driver does not support dma-buf export "
                                     "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: it needs the open kernel modules)")

    def needs_flush(self, ordinal: int) -> bool:
        """Whether GPU `ordinal`'s kernels may see an adapter's writes into its memory out of
        order unless they are flushed first (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING
        below OWNER: the platform does not order them for the GPU that owns the memory).
        BackendUnavailable where they would need it and the device cannot flush them."""
        if self._attribute(ordinal, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING) >= \
                CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER:
            return False
        if not self._attribute(ordinal, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS) & \
                CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST:
            raise BackendUnavailable(f"GPU {ordinal} neither orders GPUDirect RDMA writes for its own kernels nor can "
                                     "flush them (cuFlushGPUDirectRDMAWrites unsupported)")
        return True

    def mark_wait(self, ordinal: int) -> MarkWait:
        """How GPU `ordinal`'s streams wait on a mark so that the payload written before it is
        visible to their later work: a plain wait where the device orders an adapter's writes
        for its own kernels (Hopper reports so), the wait's FLUSH where it does not and can
        flush in the stream, else a host flush first (BackendUnavailable where it can neither:
        `needs_flush`)."""
        if not self.needs_flush(ordinal):
            return MarkWait(CU_STREAM_WAIT_VALUE_EQ, False)
        if self._attribute(ordinal, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES):
            return MarkWait(CU_STREAM_WAIT_VALUE_EQ | CU_STREAM_WAIT_VALUE_FLUSH, False)
        return MarkWait(CU_STREAM_WAIT_VALUE_EQ, True)

    def wait_values(self, ordinal: int, stream: int, addresses: Sequence[int], values: Sequence[int],
                    flags: int) -> None:
        """Enqueues on GPU `ordinal`'s `stream` (a CUstream handle: torch's `Stream.cuda_stream`)
        a wait until each 32-bit word at device address addresses[i] equals values[i], then
        returns: the host never waits. Every wait in one call per MAX_BATCH, with the GPU's
        primary context current."""
        if len(addresses) != len(values):
            raise ValueError(f"wait_values: {len(addresses)} addresses and {len(values)} values")
        params = wait_value_params(addresses, values, flags)
        first = params.ctypes.data
        with self._primary(ordinal):
            for begin in range(0, len(addresses), MAX_BATCH):
                count = min(MAX_BATCH, len(addresses) - begin)
                self._call("cuStreamBatchMemOp", self.lib.cuStreamBatchMemOp_v2, stream, count,
                           ctypes.cast(first + begin * params.itemsize, ctypes.POINTER(_WaitValueParams)), 0)

    def flush_rdma_writes(self, ordinal: int) -> None:
        """Blocks until the adapter's writes into GPU `ordinal`'s memory are visible to its
        kernels (after a message into an exposed region arrived, before a kernel reads it)."""
        with self._primary(ordinal):  # the flush targets the current context
            self._call("cuFlushGPUDirectRDMAWrites", self.lib.cuFlushGPUDirectRDMAWrites,
                       CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)

    @contextlib.contextmanager
    def _primary(self, ordinal: int):
        """GPU `ordinal`'s primary context (torch's) current around a call, whatever the calling
        thread has current."""
        context = self._contexts.get(ordinal)
        if context is None:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            self._call("cuDeviceGet", self.lib.cuDeviceGet, ctypes.byref(device), ordinal)
            self._call("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain, ctypes.byref(context), device)
            self._contexts[ordinal] = context
        self._call("cuCtxPushCurrent", self.lib.cuCtxPushCurrent_v2, context)
        try:
            yield
        except BaseException:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))  # the call's own error is the one to say
            raise
        self._call("cuCtxPopCurrent", self.lib.cuCtxPopCurrent_v2, ctypes.byref(ctypes.c_void_p()))

    def export(self, start: int, span: int) -> int:
        """A dma-buf file descriptor for device memory [start, start + span) (host-page aligned,
        inside one allocation: `dmabuf_span`); the caller closes it."""
        fd = ctypes.c_int(-1)
        self._call("cuMemGetHandleForAddressRange", self.lib.cuMemGetHandleForAddressRange, ctypes.byref(fd),
                   start, span, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        return fd.value
