// A software verbs provider for the tests: a shared library with libibverbs' exported entry
// points and ops table (transport/csrc/verbs_abi.h), one device "soft0", and RC queue pairs
// that live in this process. An RDMA write-with-immediate checks the local key and range, the
// peer's state, remote key and range, takes one of the peer's posted receives, copies the bytes
// and completes the receive with the immediate, as an adapter would; what an adapter reports
// when it cannot (retries exhausted towards a queue pair in error, a remote access error, no
// receive posted) comes back as that completion status. Completion events go to a completion
// channel (a pipe) for an armed queue. Test hooks (extern "C", called through ctypes) break a
// queue pair as a dead peer's would be and read back the attributes it was given.
//
// Not a model of timing, ordering across queue pairs, or of memory registration's pinning.

#include "verbs_abi.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>

using namespace m2n::verbs;

namespace {

struct SoftCQ;

struct SoftChannel {
  ibv_comp_channel base;
  int write_fd;
  std::deque<ibv_cq*> events;
};

struct SoftCQ {
  ibv_cq base;
  std::deque<ibv_wc> entries;
  bool armed = false;
  bool solicited_only = false;  // armed for solicited completions (and errors) only
};

struct SoftQP {
  ibv_qp base;
  ibv_qp_attr attr{};  // what modify_qp was given, field by field as the masks said
  int recvs = 0;       // posted, not yet consumed
  std::deque<uint64_t> recv_ids;
};

struct SoftMR {
  ibv_mr base;
  int access = 0;
  uint8_t* host = nullptr;  // where this process reaches byte 0 of the region
  bool mapped = false;      // a dma-buf's own mapping (unmapped at deregistration)
  uint64_t lead = 0;        // bytes of the mapping before `host` (whole pages are mapped)
};

// The address this process reaches `addr` (named by the region's iova) at.
uint8_t* reach(const SoftMR* mr, uint64_t addr) {
  return mr->host + (addr - reinterpret_cast<uint64_t>(mr->base.addr));
}

std::mutex lock;
std::map<uint32_t, SoftQP*> qps;
std::map<uint32_t, SoftMR*> mrs_by_key;   // by lkey
std::map<uint32_t, SoftMR*> mrs_by_rkey;  // by rkey: a different number, as adapters hand out
uint32_t next_qpn = 0x100, next_key = 0x1000;
constexpr uint32_t kRemoteKeyBit = 0x800000;  // rkey = lkey | this: the two never coincide
int events_taken = 0;  // completion events handed out by ibv_get_cq_event
int posts = 0, longest_chain = 0;
bool holding = false;  // send completions held back (an adapter slow to report them)
std::deque<std::pair<ibv_cq*, ibv_wc>> held;  // ibv_post_send calls, and the most work requests one carried
uint64_t bytes_moved = 0;
char device_token;  // ibv_device* is opaque: any address will do
ibv_device* devices[2] = {reinterpret_cast<ibv_device*>(&device_token), nullptr};

void push(ibv_cq* cq, const ibv_wc& wc, bool solicited = false) {
  auto* c = reinterpret_cast<SoftCQ*>(cq);
  c->entries.push_back(wc);
  bool wakes = !c->solicited_only || solicited || wc.status != IBV_WC_SUCCESS;
  if (c->armed && wakes && cq->channel) {
    c->armed = false;
    auto* ch = reinterpret_cast<SoftChannel*>(cq->channel);
    ch->events.push_back(cq);
    char one = 1;
    (void)!write(ch->write_fd, &one, 1);
  }
}

ibv_wc completion(uint64_t id, int status, int opcode, uint32_t qpn) {
  ibv_wc wc{};
  wc.wr_id = id;
  wc.status = status;
  wc.opcode = opcode;
  wc.qp_num = qpn;
  return wc;
}

// A queue pair in error flushes every receive it had posted.
void to_error(SoftQP* qp) {
  if (qp->base.state == IBV_QPS_ERR) return;
  qp->base.state = IBV_QPS_ERR;
  while (!qp->recv_ids.empty()) {
    push(qp->base.recv_cq, completion(qp->recv_ids.front(), IBV_WC_WR_FLUSH_ERR, 0, qp->base.qp_num));
    qp->recv_ids.pop_front();
  }
  qp->recvs = 0;
}

bool covers(const SoftMR* mr, uint64_t addr, uint64_t n) {
  uint64_t a = reinterpret_cast<uint64_t>(mr->base.addr);
  return addr >= a && addr + n <= a + mr->base.length;
}

int poll_cq(ibv_cq* cq, int num, ibv_wc* wc) {
  std::lock_guard<std::mutex> hold(lock);
  auto* c = reinterpret_cast<SoftCQ*>(cq);
  int n = 0;
  while (n < num && !c->entries.empty()) {
    wc[n++] = c->entries.front();
    c->entries.pop_front();
  }
  return n;
}

int req_notify_cq(ibv_cq* cq, int solicited_only) {
  std::lock_guard<std::mutex> hold(lock);
  auto* c = reinterpret_cast<SoftCQ*>(cq);
  c->armed = true;
  c->solicited_only = solicited_only != 0;
  return 0;
}

int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  std::lock_guard<std::mutex> hold(lock);
  auto* q = reinterpret_cast<SoftQP*>(qp);
  for (; wr; wr = wr->next) {
    if (wr->num_sge != 1 || q->recvs >= static_cast<int>(q->attr.cap.max_recv_wr)) {
      *bad = wr;
      return ENOMEM;
    }
    if (qp->state == IBV_QPS_ERR) {
      push(qp->recv_cq, completion(wr->wr_id, IBV_WC_WR_FLUSH_ERR, 0, qp->qp_num));
      continue;
    }
    q->recvs += 1;
    q->recv_ids.push_back(wr->wr_id);
  }
  return 0;
}

