// A stand-in for libcuda.so.1 with the driver calls transport/cuda_dmabuf.py makes, for
// the tests: "device memory" is a memfd per allocation at an address this process never maps
// there (so a CPU read of it would crash), and cuMemGetHandleForAddressRange hands out a
// duplicate of the allocation's memfd as its dma-buf, which the software verbs provider maps,
// as an adapter reaches a GPU's memory through the dma-buf the driver exports. Declarations
// and values as CUDA's cuda.h (CUresult is an int; CUdeviceptr 64 bits).

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

namespace {

constexpr int kSuccess = 0, kInvalidValue = 1, kInvalidDevice = 101, kInvalidContext = 201, kNotSupported = 801;
constexpr int kDmaBufSupported = 124, kDmaBufFd = 1;
constexpr int kFlushOptions = 117, kWritesOrdering = 118, kTargetCurrentCtx = 0, kToOwner = 100;
constexpr int kCanFlushRemoteWrites = 98, kWaitValue32 = 1, kWaitEq = 0x1, kWaitFlush = 1 << 30;
constexpr long kPage = 4096;

struct Allocation {
  int fd;
  size_t size;
  uint8_t* here;  // the test's own view, to fill it
};

std::map<uint64_t, Allocation> allocations;
uint64_t next_address = 0x7e0000000000ULL;
int supported = 1;
int writes_ordering = 100;  // CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER, as on Hopper
int flush_options = 1;      // cuFlushGPUDirectRDMAWrites supported
int flushes = 0;
int can_flush_remote_writes = 0;  // CU_STREAM_WAIT_VALUE_FLUSH supported
int waits = 0, waits_met = 0;     // stream waits enqueued; those whose word already held its value
int batches = 0;                  // cuStreamBatchMemOp calls
unsigned last_wait_flags = 0;
int primary = 0;                 // the device's primary context (its address is the handle)
std::vector<void*> current;      // the calling thread's context stack (one thread in the tests)
uint64_t last_start = 0;
size_t last_span = 0;

}  // namespace

