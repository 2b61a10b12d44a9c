"""GPU memory exported as a dma-buf, for an RDMA adapter to register (GPUDirect RDMA).

Through the CUDA driver API in libcuda.so.1, called with ctypes: every machine with the NVIDIA
driver has that library, so no cuda-python is needed (the GPU machines this project borrows
have none). Three calls for the export: `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_
SUPPORTED)` (1 where the driver can export: the open kernel modules),
`cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` for a
host-page-aligned range inside one allocation, and `cuGetErrorName` for the words of a
failure; and for memory an adapter writes into, the device's GPUDirect RDMA write ordering
(`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`) and `cuFlushGPUDirectRDMAWrites`
where it needs one. Values and signatures are CUDA's `cuda.h` (checked against the copy
Triton ships; the test builds a stand-in libcuda from the same declarations and checks what
it is called with).
"""

from __future__ import annotations

import ctypes
import mmap

from transport.errors import BackendUnavailable

__all__ = ["CudaDriver", "dmabuf_span"]

LIBRARY = "libcuda.so.1"
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS = 117
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING = 118
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST = 1
CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER = 100
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 0x1


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

    def flush_rdma_writes(self, ordinal: int) -> None:
        """Blocks until the adapter's writes into GPU `ordinal`'s memory are visible to its
        kernels (after a message into an exposed region arrived, before a kernel reads it). The
        flush targets the current context, so GPU `ordinal`'s primary context (torch's) is made
        current around it, whatever the calling thread has current."""
        context = self._contexts.get(ordinal)
        if context is None:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            self._call("cuDeviceGet", self.lib.cuDeviceGet, ctypes.byref(device), ordinal)
            self._call("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain, ctypes.byref(context), device)
            self._contexts[ordinal] = context
        self._call("cuCtxPushCurrent", self.lib.cuCtxPushCurrent_v2, context)
        try:
            self._call("cuFlushGPUDirectRDMAWrites", self.lib.cuFlushGPUDirectRDMAWrites,
                       CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)
        finally:
            self._call("cuCtxPopCurrent", self.lib.cuCtxPopCurrent_v2, ctypes.byref(ctypes.c_void_p()))

    def export(self, start: int, span: int) -> int:
        """A dma-buf file descriptor for device memory [start, start + span) (host-page aligned,
        inside one allocation: `dmabuf_span`); the caller closes it."""
        fd = ctypes.c_int(-1)
        self._call("cuMemGetHandleForAddressRange", self.lib.cuMemGetHandleForAddressRange, ctypes.byref(fd),
                   start, span, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        return fd.value