int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  std::lock_guard<std::mutex> hold(lock);
  auto* q = reinterpret_cast<SoftQP*>(qp);
  int chained = 0;
  for (; wr; wr = wr->next) {
    chained += 1;
    if ((wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM && wr->opcode != IBV_WR_RDMA_WRITE) || wr->num_sge != 1) {
      *bad = wr;
      return EINVAL;
    }
    if (qp->state == IBV_QPS_ERR) {
      push(qp->send_cq, completion(wr->wr_id, IBV_WC_WR_FLUSH_ERR, 0, qp->qp_num));
      continue;
    }
    if (qp->state != IBV_QPS_RTS) {
      *bad = wr;
      return EINVAL;
    }
    const ibv_sge& sge = wr->sg_list[0];
    auto local = mrs_by_key.find(sge.lkey);
    auto peer = qps.find(q->attr.dest_qp_num);
    int status = IBV_WC_SUCCESS;
    if (local == mrs_by_key.end() || !covers(local->second, sge.addr, sge.length) ||
        local->second->base.pd != qp->pd) {  // a key of another protection domain is no key here
      status = 4;  // IBV_WC_LOC_PROT_ERR
    } else if (peer == qps.end() || peer->second->base.state == IBV_QPS_ERR ||
               peer->second->base.state < IBV_QPS_RTR) {
      status = IBV_WC_RETRY_EXC_ERR;  // nobody answers at that queue pair number
    } else {
      auto remote = mrs_by_rkey.find(wr->wr.rdma.rkey);
      SoftQP* p = peer->second;
      bool imm = wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
      if (remote == mrs_by_rkey.end() || !covers(remote->second, wr->wr.rdma.remote_addr, sge.length) ||
          !(remote->second->access & IBV_ACCESS_REMOTE_WRITE) || remote->second->base.pd != p->base.pd) {
        status = IBV_WC_REM_ACCESS_ERR;
        to_error(p);
      } else if (imm && p->recvs == 0) {
        status = IBV_WC_RNR_RETRY_EXC_ERR;
      } else {
        std::memmove(reach(remote->second, wr->wr.rdma.remote_addr), reach(local->second, sge.addr), sge.length);
        bytes_moved += sge.length;
      }
      if (status == IBV_WC_SUCCESS && imm) {
        p->recvs -= 1;
        ibv_wc got = completion(p->recv_ids.front(), IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, p->base.qp_num);
        p->recv_ids.pop_front();
        got.imm_data = wr->imm_data;
        got.wc_flags = IBV_WC_WITH_IMM;
        got.byte_len = sge.length;
        got.src_qp = qp->qp_num;
        push(p->base.recv_cq, got, (wr->send_flags & IBV_SEND_SOLICITED) != 0);
      }
    }
    if (status != IBV_WC_SUCCESS) {
      push(qp->send_cq, completion(wr->wr_id, status, IBV_WC_RDMA_WRITE, qp->qp_num));
      to_error(q);
    } else if (wr->send_flags & IBV_SEND_SIGNALED) {
      ibv_wc done = completion(wr->wr_id, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, qp->qp_num);
      if (holding)
        held.emplace_back(qp->send_cq, done);
      else
        push(qp->send_cq, done);
    }
  }
  posts += 1;
  longest_chain = chained > longest_chain ? chained : longest_chain;
  return 0;
}

}  // namespace

