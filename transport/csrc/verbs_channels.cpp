// The core's rdma channels: RC queue pairs driven from C++, with libibverbs loaded at run time
// (verbs_abi.h declares what is used), so a round to N rdma peers is one call and a work
// request costs no Python call.
//
// transport/rdma.py is the reference: the same region layout (scratch bytes, then the slots of
// transport/shm.py's stride), the same work requests (a write-with-immediate of header +
// payload into the same offset of the peer's region, tag = wire.pack_tag(kind, channel, slot)
// in network byte order; a credit is a 1-byte write-with-immediate into the peer's credit
// sink), the same queue-pair attributes (transport/core_rdma.py passes rdma.py's numbers), the
// same rules for what the peer's writes say. The set-up around it (device, port and GID choice,
// the locked-memory check, the queue-pair info exchanged over the control connection) stays in
// Python; the core opens its own device context by name, because pyverbs does not hand out its
// objects' pointers.
//
// Threading: every data-path call comes from the endpoint's one data thread, as for shm and
// tcp; close() may come from another thread and takes the channel's lock, which every
// data-path call also takes (uncontended: ~20 ns), so a queue pair is never destroyed under a
// post or a poll. Waiting: an inbound channel has no socket; its completion queue is attached
// to the domain's completion channel, whose descriptor a Round sleeps on (sleep_fd()) after
// arming the queue (set_asleep(true)) and looking once more, so no completion is missed.
//
// What has run: nothing here has run on an RDMA adapter. The tests drive every path through a
// software provider (tests/transport/verbs/soft_verbs.cpp: the same exported functions and ops
// table, writes copied between registered regions, completions, error states), check the ABI
// against a real verbs.h where one is installed, and load the real libibverbs that pyverbs
// bundles (its symbols resolve; with no device, opening one fails with the library's words).

#include "channels.h"
#include "verbs_abi.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace m2n {

using namespace verbs;

namespace {

// transport/rdma.py's region layout and transport/wire.py's tags.
constexpr size_t kRecvSink = 0, kCreditSource = 8, kCreditSink = 16, kSlotsAt = 64;
constexpr size_t kHeaderInSlot = 64, kPayloadInSlot = 96;  // shm.PAYLOAD_OFFSET - HEADER_BYTES, PAYLOAD_OFFSET
constexpr uint32_t kImmData = 0, kImmCredit = 1;
constexpr int kPollBatch = 16;

inline uint32_t pack_tag(uint32_t kind, uint32_t channel, uint32_t slot) {
  return (kind << 30) | ((channel & 0x3FFF) << 16) | (slot & 0xFFFF);
}

std::string dl_error() {
  const char* e = dlerror();
  return e ? e : "unknown error";
}

}  // namespace

// libibverbs, opened once per path for the life of the process (providers it loads stay).
class VerbsLibrary {
 public:
  explicit VerbsLibrary(const std::string& path) : path_(path) {
    handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) throw std::runtime_error("cannot load " + path + " (" + dl_error() + ")");
    // IBVERBS_1.1 where the library versions its symbols (libibverbs keeps 1.0 compat entries
    // with other layouts); a library without versions (a software provider) by plain name.
    bind(fn_.get_device_list, "ibv_get_device_list", "IBVERBS_1.1");
    bind(fn_.free_device_list, "ibv_free_device_list", "IBVERBS_1.1");
    bind(fn_.get_device_name, "ibv_get_device_name", "IBVERBS_1.1");
    bind(fn_.open_device, "ibv_open_device", "IBVERBS_1.1");
    bind(fn_.close_device, "ibv_close_device", "IBVERBS_1.1");
    bind(fn_.alloc_pd, "ibv_alloc_pd", "IBVERBS_1.1");
    bind(fn_.dealloc_pd, "ibv_dealloc_pd", "IBVERBS_1.1");
    bind(fn_.reg_mr, "ibv_reg_mr", "IBVERBS_1.1");
    bind(fn_.dereg_mr, "ibv_dereg_mr", "IBVERBS_1.1");
    bind(fn_.reg_dmabuf_mr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12", /*required=*/false);
    bind(fn_.create_comp_channel, "ibv_create_comp_channel", "IBVERBS_1.0");
    bind(fn_.destroy_comp_channel, "ibv_destroy_comp_channel", "IBVERBS_1.0");
    bind(fn_.create_cq, "ibv_create_cq", "IBVERBS_1.1");
    bind(fn_.destroy_cq, "ibv_destroy_cq", "IBVERBS_1.1");
    bind(fn_.get_cq_event, "ibv_get_cq_event", "IBVERBS_1.1");
    bind(fn_.ack_cq_events, "ibv_ack_cq_events", "IBVERBS_1.1");
    bind(fn_.create_qp, "ibv_create_qp", "IBVERBS_1.1");
    bind(fn_.modify_qp, "ibv_modify_qp", "IBVERBS_1.1");
    bind(fn_.destroy_qp, "ibv_destroy_qp", "IBVERBS_1.1");
  }
  // Never dlclose'd: providers register themselves with the library once per process.
  const Library& fn() const { return fn_; }
  const std::string& path() const { return path_; }

  // The names of the verbs devices the library sees (empty: none).
  std::vector<std::string> devices() const {
    int n = 0;
    ibv_device** list = fn_.get_device_list(&n);
    std::vector<std::string> names;
    if (!list) return names;
    for (int i = 0; i < n; ++i) names.emplace_back(fn_.get_device_name(list[i]));
    fn_.free_device_list(list);
    return names;
  }

