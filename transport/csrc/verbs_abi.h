// The part of libibverbs' ABI the core's rdma channels use, declared here so that building
// the core needs no RDMA headers: libibverbs is loaded at run time (verbs_channels.cpp), and
// only where an endpoint wires rdma channels.
//
// The layouts are rdma-core's <infiniband/verbs.h> (stable since libibverbs 1.1, the
// IBVERBS_1.1 symbol versions these are looked up by). tests/transport/test_core_rdma.py
// compiles verbs_abi_check.cpp against a real verbs.h where one is found and checks every
// size and offset below against it. The three hot calls (post_send, post_recv, poll_cq) are
// inline functions in verbs.h that call through the context's ops table; they are called the
// same way here.

#pragma once

#include <pthread.h>

#include <cstddef>
#include <cstdint>

namespace m2n::verbs {

struct ibv_device;  // opaque: only passed back to the library
struct ibv_srq;
struct ibv_ah;
struct ibv_mw;

union ibv_gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix;
    uint64_t interface_id;
  } global;
};

struct ibv_pd;
struct ibv_cq;
struct ibv_qp;
struct ibv_wc;
struct ibv_send_wr;
struct ibv_recv_wr;

// struct ibv_context_ops: 32 function pointers, of which the data path calls three.
struct ibv_context_ops {
  void* before_poll_cq[11];  // _compat_query_device .. _compat_create_cq
  int (*poll_cq)(ibv_cq* cq, int num_entries, ibv_wc* wc);
  int (*req_notify_cq)(ibv_cq* cq, int solicited_only);
  void* before_post_send[12];  // _compat_cq_event .. _compat_destroy_qp
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
  void* after_post_recv[5];  // _compat_create_ah .. _compat_async_event
};

struct ibv_context {
  ibv_device* device;
  ibv_context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void* abi_compat;
};

struct ibv_comp_channel {
  ibv_context* context;
  int fd;
  int refcnt;
};

struct ibv_pd {
  ibv_context* context;
  uint32_t handle;
};

struct ibv_mr {
  ibv_context* context;
  ibv_pd* pd;
  void* addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

struct ibv_cq {
  ibv_context* context;
  ibv_comp_channel* channel;
  void* cq_context;
  uint32_t handle;
  int cqe;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t comp_events_completed;
  uint32_t async_events_completed;
};

struct ibv_qp {
  ibv_context* context;
  void* qp_context;
  ibv_pd* pd;
  ibv_cq* send_cq;
  ibv_cq* recv_cq;
  ibv_srq* srq;
  uint32_t handle;
  uint32_t qp_num;
  int state;    // enum ibv_qp_state
  int qp_type;  // enum ibv_qp_type
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

struct ibv_sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct ibv_mw_bind_info {
  ibv_mr* mr;
  uint64_t addr;
  uint64_t length;
  unsigned int mw_access_flags;
};

struct ibv_send_wr {
  uint64_t wr_id;
  ibv_send_wr* next;
  ibv_sge* sg_list;
  int num_sge;
  int opcode;  // enum ibv_wr_opcode
  unsigned int send_flags;
  uint32_t imm_data;  // network byte order (a union with invalidate_rkey)
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr;
      uint64_t compare_add;
      uint64_t swap;
      uint32_t rkey;
    } atomic;
    struct {
      ibv_ah* ah;
      uint32_t remote_qpn;
      uint32_t remote_qkey;
    } ud;
  } wr;
  union {
    struct {
      uint32_t remote_srqn;
    } xrc;
  } qp_type;
  union {
    struct {
      ibv_mw* mw;
      uint32_t rkey;
      ibv_mw_bind_info bind_info;
    } bind_mw;
    struct {
      void* hdr;
      uint16_t hdr_sz;
      uint16_t mss;
    } tso;
  };
};

struct ibv_recv_wr {
  uint64_t wr_id;
  ibv_recv_wr* next;
  ibv_sge* sg_list;
  int num_sge;
};