extern "C" {

ibv_device** ibv_get_device_list(int* n) {
  ibv_device** list = new ibv_device*[2];
  list[0] = devices[0];
  list[1] = nullptr;
  *n = 1;
  return list;
}
void ibv_free_device_list(ibv_device** list) { delete[] list; }
const char* ibv_get_device_name(ibv_device*) { return "soft0"; }

ibv_context* ibv_open_device(ibv_device* device) {
  auto* ctx = new ibv_context{};
  ctx->device = device;
  ctx->ops.poll_cq = poll_cq;
  ctx->ops.req_notify_cq = req_notify_cq;
  ctx->ops.post_send = post_send;
  ctx->ops.post_recv = post_recv;
  return ctx;
}
int ibv_close_device(ibv_context* ctx) {
  delete ctx;
  return 0;
}

ibv_pd* ibv_alloc_pd(ibv_context* ctx) { return new ibv_pd{ctx, 0}; }
int ibv_dealloc_pd(ibv_pd* pd) {
  delete pd;
  return 0;
}

ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  std::lock_guard<std::mutex> hold(lock);
  auto* mr = new SoftMR{};
  mr->base = ibv_mr{pd->context, pd, addr, length, 0, next_key, next_key | kRemoteKeyBit};
  mr->access = access;
  mr->host = static_cast<uint8_t*>(addr);
  mrs_by_key[next_key] = mr;
  mrs_by_rkey[next_key | kRemoteKeyBit] = mr;
  next_key += 1;
  return &mr->base;
}

// A dma-buf's memory is reached through its own mapping (a memfd here stands for a GPU's
// export): SGEs name it by `iova`, and the copies translate iova to the mapping.
ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access) {
  uint64_t lead = offset % 4096;  // mmap takes whole pages: map from the page holding `offset`
  void* mapped = mmap(nullptr, length + lead, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                      static_cast<off_t>(offset - lead));
  if (mapped == MAP_FAILED) return nullptr;
  std::lock_guard<std::mutex> hold(lock);
  auto* mr = new SoftMR{};
  mr->base = ibv_mr{pd->context, pd, reinterpret_cast<void*>(iova), length, 0, next_key, next_key | kRemoteKeyBit};
  mr->access = access;
  mr->host = static_cast<uint8_t*>(mapped) + lead;
  mr->lead = lead;
  mr->mapped = true;
  mrs_by_key[next_key] = mr;
  mrs_by_rkey[next_key | kRemoteKeyBit] = mr;
  next_key += 1;
  return &mr->base;
}
int ibv_dereg_mr(ibv_mr* mr) {
  std::lock_guard<std::mutex> hold(lock);
  mrs_by_key.erase(mr->lkey);
  mrs_by_rkey.erase(mr->rkey);
  auto* soft = reinterpret_cast<SoftMR*>(mr);
  if (soft->mapped) munmap(soft->host - soft->lead, mr->length + soft->lead);
  delete soft;
  return 0;
}

ibv_comp_channel* ibv_create_comp_channel(ibv_context* ctx) {
  int fds[2];
  if (pipe(fds) != 0) return nullptr;
  auto* ch = new SoftChannel{};
  ch->base.context = ctx;
  ch->base.fd = fds[0];
  ch->write_fd = fds[1];
  return &ch->base;
}
int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  auto* ch = reinterpret_cast<SoftChannel*>(channel);
  close(ch->base.fd);
  close(ch->write_fd);
  delete ch;
  return 0;
}
int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** context) {
  char one;
  if (read(channel->fd, &one, 1) != 1) return -1;  // EAGAIN on the core's non-blocking descriptor
  std::lock_guard<std::mutex> hold(lock);
  auto* ch = reinterpret_cast<SoftChannel*>(channel);
  if (ch->events.empty()) return -1;
  *cq = ch->events.front();
  *context = (*cq)->cq_context;
  ch->events.pop_front();
  events_taken += 1;
  return 0;
}
void ibv_ack_cq_events(ibv_cq*, unsigned int) {}

ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* channel, int) {
  auto* cq = new SoftCQ{};
  cq->base.context = ctx;
  cq->base.channel = channel;
  cq->base.cq_context = cq_context;
  cq->base.cqe = cqe;
  return &cq->base;
}
int ibv_destroy_cq(ibv_cq* cq) {
  std::lock_guard<std::mutex> hold(lock);
  if (cq->channel) {  // events of this queue not taken yet go with it
    auto& events = reinterpret_cast<SoftChannel*>(cq->channel)->events;
    for (auto it = events.begin(); it != events.end();) it = *it == cq ? events.erase(it) : it + 1;
  }
  delete reinterpret_cast<SoftCQ*>(cq);
  return 0;
}

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* init) {
  if (init->qp_type != IBV_QPT_RC || init->cap.max_send_sge != 1 || init->cap.max_recv_sge != 1) {
    errno = EINVAL;
    return nullptr;
  }
  std::lock_guard<std::mutex> hold(lock);
  auto* qp = new SoftQP{};
  qp->base.context = pd->context;
  qp->base.pd = pd;
  qp->base.send_cq = init->send_cq;
  qp->base.recv_cq = init->recv_cq;
  qp->base.qp_num = next_qpn++;
  qp->base.qp_type = IBV_QPT_RC;
  qp->base.state = IBV_QPS_RESET;
  qp->attr.cap = init->cap;
  qps[qp->base.qp_num] = qp;
  return &qp->base;
}