  static std::shared_ptr<VerbsLibrary> load(const std::string& path) {
    static std::mutex lock;
    static std::vector<std::shared_ptr<VerbsLibrary>> loaded;
    std::lock_guard<std::mutex> hold(lock);
    for (auto& lib : loaded)
      if (lib->path_ == path) return lib;
    loaded.push_back(std::make_shared<VerbsLibrary>(path));
    return loaded.back();
  }

 private:
  template <typename F>
  void bind(F& slot, const char* name, const char* version, bool required = true) {
    void* sym = dlvsym(handle_, name, version);
    if (!sym) sym = dlsym(handle_, name);
    if (!sym && required) throw std::runtime_error(path_ + " has no " + name + " (not a libibverbs?)");
    slot = reinterpret_cast<F>(sym);
  }

  std::string path_;
  void* handle_ = nullptr;
  Library fn_{};
};

// One device context and protection domain per endpoint, and the completion channel every one
// of its channels' completion queues reports to (the descriptor a Round sleeps on).
class VerbsDomain {
 public:
  VerbsDomain(const std::string& library, const std::string& device) : lib_(VerbsLibrary::load(library)) {
    const Library& f = lib_->fn();
    int n = 0;
    ibv_device** list = f.get_device_list(&n);
    if (!list) throw std::runtime_error("ibv_get_device_list failed (" + std::string(strerror(errno)) + ")");
    ibv_device* found = nullptr;
    for (int i = 0; i < n && !found; ++i)
      if (device == f.get_device_name(list[i])) found = list[i];
    if (found) ctx_ = f.open_device(found);
    int err = errno;
    f.free_device_list(list);
    if (!found) throw std::runtime_error("no verbs device named " + device + " (" + std::to_string(n) + " seen)");
    if (!ctx_) throw std::runtime_error("cannot open " + device + " (" + strerror(err) + ")");
    pd_ = f.alloc_pd(ctx_);
    if (!pd_) {
      err = errno;
      f.close_device(ctx_);
      throw std::runtime_error("cannot allocate a protection domain on " + device + " (" + strerror(err) + ")");
    }
    events_ = f.create_comp_channel(ctx_);
    if (!events_) {
      err = errno;
      f.dealloc_pd(pd_);
      f.close_device(ctx_);
      throw std::runtime_error("cannot create a completion channel on " + device + " (" + strerror(err) + ")");
    }
    int flags = fcntl(events_->fd, F_GETFL);
    fcntl(events_->fd, F_SETFL, flags | O_NONBLOCK);  // drain_events never blocks
    device_ = device;
  }
  ~VerbsDomain() {
    const Library& f = lib_->fn();
    for (auto& src : sources_) f.dereg_mr(src.mr);
    f.destroy_comp_channel(events_);
    f.dealloc_pd(pd_);
    f.close_device(ctx_);
  }
  VerbsDomain(const VerbsDomain&) = delete;
  VerbsDomain& operator=(const VerbsDomain&) = delete;

  // Takes every completion event waiting on the channel and acknowledges it; a no-op (no
  // system call) unless a queue was armed since the last time, so a Round waking from a sleep
  // over N channels reads the channel once. An event that fires after that read is taken
  // after the next sleep's arming (one early wake at most).
  void drain_events() {
    if (armed_.exchange(0, std::memory_order_acq_rel) == 0) return;
    std::lock_guard<std::mutex> hold(events_lock_);
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    while (lib_->fn().get_cq_event(events_, &cq, &context) == 0) lib_->fn().ack_cq_events(cq, 1);
  }
  void note_armed() { armed_.fetch_add(1, std::memory_order_acq_rel); }