struct ibv_wc {
  uint64_t wr_id;
  int status;  // enum ibv_wc_status
  int opcode;  // enum ibv_wc_opcode
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data;  // network byte order
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned int wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

struct ibv_qp_cap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
  void* qp_context;
  ibv_cq* send_cq;
  ibv_cq* recv_cq;
  ibv_srq* srq;
  ibv_qp_cap cap;
  int qp_type;  // enum ibv_qp_type
  int sq_sig_all;
};

struct ibv_global_route {
  ibv_gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

struct ibv_ah_attr {
  ibv_global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

struct ibv_qp_attr {
  int qp_state;        // enum ibv_qp_state
  int cur_qp_state;    // enum ibv_qp_state
  int path_mtu;        // enum ibv_mtu
  int path_mig_state;  // enum ibv_mig_state
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned int qp_access_flags;
  ibv_qp_cap cap;
  ibv_ah_attr ah_attr;
  ibv_ah_attr alt_ah_attr;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

// enum values (verbs.h)
constexpr int IBV_QPT_RC = 2;
constexpr int IBV_QPS_RESET = 0, IBV_QPS_INIT = 1, IBV_QPS_RTR = 2, IBV_QPS_RTS = 3, IBV_QPS_ERR = 6;
constexpr int IBV_WR_RDMA_WRITE = 0, IBV_WR_RDMA_WRITE_WITH_IMM = 1;
constexpr unsigned IBV_SEND_SIGNALED = 1u << 1, IBV_SEND_SOLICITED = 1u << 2;
constexpr int IBV_WC_SUCCESS = 0, IBV_WC_WR_FLUSH_ERR = 5, IBV_WC_REM_ACCESS_ERR = 10, IBV_WC_RETRY_EXC_ERR = 12,
              IBV_WC_RNR_RETRY_EXC_ERR = 13;
constexpr int IBV_WC_RDMA_WRITE = 1, IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1;
constexpr unsigned IBV_WC_WITH_IMM = 1u << 1;
constexpr int IBV_ACCESS_LOCAL_WRITE = 1, IBV_ACCESS_REMOTE_WRITE = 1 << 1;
constexpr int IBV_QP_STATE = 1 << 0, IBV_QP_ACCESS_FLAGS = 1 << 3, IBV_QP_PKEY_INDEX = 1 << 4, IBV_QP_PORT = 1 << 5,
              IBV_QP_AV = 1 << 7, IBV_QP_PATH_MTU = 1 << 8, IBV_QP_TIMEOUT = 1 << 9, IBV_QP_RETRY_CNT = 1 << 10,
              IBV_QP_RNR_RETRY = 1 << 11, IBV_QP_RQ_PSN = 1 << 12, IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
              IBV_QP_MIN_RNR_TIMER = 1 << 15, IBV_QP_SQ_PSN = 1 << 16, IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
              IBV_QP_DEST_QPN = 1 << 20;

// The library's exported entry points the channels use, looked up by name (and version).
struct Library {
  ibv_device** (*get_device_list)(int* num_devices);
  void (*free_device_list)(ibv_device** list);
  const char* (*get_device_name)(ibv_device* device);
  ibv_context* (*open_device)(ibv_device* device);
  int (*close_device)(ibv_context* context);
  ibv_pd* (*alloc_pd)(ibv_context* context);
  int (*dealloc_pd)(ibv_pd* pd);
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access);
  // IBVERBS_1.12 (rdma-core 34): memory another driver exports as a dma-buf (GPU memory); null
  // where the library is older.
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access);
  int (*dereg_mr)(ibv_mr* mr);
  ibv_comp_channel* (*create_comp_channel)(ibv_context* context);
  int (*destroy_comp_channel)(ibv_comp_channel* channel);
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector);
  int (*destroy_cq)(ibv_cq* cq);
  int (*get_cq_event)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context);
  void (*ack_cq_events)(ibv_cq* cq, unsigned int nevents);
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr);
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask);
  int (*destroy_qp)(ibv_qp* qp);
};

}  // namespace m2n::verbs