int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  std::lock_guard<std::mutex> hold(lock);
  auto* q = reinterpret_cast<SoftQP*>(qp);
  if (!(mask & IBV_QP_STATE)) return EINVAL;
  int from = qp->state, to = attr->qp_state;
  bool legal = (from == IBV_QPS_RESET && to == IBV_QPS_INIT) || (from == IBV_QPS_INIT && to == IBV_QPS_RTR) ||
               (from == IBV_QPS_RTR && to == IBV_QPS_RTS) || to == IBV_QPS_ERR || to == IBV_QPS_RESET;
  if (!legal) return EINVAL;
  if (to == IBV_QPS_INIT) {
    if ((mask & (IBV_QP_PORT | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX)) !=
        (IBV_QP_PORT | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX))
      return EINVAL;
    q->attr.port_num = attr->port_num;
    q->attr.qp_access_flags = attr->qp_access_flags;
    q->attr.pkey_index = attr->pkey_index;
  }
  if (to == IBV_QPS_RTR) {
    int need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
               IBV_QP_MIN_RNR_TIMER;
    if ((mask & need) != need) return EINVAL;
    q->attr.path_mtu = attr->path_mtu;
    q->attr.dest_qp_num = attr->dest_qp_num;
    q->attr.rq_psn = attr->rq_psn;
    q->attr.max_dest_rd_atomic = attr->max_dest_rd_atomic;
    q->attr.min_rnr_timer = attr->min_rnr_timer;
    q->attr.ah_attr = attr->ah_attr;
  }
  if (to == IBV_QPS_RTS) {
    int need = IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    if ((mask & need) != need) return EINVAL;
    q->attr.sq_psn = attr->sq_psn;
    q->attr.timeout = attr->timeout;
    q->attr.retry_cnt = attr->retry_cnt;
    q->attr.rnr_retry = attr->rnr_retry;
    q->attr.max_rd_atomic = attr->max_rd_atomic;
  }
  if (to == IBV_QPS_ERR) {
    to_error(q);
    return 0;
  }
  qp->state = to;
  return 0;
}

int ibv_destroy_qp(ibv_qp* qp) {
  std::lock_guard<std::mutex> hold(lock);
  qps.erase(qp->qp_num);
  delete reinterpret_cast<SoftQP*>(qp);
  return 0;
}

// -- test hooks ---------------------------------------------------------------------------------
// Moves queue pair `qpn` to the error state, as a peer's adapter does when its process dies:
// its receives flush, and writes towards it exhaust their retries. 0, or -1 if no such pair.
int soft_verbs_break(uint32_t qpn) {
  std::lock_guard<std::mutex> hold(lock);
  auto it = qps.find(qpn);
  if (it == qps.end()) return -1;
  to_error(it->second);
  return 0;
}

// The attributes queue pair `qpn` was given (state included), or -1 if no such pair.
int soft_verbs_attr(uint32_t qpn, ibv_qp_attr* out, int* state) {
  std::lock_guard<std::mutex> hold(lock);
  auto it = qps.find(qpn);
  if (it == qps.end()) return -1;
  *out = it->second->attr;
  *state = it->second->base.state;
  return 0;
}

// Holds back send completions (on != 0) or reports every one held (0).
void soft_verbs_hold_send_completions(int on) {
  std::lock_guard<std::mutex> hold(lock);
  holding = on != 0;
  if (holding) return;
  for (auto& [cq, wc] : held) push(cq, wc);
  held.clear();
}

// Completion events taken so far (a Round that slept on the channel and was woken by it).
int soft_verbs_events() {
  std::lock_guard<std::mutex> hold(lock);
  return events_taken;
}

// ibv_post_send calls so far, the most work requests one of them chained since the last call
// (so a test reads its own posts' chains), and the bytes written.
int soft_verbs_posts(int* longest, uint64_t* bytes) {
  std::lock_guard<std::mutex> hold(lock);
  *longest = longest_chain;
  longest_chain = 0;
  *bytes = bytes_moved;
  return posts;
}

// Queue pairs and registered regions alive (leak checks).
int soft_verbs_live(int* mrs) {
  std::lock_guard<std::mutex> hold(lock);
  *mrs = static_cast<int>(mrs_by_key.size());
  return static_cast<int>(qps.size());
}

}  // extern "C"