  // Memory payloads will be sent from (Endpoint.register): host memory by address, GPU memory
  // by the dma-buf its driver exports (`iova`: the address SGEs name it by, its device
  // address). Returns a handle for unregister().
  int register_host(uintptr_t address, size_t length) {
    return add_source(reg_host(address, length, IBV_ACCESS_LOCAL_WRITE), address, length, false);
  }
  int register_dmabuf(int fd, uint64_t offset, size_t length, uint64_t iova) {
    return add_source(reg_dmabuf(fd, offset, length, iova, IBV_ACCESS_LOCAL_WRITE), iova, length, true);
  }
  // Memory this endpoint's peers write into (Endpoint.expose: a node's device-slot region):
  // registered for remote writes, and a send source too. Returns (handle, rkey).
  py::tuple expose_host(uintptr_t address, size_t length) {
    ibv_mr* mr = reg_host(address, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    return py::make_tuple(add_source(mr, address, length, false), mr->rkey);
  }
  py::tuple expose_dmabuf(int fd, uint64_t offset, size_t length, uint64_t iova) {
    ibv_mr* mr = reg_dmabuf(fd, offset, length, iova, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    return py::make_tuple(add_source(mr, iova, length, true), mr->rkey);
  }
  void unregister(int handle) {
    std::lock_guard<std::mutex> hold(sources_lock_);
    for (auto it = sources_.begin(); it != sources_.end(); ++it)
      if (it->handle == handle) {
        lib_->fn().dereg_mr(it->mr);
        sources_.erase(it);
        return;
      }
    throw std::out_of_range("no registered memory " + std::to_string(handle));
  }
  // The local key of a registered region holding [p, p + n), or false; *device: GPU memory.
  bool find_source(const uint8_t* p, size_t n, uint32_t* lkey, bool* device) {
    uint64_t a = reinterpret_cast<uint64_t>(p);
    std::lock_guard<std::mutex> hold(sources_lock_);
    for (auto& src : sources_)
      if (a >= src.start && a + n <= src.start + src.length) {
        *lkey = src.mr->lkey;
        *device = src.device;
        return true;
      }
    return false;
  }
  size_t sources() {
    std::lock_guard<std::mutex> hold(sources_lock_);
    return sources_.size();
  }

  const Library& fn() const { return lib_->fn(); }
  ibv_context* context() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  ibv_comp_channel* events() const { return events_; }
  int event_fd() const { return events_->fd; }
  const std::string& device() const { return device_; }
  const std::string& library() const { return lib_->path(); }

 private:
  std::shared_ptr<VerbsLibrary> lib_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* events_ = nullptr;
  std::mutex events_lock_;
  std::atomic<int> armed_{0};  // queues armed since the last drain
  std::string device_;

  struct Source {
    int handle;
    ibv_mr* mr;
    uint64_t start;
    size_t length;
    bool device;
  };
  int add_source(ibv_mr* mr, uint64_t start, size_t length, bool device) {
    std::lock_guard<std::mutex> hold(sources_lock_);
    sources_.push_back({next_handle_, mr, start, length, device});
    return next_handle_++;
  }
  ibv_mr* reg_host(uintptr_t address, size_t length, int access) {
    ibv_mr* mr = lib_->fn().reg_mr(pd_, reinterpret_cast<void*>(address), length, access);
    if (!mr) throw std::runtime_error("cannot register " + std::to_string(length) + " bytes of host memory on " +
                                      device_ + " (" + strerror(errno) + ")");
    return mr;
  }
  ibv_mr* reg_dmabuf(int fd, uint64_t offset, size_t length, uint64_t iova, int access) {
    if (!lib_->fn().reg_dmabuf_mr)
      throw std::runtime_error(lib_->path() + " has no ibv_reg_dmabuf_mr (rdma-core 34 or later registers dma-bufs)");
    ibv_mr* mr = lib_->fn().reg_dmabuf_mr(pd_, offset, length, iova, fd, access);
    if (!mr) {
      int err = errno;
      throw std::runtime_error("cannot register a " + std::to_string(length) + "-byte dma-buf on " + device_ + " (" +
                               strerror(err) + (err == EOPNOTSUPP ? ": the RDMA driver cannot map dma-bufs" : "") +
                               ")");
    }
    return mr;
  }
  std::mutex sources_lock_;
  std::vector<Source> sources_;
  int next_handle_ = 1;
};

// Where the peer's queue pair is and how to reach it (transport/core_rdma.py fills it from the
// peer's wire.QPInfo and this side's port choice, with transport/rdma.py's attribute values).
struct Route {
  uint32_t qp_num, psn;  // the peer's
  uint64_t addr;         // the peer's region
  uint32_t rkey;
  int path_mtu;  // enum ibv_mtu
  bool is_global;
  std::string dgid;  // 16 raw bytes (RoCE)
  uint16_t dlid;     // InfiniBand
  uint8_t sgid_index, hop_limit, traffic_class, service_level, port;
  uint32_t sq_psn;  // ours
  uint8_t min_rnr_timer, timeout, retry_cnt, rnr_retry, max_rd_atomic;
};

// A channel's queue pair: its registered region (a buffer the Python side mapped, held through
// a buffer export), completion queue and RC queue pair, and the posts and polls on them.
class VerbsQueuePair {
 public:
  VerbsQueuePair(std::shared_ptr<VerbsDomain> domain, py::buffer region, uint8_t port, uint32_t depth)
      : domain_(std::move(domain)), depth_(depth) {
    info_ = std::make_unique<py::buffer_info>(region.request(true));
    base_ = static_cast<uint8_t*>(info_->ptr);
    bytes_ = static_cast<size_t>(info_->size * info_->itemsize);
    if (bytes_ < kSlotsAt) throw std::invalid_argument("an rdma region holds at least its 64 scratch bytes");
    const Library& f = domain_->fn();
    const std::string& dev = domain_->device();
    mr_ = f.reg_mr(domain_->pd(), base_, bytes_, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!mr_) fail_setup("cannot register " + std::to_string(bytes_) + " bytes on " + dev);
    cq_ = f.create_cq(domain_->context(), static_cast<int>(2 * depth), nullptr, domain_->events(), 0);
    if (!cq_) fail_setup("cannot create a completion queue on " + dev);
    ibv_qp_init_attr init{};
    init.send_cq = init.recv_cq = cq_;
    init.cap.max_send_wr = init.cap.max_recv_wr = depth;
    init.cap.max_send_sge = init.cap.max_recv_sge = 1;
    init.qp_type = IBV_QPT_RC;
    qp_ = f.create_qp(domain_->pd(), &init);
    if (!qp_) fail_setup("cannot create a queue pair on " + dev);
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = port;
    attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    if (int err = f.modify_qp(qp_, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
      errno = err;
      fail_setup("cannot move the queue pair to INIT on " + dev);
    }
    recv_sge_ = {reinterpret_cast<uint64_t>(base_ + kRecvSink), 1, mr_->lkey};
    recv_wr_.sg_list = &recv_sge_;
    recv_wr_.num_sge = 1;
    for (uint32_t i = 0; i < depth; ++i)
      if (int err = post_recv()) {
        errno = err;
        fail_setup("cannot post the receives on " + dev);
      }
  }
  // The region's buffer export goes only here, with the object (whose last owner is a Python
  // object, so the GIL is held): a Round may still be copying out of a payload when another
  // thread closes the channel, and the mapping must outlive that copy, as shm's Mapping does.
  ~VerbsQueuePair() {
    destroy();
    py::gil_scoped_acquire gil;
    info_.reset();
  }

  // RESET..INIT -> RTR -> RTS towards the peer (rdma.py's rtr_attr and rts_attr).
  void connect(const Route& r) {
    std::lock_guard<std::mutex> hold(lock_);
    if (!qp_) throw std::runtime_error("queue pair closed");
    const Library& f = domain_->fn();
    ibv_qp_attr rtr{};
    rtr.qp_state = IBV_QPS_RTR;
    rtr.path_mtu = r.path_mtu;
    rtr.dest_qp_num = r.qp_num;
    rtr.rq_psn = r.psn;
    rtr.max_dest_rd_atomic = r.max_rd_atomic;
    rtr.min_rnr_timer = r.min_rnr_timer;
    rtr.ah_attr.port_num = r.port;
    rtr.ah_attr.is_global = r.is_global;
    rtr.ah_attr.dlid = r.dlid;
    rtr.ah_attr.sl = r.service_level;
    if (r.is_global) {
      if (r.dgid.size() != 16) throw std::invalid_argument("a GID is 16 bytes");
      std::memcpy(rtr.ah_attr.grh.dgid.raw, r.dgid.data(), 16);
      rtr.ah_attr.grh.sgid_index = r.sgid_index;
      rtr.ah_attr.grh.hop_limit = r.hop_limit;
      rtr.ah_attr.grh.traffic_class = r.traffic_class;
    }
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    if (int err = f.modify_qp(qp_, &rtr, mask))
      throw std::runtime_error("cannot move the queue pair to RTR (" + std::string(strerror(err)) + ")");
    ibv_qp_attr rts{};
    rts.qp_state = IBV_QPS_RTS;
    rts.sq_psn = r.sq_psn;
    rts.timeout = r.timeout;
    rts.retry_cnt = r.retry_cnt;
    rts.rnr_retry = r.rnr_retry;
    rts.max_rd_atomic = r.max_rd_atomic;
    mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
           IBV_QP_MAX_QP_RD_ATOMIC;
    if (int err = f.modify_qp(qp_, &rts, mask))
      throw std::runtime_error("cannot move the queue pair to RTS (" + std::string(strerror(err)) + ")");
    remote_addr_ = r.addr;
    remote_rkey_ = r.rkey;
    connected_ = true;
  }

  // Whether the send queue has room for `wrs` more work requests now: each signaled
  // completion polled frees the requests up to it (its wr_id says how many), so a full queue
  // is a message left pending, not a failure.
  bool room_locked(uint32_t wrs) const { return sends_out_ + wrs <= depth_; }

  // Bytes [offset, offset + n) of this region to the same offset of the peer's, with `tag`
  // (solicited: a sleeping receiver wakes for it). Caller holds lock_ and checked room_locked.
  // 0, or the error ibv_post_send returned.
  int write_locked(size_t offset, size_t n, uint32_t tag) {
    return post_write(base_ + offset, n, remote_addr_ + offset, tag, IBV_SEND_SOLICITED);
  }
  // A message whose payload lies in registered memory (`lkey`): the adapter reads the payload
  // from there into the peer's slot, then the header from this region's slot with `tag`: two
  // work requests chained in one post, on one queue pair, so RC places the payload before the
  // peer sees the header's completion. Caller holds lock_.
  int write_direct_locked(size_t header_offset, const uint8_t* payload, size_t n, uint32_t lkey, uint32_t tag) {
    return write_chained_locked(header_offset, payload, n, lkey, remote_addr_ + header_offset + sizeof(WireHeader),
                                remote_rkey_, tag);
  }
  // The same two requests with the payload written to (`remote`, `rkey`): a region the peer
  // exposed (its device slots), not its slot; with a mark (`mark_offset` of this region holds
  // it: 4 bytes), a third between them writes it kMarkLead before `remote`, so RC places it
  // after the payload and before the header. Caller holds lock_ and checked room_locked.
  int write_chained_locked(size_t header_offset, const uint8_t* payload, size_t n, uint32_t lkey, uint64_t remote,
                           uint32_t rkey, uint32_t tag, const size_t* mark_offset = nullptr) {
    ibv_sge body{reinterpret_cast<uint64_t>(payload), static_cast<uint32_t>(n), lkey};
    ibv_sge mark{mark_offset ? reinterpret_cast<uint64_t>(base_ + *mark_offset) : 0, 4, mr_->lkey};
    ibv_sge head{reinterpret_cast<uint64_t>(base_ + header_offset), static_cast<uint32_t>(sizeof(WireHeader)),
                 mr_->lkey};
    ibv_send_wr wr[3]{};
    uint32_t count = mark_offset ? 3 : 2;
    wr[0].sg_list = &body;
    wr[0].opcode = IBV_WR_RDMA_WRITE;  // unsignaled: the header's completion covers it
    wr[0].wr.rdma.remote_addr = remote;
    wr[0].wr.rdma.rkey = rkey;
    if (mark_offset) {
      wr[1].sg_list = &mark;
      wr[1].opcode = IBV_WR_RDMA_WRITE;
      wr[1].wr.rdma.remote_addr = remote - kMarkLead;
      wr[1].wr.rdma.rkey = rkey;
    }
    ibv_send_wr& last = wr[count - 1];
    last.wr_id = count;  // the work requests this completion frees
    last.sg_list = &head;
    last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    last.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
    last.imm_data = htonl(tag);
    last.wr.rdma.remote_addr = remote_addr_ + header_offset;
    last.wr.rdma.rkey = remote_rkey_;
    for (uint32_t i = 0; i < count; ++i) {
      wr[i].num_sge = 1;
      wr[i].next = i + 1 < count ? &wr[i + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    int err = qp_->context->ops.post_send(qp_, wr, &bad);
    if (!err) sends_out_ += count;
    return err;
  }
  // The 1-byte credit write into the peer's credit sink (not solicited: a sender waiting for
  // its slot polls). Caller holds lock_ and checked room_locked.
  int credit_locked(uint32_t slot) {
    return post_write(base_ + kCreditSource, 1, remote_addr_ + kCreditSink, pack_tag(kImmCredit, 0, slot), 0);
  }

  // Polls the completion queue until empty: every received immediate (host order) to
  // `on_tag`, which returns false to stop (a rule broken); a failed completion stops with
  // *status set. Receives are reposted as they complete. Caller holds lock_.
  template <typename OnTag>
  bool poll_locked(OnTag on_tag, int* status) {
    ibv_wc wc[kPollBatch];
    for (;;) {
      int n = qp_->context->ops.poll_cq(cq_, kPollBatch, wc);
      if (n < 0) {
        *status = -1;
        return false;
      }
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          *status = wc[i].status;
          return false;
        }
        if (wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM) {  // a send's completion: its requests are done
          sends_out_ -= static_cast<uint32_t>(wc[i].wr_id);
          continue;
        }
        if (post_recv()) {
          *status = -1;
          return false;
        }
        if (!on_tag(ntohl(wc[i].imm_data))) return false;
      }
      if (n < kPollBatch) return true;
    }
  }

  // Asks for a completion event on the next solicited completion (a message's header; an
  // error completion too), before a Round sleeps: credits coming back do not wake it.
  void arm_locked() {
    domain_->note_armed();
    qp_->context->ops.req_notify_cq(cq_, 1);
  }

  void destroy() {
    std::lock_guard<std::mutex> hold(lock_);
    destroy_locked();
  }
  // Read without the lock (a Round's checks); set under it, before anything is destroyed.
  bool open() const { return !closed_.load(std::memory_order_acquire); }

  std::mutex lock_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  uint32_t qp_num() const { return qp_ ? qp_->qp_num : 0; }
  uint32_t rkey() const { return mr_ ? mr_->rkey : 0; }
  uint32_t lkey() const { return mr_ ? mr_->lkey : 0; }  // under lock_, while open()
  uint64_t address() const { return reinterpret_cast<uint64_t>(base_); }
  bool connected() const { return connected_; }
  const std::shared_ptr<VerbsDomain>& domain() const { return domain_; }  // per message: no refcount traffic

 private:
  // ibv_post_send and ibv_post_recv return their error (mlx5 leaves errno alone).
  int post_write(uint8_t* local, size_t n, uint64_t remote, uint32_t tag, unsigned flags) {
    ibv_sge sge{reinterpret_cast<uint64_t>(local), static_cast<uint32_t>(n), mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = 1;  // the work requests this completion frees
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED | flags;
    wr.imm_data = htonl(tag);
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = remote_rkey_;
    ibv_send_wr* bad = nullptr;
    int err = qp_->context->ops.post_send(qp_, &wr, &bad);
    if (!err) sends_out_ += 1;
    return err;
  }
  int post_recv() {
    ibv_recv_wr* bad = nullptr;
    return qp_->context->ops.post_recv(qp_, &recv_wr_, &bad);
  }
  [[noreturn]] void fail_setup(const std::string& what) {
    int err = errno;
    destroy_locked();
    throw std::runtime_error(what + " (" + strerror(err) + ")");
  }
  // The queue pair before what it uses; the region stays mapped (its export is the object's).
  // destroy_cq waits only for events already read to be acknowledged, and drain_events
  // acknowledges each as it reads it; unread events of a destroyed queue are dropped.
  void destroy_locked() {
    closed_.store(true, std::memory_order_release);
    const Library& f = domain_->fn();
    if (qp_) f.destroy_qp(qp_);
    if (cq_) f.destroy_cq(cq_);
    if (mr_) f.dereg_mr(mr_);  // the adapter stops using the pages
    qp_ = nullptr;
    cq_ = nullptr;
    mr_ = nullptr;
  }

  std::shared_ptr<VerbsDomain> domain_;
  std::unique_ptr<py::buffer_info> info_;
  uint32_t depth_;
  uint32_t sends_out_ = 0;  // send work requests posted whose completion has not been polled
  std::atomic<bool> closed_{false};
  ibv_mr* mr_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_sge recv_sge_{};
  ibv_recv_wr recv_wr_{};
  uint64_t remote_addr_ = 0;
  uint32_t remote_rkey_ = 0;
  bool connected_ = false;
};

// this endpoint -> peer: stages a message in its registered slot, then writes it across.
class VerbsOutChannel : public Outbound {
 public:
  VerbsOutChannel(std::shared_ptr<VerbsQueuePair> qp, size_t slot_bytes, size_t stride, uint32_t num_slots,
                  uint16_t rank, uint16_t channel_id)
      : qp_(std::move(qp)), slot_bytes_(slot_bytes), stride_(stride), num_slots_(num_slots), rank_(rank),
        channel_id_(channel_id), busy_(num_slots, 0) {
    if (kSlotsAt + stride * num_slots > qp_->bytes_) throw std::invalid_argument("the region is too small");
  }

  bool write(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
             const uint8_t* payload, size_t n) override {
    return send(step, layer, micro_batch, flags, token_count, payload, n, nullptr, 0);
  }
  // A message whose payload goes to `offset` of the region the peer exposed (aim()): the
  // payload write, then the header (byte length 0: the bytes are not in the slot) into the
  // slot as write() puts it, chained in one post, so the peer sees the header only once the
  // payload is placed.
  // A mark other than 0 follows a payload of bytes (chained: payload, mark, header), from this
  // side's slot, which stays untouched until the peer's credit frees it.
  bool write_into(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
                  const uint8_t* payload, size_t n, uint64_t offset, uint32_t mark) override {
    return send(step, layer, micro_batch, flags, token_count, payload, n, &offset, mark);
  }
  bool can_write_into(uint64_t offset, size_t n) const override { return fits_region(offset, n); }
  // The region the peer exposed for this endpoint's writes (its address as its adapter names
  // it: a device address for GPU memory), or none (rkey 0).
  void aim(uint64_t address, uint64_t length, uint32_t rkey) {
    std::lock_guard<std::mutex> hold(qp_->lock_);
    region_addr_ = address;
    region_bytes_ = length;
    region_rkey_ = rkey;
  }
  void after_round(uint16_t) override {}  // the post is the send: nothing to ring
  // GPU memory only from a registered dma-buf (the adapter reads it; this CPU never does).
  bool can_send_from(const uint8_t* p, size_t n, bool device) const override {
    if (!device || n == 0) return true;
    uint32_t lkey = 0;
    bool is_device = false;
    return qp_->domain()->find_source(p, n, &lkey, &is_device) && is_device;
  }
  size_t slot_bytes() const override { return slot_bytes_; }
  bool is_closed() const override { return !qp_->open(); }
  bool failed() const override { return failure_ != kNone; }

  // Slots written whose credit has not come back, after taking the credits waiting.
  uint32_t unreleased() {
    std::lock_guard<std::mutex> hold(qp_->lock_);
    if (qp_->open() && !failure_) take_credits_locked();
    uint32_t n = 0;
    for (auto b : busy_) n += b;
    return n;
  }
  std::vector<bool> busy() const { return std::vector<bool>(busy_.begin(), busy_.end()); }
  py::tuple failure() const { return py::make_tuple(failure_, fa_, fb_); }
  uint32_t seq() const { return seq_; }
  void close() { qp_->destroy(); }

 private:
  // One message, stamped with the next seq: its payload into the peer's slot (`offset` null)
  // or at *offset of the region the peer exposed. A payload in registered memory is read by
  // the adapter where it lies (a chained post: payload, then header); any other is copied into
  // this side's slot first and goes with the header in one write, or, for a region, chained.
  bool send(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
            const uint8_t* payload, size_t n, const uint64_t* offset, uint32_t mark) {
    std::lock_guard<std::mutex> hold(qp_->lock_);
    if (!qp_->open()) throw std::runtime_error("channel closed");
    if (n > slot_bytes_) throw std::length_error("payload larger than the peer's slot");
    if (offset && !fits_region(*offset, n)) throw std::out_of_range("a write past the region the peer exposed");
    bool marked = offset && n && mark;
    if (marked && *offset < kMarkLead) throw std::out_of_range("a region write's mark would lie before the region");
    if (failure_ || !take_credits_locked()) return false;
    uint32_t slot = micro_batch % num_slots_;
    uint32_t lkey = 0;
    bool device = false;
    bool registered = n && qp_->domain()->find_source(payload, n, &lkey, &device);
    bool chained = registered || (offset && n);
    if (busy_[slot] || !qp_->room_locked(chained ? 2 + marked : 1)) return false;  // pending: a later poll frees it
    size_t at = kSlotsAt + slot * stride_ + kHeaderInSlot;  // header, then payload
    WireHeader h{kMagic, step, layer, micro_batch, rank_, flags, token_count, seq_, offset ? 0 : n};
    size_t mark_at = kSlotsAt + slot * stride_;  // the slot's first bytes: the header starts kHeaderInSlot on
    if (marked) std::memcpy(qp_->base_ + mark_at, &mark, sizeof mark);
    std::memcpy(qp_->base_ + at, &h, sizeof h);
    if (n && !registered) {  // staged: the adapter reads it from this side's slot
      std::memcpy(qp_->base_ + at + sizeof h, payload, n);
      payload = qp_->base_ + at + sizeof h;
      lkey = qp_->lkey();
    }
    uint32_t tag = pack_tag(kImmData, channel_id_, slot);
    int err = !chained ? qp_->write_locked(at, sizeof h + n, tag)  // n is 0 for a region's
              : offset ? qp_->write_chained_locked(at, payload, n, lkey, region_addr_ + *offset, region_rkey_, tag,
                                                   marked ? &mark_at : nullptr)
                       : qp_->write_direct_locked(at, payload, n, lkey, tag);
    if (err) {
      record(kPostFailed, static_cast<uint64_t>(err), 0);
      return false;
    }
    busy_[slot] = 1;
    seq_ += 1;
    return true;
  }
  bool take_credits_locked() {
    int status = 0;
    bool ok = qp_->poll_locked(
        [&](uint32_t tag) {
          uint32_t kind = tag >> 30, slot = tag & 0xFFFF;
          if (kind != kImmCredit || slot >= num_slots_ || !busy_[slot]) {
            record(kBadImmediate, tag, 1);
            return false;
          }
          busy_[slot] = 0;
          return true;
        },
        &status);
    if (!ok && !failure_) record(kCompletionFailed, static_cast<uint64_t>(status), 0);
    return ok;
  }
  void record(int code, uint64_t a, uint64_t b) {
    if (failure_) return;
    failure_ = code;
    fa_ = a;
    fb_ = b;
  }

 public:
  static constexpr int kCompletionFailed = 11, kBadImmediate = 12, kPostFailed = 13;

 private:
  std::shared_ptr<VerbsQueuePair> qp_;
  size_t slot_bytes_, stride_;
  uint32_t num_slots_;
  uint16_t rank_, channel_id_;
  std::vector<uint8_t> busy_;
  uint32_t seq_ = 0;
  int failure_ = kNone;
  uint64_t fa_ = 0, fb_ = 0;
  uint64_t region_addr_ = 0, region_bytes_ = 0;  // aim()'s
  uint32_t region_rkey_ = 0;
  bool fits_region(uint64_t offset, size_t n) const {
    return region_rkey_ && offset <= region_bytes_ && n <= region_bytes_ - offset;
  }
};

// peer -> this endpoint: the peer writes into this side's registered slots; a receive
// completion says which, and the header there is checked before anything is handed out.
class VerbsInChannel : public SlottedInbound {
 public:
  VerbsInChannel(std::shared_ptr<VerbsQueuePair> qp, size_t slot_bytes, size_t stride, uint32_t num_slots,
                 uint16_t sender)
      : SlottedInbound(num_slots, sender), qp_(std::move(qp)), slot_bytes_(slot_bytes), stride_(stride) {
    if (kSlotsAt + stride * num_slots > qp_->bytes_) throw std::invalid_argument("the region is too small");
  }

  bool admit() override {
    if (violation_) return false;
    std::lock_guard<std::mutex> hold(qp_->lock_);
    if (!qp_->open()) return fail(kClosed, 0, 0);
    int status = 0;
    bool ok = qp_->poll_locked([&](uint32_t tag) { return admit_tag(tag); }, &status);
    if (!ok && !violation_) fail(VerbsOutChannel::kCompletionFailed, static_cast<uint64_t>(status), 0);
    return ok && post_credits_locked();
  }
  const uint8_t* payload(uint32_t slot) const override {
    return qp_->base_ + kSlotsAt + slot * stride_ + kPayloadInSlot;
  }
  // Frees the slot and gives the peer its credit: now, or, while the send queue is full, at
  // the next admit (after its poll freed room).
  bool release_slot(uint32_t slot) override {
    if (slot >= num_slots_ || state_[slot] != kHanded) return true;  // not held: nothing to free
    state_[slot] = kEmpty;
    std::lock_guard<std::mutex> hold(qp_->lock_);
    if (!qp_->open()) return true;
    credits_due_.push_back(slot);
    post_credits_locked();
    return true;
  }
  // Before a Round sleeps: ask for an event on the next completion (the Round looks once more
  // after this, so one that landed meanwhile is not missed); after: take the events.
  void set_asleep(bool asleep) override {
    if (asleep) {
      std::lock_guard<std::mutex> hold(qp_->lock_);
      if (qp_->open()) qp_->arm_locked();
    } else {
      qp_->domain()->drain_events();
    }
  }
  int sleep_fd() const override { return qp_->open() ? qp_->domain()->event_fd() : -1; }
  bool is_closed() const override { return !qp_->open(); }
  void close() { qp_->destroy(); }

 private:
  bool admit_tag(uint32_t tag) {
    uint32_t kind = tag >> 30, slot = tag & 0xFFFF;
    if (kind != kImmData || slot >= num_slots_) return fail(VerbsOutChannel::kBadImmediate, tag, 0);
    WireHeader h;
    std::memcpy(&h, qp_->base_ + kSlotsAt + slot * stride_ + kHeaderInSlot, sizeof h);
    if (h.micro_batch % num_slots_ != slot) return fail(kWrongSlot, slot, 0, &h);
    if (h.magic != kMagic || h.sender != sender_ || h.byte_length > slot_bytes_ || h.seq != next_seq_)
      return fail(kBadHeader, next_seq_, 0, &h);
    if (state_[slot] != kEmpty) return fail(kHeldSlot, slot, held_seq_[slot], &h);
    headers_[slot] = h;
    held_seq_[slot] = h.seq;
    state_[slot] = kQueued;
    ++queued_;
    ++next_seq_;
    return true;
  }

  bool post_credits_locked() {
    size_t sent = 0;
    for (; sent < credits_due_.size() && qp_->room_locked(1); ++sent)
      if (int err = qp_->credit_locked(credits_due_[sent])) {
        credits_due_.clear();
        return fail(VerbsOutChannel::kPostFailed, static_cast<uint64_t>(err), 0);
      }
    credits_due_.erase(credits_due_.begin(), credits_due_.begin() + static_cast<std::ptrdiff_t>(sent));
    return true;
  }

  std::shared_ptr<VerbsQueuePair> qp_;
  size_t slot_bytes_, stride_;
  std::vector<uint32_t> credits_due_;  // released slots whose credit waits for send-queue room
};

void register_verbs(py::module_& m) {
  m.def("verbs_devices", [](const std::string& library) { return VerbsLibrary::load(library)->devices(); },
        "the verbs devices a libibverbs (by path) sees");
  m.attr("COMPLETION_FAILED") = VerbsOutChannel::kCompletionFailed;
  m.attr("BAD_IMMEDIATE") = VerbsOutChannel::kBadImmediate;
  m.attr("POST_FAILED") = VerbsOutChannel::kPostFailed;

  py::class_<VerbsDomain, std::shared_ptr<VerbsDomain>>(m, "VerbsDomain")
      .def(py::init<const std::string&, const std::string&>(), py::arg("library"), py::arg("device"))
      .def_property_readonly("device", &VerbsDomain::device)
      .def_property_readonly("library", &VerbsDomain::library)
      .def_property_readonly("event_fd", &VerbsDomain::event_fd)
      .def("register_host", &VerbsDomain::register_host, py::arg("address"), py::arg("length"))
      .def("register_dmabuf", &VerbsDomain::register_dmabuf, py::arg("fd"), py::arg("offset"), py::arg("length"),
           py::arg("iova"))
      .def("expose_host", &VerbsDomain::expose_host, py::arg("address"), py::arg("length"))
      .def("expose_dmabuf", &VerbsDomain::expose_dmabuf, py::arg("fd"), py::arg("offset"), py::arg("length"),
           py::arg("iova"))
      .def("unregister", &VerbsDomain::unregister)
      .def_property_readonly("sources", &VerbsDomain::sources)
      .def_property_readonly("dmabuf_supported", [](VerbsDomain& d) { return d.fn().reg_dmabuf_mr != nullptr; });

  py::class_<Route>(m, "VerbsRoute")
      .def(py::init([](uint32_t qp_num, uint32_t psn, uint64_t addr, uint32_t rkey, int path_mtu, bool is_global,
                       py::bytes dgid, uint16_t dlid, uint8_t sgid_index, uint8_t hop_limit, uint8_t traffic_class,
                       uint8_t service_level, uint8_t port,
                       uint32_t sq_psn, uint8_t min_rnr_timer, uint8_t timeout, uint8_t retry_cnt, uint8_t rnr_retry,
                       uint8_t max_rd_atomic) {
             return Route{qp_num,        psn,         addr,       rkey,          path_mtu,  is_global,
                          std::string(dgid), dlid,   sgid_index, hop_limit,     traffic_class, service_level,
                          port,          sq_psn,      min_rnr_timer, timeout, retry_cnt, rnr_retry,
                          max_rd_atomic};
           }),
           py::kw_only(), py::arg("qp_num"), py::arg("psn"), py::arg("addr"), py::arg("rkey"), py::arg("path_mtu"),
           py::arg("is_global"), py::arg("dgid"), py::arg("dlid"), py::arg("sgid_index"), py::arg("hop_limit"),
           py::arg("traffic_class"), py::arg("service_level"), py::arg("port"), py::arg("sq_psn"), py::arg("min_rnr_timer"), py::arg("timeout"), py::arg("retry_cnt"),
           py::arg("rnr_retry"), py::arg("max_rd_atomic"));

  py::class_<VerbsQueuePair, std::shared_ptr<VerbsQueuePair>>(m, "VerbsQueuePair")
      .def(py::init<std::shared_ptr<VerbsDomain>, py::buffer, uint8_t, uint32_t>(), py::arg("domain"),
           py::arg("region"), py::arg("port"), py::arg("depth"))
      .def("connect", &VerbsQueuePair::connect)
      .def_property_readonly("qp_num", &VerbsQueuePair::qp_num)
      .def_property_readonly("rkey", &VerbsQueuePair::rkey)
      .def_property_readonly("address", &VerbsQueuePair::address)
      .def_property_readonly("connected", &VerbsQueuePair::connected)
      .def("close", &VerbsQueuePair::destroy);

  py::class_<VerbsOutChannel, Outbound>(m, "VerbsOutChannel")
      .def(py::init<std::shared_ptr<VerbsQueuePair>, size_t, size_t, uint32_t, uint16_t, uint16_t>())
      .def("try_send", &Outbound::try_send)
      .def("aim", &VerbsOutChannel::aim, py::arg("address"), py::arg("length"), py::arg("rkey"))
      .def("unreleased", &VerbsOutChannel::unreleased)
      .def_property_readonly("busy", &VerbsOutChannel::busy)
      .def("failure", &VerbsOutChannel::failure)
      .def_property_readonly("seq", &VerbsOutChannel::seq)
      .def("close", &VerbsOutChannel::close);

  py::class_<VerbsInChannel, Inbound> in_channel(m, "VerbsInChannel");
  bind_inbound(in_channel)
      .def(py::init<std::shared_ptr<VerbsQueuePair>, size_t, size_t, uint32_t, uint16_t>())
      .def("set_asleep", &VerbsInChannel::set_asleep);
}

}  // namespace m2n
