"""GPU memory exported as a dma-buf, for an RDMA adapter to register (GPUDirect RDMA).

Through the CUDA driver API in libcuda.so.1, called with ctypes: every machine with the NVIDIA
driver has that library, so no cuda-python is needed (the GPU machines this project borrows
have none). Three calls: `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)` (1 where
the driver can export: the open kernel modules), `cuMemGetHandleForAddressRange(...,
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` for a host-page-aligned range inside one allocation, and
`cuGetErrorName` for the words of a failure. Values and signatures are CUDA's `cuda.h`
(checked against the copy Triton ships; the test builds a stand-in libcuda from the same
declarations and checks what it is called with).
"""

from __future__ import annotations

import ctypes
import mmap

from transport.errors import BackendUnavailable

__all__ = ["CudaDriver", "dmabuf_span"]

LIBRARY = "libcuda.so.1"
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
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
        self._call("cuInit", self.lib.cuInit, 0)

    def _call(self, what: str, fn, *args) -> None:
        err = fn(*args)
        if err:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(name))
            raise BackendUnavailable(f"{what} failed ({(name.value or b'CUDA error %d' % err).decode()})")

    def check_export(self, ordinal: int) -> None:
        """BackendUnavailable unless GPU `ordinal`'s driver exports memory as dma-bufs."""
        device, supported = ctypes.c_int(), ctypes.c_int()
        self._call("cuDeviceGet", self.lib.cuDeviceGet, ctypes.byref(device), ordinal)
        self._call("cuDeviceGetAttribute", self.lib.cuDeviceGetAttribute, ctypes.byref(supported),
                   CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device)
        if not supported.value:
            raise BackendUnavailable(f"GPU {ordinal}'s driver does not support dma-buf export "
                                     "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: it needs the open kernel modules)")

    def export(self, start: int, span: int) -> int:
        """A dma-buf file descriptor for device memory [start, start + span) (host-page aligned,
        inside one allocation: `dmabuf_span`); the caller closes it."""
        fd = ctypes.c_int(-1)
        self._call("cuMemGetHandleForAddressRange", self.lib.cuMemGetHandleForAddressRange, ctypes.byref(fd),
                   start, span, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        return fd.value