extern "C" {

int cuInit(unsigned) { return kSuccess; }
int cuDeviceGet(int* device, int ordinal) {
  if (ordinal != 0) return kInvalidDevice;
  *device = 0;
  return kSuccess;
}
int cuDeviceGetAttribute(int* value, int attribute, int) {
  *value = attribute == kDmaBufSupported   ? supported
           : attribute == kWritesOrdering  ? writes_ordering
           : attribute == kFlushOptions    ? flush_options
           : attribute == kCanFlushRemoteWrites ? can_flush_remote_writes
                                                : 0;
  return kSuccess;
}
// One device, one primary context; the flush needs it current (as the driver's does).
int cuDevicePrimaryCtxRetain(void** context, int device) {
  if (device != 0) return kInvalidDevice;
  *context = &primary;
  return kSuccess;
}
int cuCtxPushCurrent_v2(void* context) {
  current.push_back(context);
  return kSuccess;
}
int cuCtxPopCurrent_v2(void** context) {
  if (current.empty()) return kInvalidContext;
  *context = current.back();
  current.pop_back();
  return kSuccess;
}
int cuFlushGPUDirectRDMAWrites(int target, int scope) {
  if (target != kTargetCurrentCtx || scope != kToOwner) return kInvalidValue;
  if (current.empty() || current.back() != &primary) return kInvalidContext;
  flushes += 1;
  return kSuccess;
}
int cuGetErrorName(int error, const char** name) {
  *name = error == kInvalidValue    ? "CUDA_ERROR_INVALID_VALUE"
          : error == kInvalidDevice ? "CUDA_ERROR_INVALID_DEVICE"
          : error == kNotSupported  ? "CUDA_ERROR_NOT_SUPPORTED"
                                    : "CUDA_ERROR_UNKNOWN";
  return kSuccess;
}
// The range must be page-aligned and, here, start at an allocation's base (the stand-in's
// dma-buf is the allocation's memfd; a real driver exports any page range inside one).
int cuMemGetHandleForAddressRange(void* handle, uint64_t start, size_t span, int type, unsigned long long flags) {
  if (type != kDmaBufFd || flags != 0 || start % kPage || span % kPage) return kInvalidValue;
  auto it = allocations.find(start);
  if (it == allocations.end() || span > it->second.size) return kNotSupported;
  last_start = start;
  last_span = span;
  *static_cast<int*>(handle) = dup(it->second.fd);
  return kSuccess;
}

// CUstreamBatchMemOpParams as its waitValue member (48 bytes). Only 32-bit EQ waits on a word
// of an allocation are taken, with the device's primary context current (the stream's: torch's
// streams live in it); each is counted, and counted as met where the word holds its value now
// (a real stream would wait until it does).
struct WaitValueParams {
  int operation;
  uint64_t address;
  uint64_t value;
  unsigned flags;
  uint64_t alias, pad;
};
static_assert(sizeof(WaitValueParams) == 48, "CUstreamBatchMemOpParams is 48 bytes");

int cuStreamBatchMemOp_v2(void* stream, unsigned count, const WaitValueParams* params, unsigned flags) {
  // Any stream, the NULL one (torch's default stream) included; fewer than 256 operations.
  if (flags != 0 || count == 0 || count >= 256) return kInvalidValue;
  if (current.empty() || current.back() != &primary) return kInvalidContext;  // the stream's context
  for (unsigned i = 0; i < count; ++i) {
    const WaitValueParams& p = params[i];
    if (p.operation != kWaitValue32 || (p.flags & ~kWaitFlush) != kWaitEq || p.address % 4) return kInvalidValue;
    if ((p.flags & kWaitFlush) && !can_flush_remote_writes) return kNotSupported;
    auto it = allocations.upper_bound(p.address);
    if (it == allocations.begin()) return kInvalidValue;
    --it;
    if (p.address + 4 > it->first + it->second.size) return kInvalidValue;
    uint32_t word;
    std::memcpy(&word, it->second.here + (p.address - it->first), 4);
    waits += 1;
    waits_met += word == static_cast<uint32_t>(p.value);
    last_wait_flags = p.flags;
  }
  batches += 1;
  return kSuccess;
}

// -- test hooks ---------------------------------------------------------------------------------
uint64_t stand_in_alloc(size_t size) {
  size = (size + kPage - 1) / kPage * kPage;
  int fd = memfd_create("stand-in-gpu", 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) return 0;
  void* here = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (here == MAP_FAILED) return 0;
  uint64_t address = next_address;
  next_address += 1ULL << 30;
  allocations[address] = {fd, size, static_cast<uint8_t*>(here)};
  return address;
}
int stand_in_write(uint64_t address, const void* data, size_t n) {
  for (auto& [base, a] : allocations)
    if (address >= base && address + n <= base + a.size) {
      std::memcpy(a.here + (address - base), data, n);
      return 0;
    }
  return -1;
}
int stand_in_read(uint64_t address, void* out, size_t n) {
  for (auto& [base, a] : allocations)
    if (address >= base && address + n <= base + a.size) {
      std::memcpy(out, a.here + (address - base), n);
      return 0;
    }
  return -1;
}
void stand_in_set_dmabuf_supported(int on) { supported = on; }
void stand_in_set_rdma_ordering(int ordering, int options) {
  writes_ordering = ordering;
  flush_options = options;
}
int stand_in_flushes() { return flushes; }
void stand_in_set_can_flush_remote_writes(int on) { can_flush_remote_writes = on; }
int stand_in_waits() { return waits; }
int stand_in_waits_met() { return waits_met; }
int stand_in_batches() { return batches; }
unsigned stand_in_last_wait_flags() { return last_wait_flags; }
int stand_in_contexts_current() { return static_cast<int>(current.size()); }
void stand_in_last_export(uint64_t* start, size_t* span) {
  *start = last_start;
  *span = last_span;
}

}  // extern "C"
