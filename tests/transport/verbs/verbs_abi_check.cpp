// Checks transport/csrc/verbs_abi.h against a real <infiniband/verbs.h>: every size and every
// offset the core reads or writes. Compiled (never run) by tests/transport/test_core_rdma.py
// where a verbs.h is found; a mismatch is a compile error naming the field.
#include <infiniband/verbs.h>

#include <cstddef>

#include "verbs_abi.h"

namespace ours = m2n::verbs;

#define SAME_SIZE(T) static_assert(sizeof(ours::T) == sizeof(::T), "size of " #T)
#define SAME_AT(T, f) static_assert(offsetof(ours::T, f) == offsetof(::T, f), "offset of " #T "." #f)

SAME_SIZE(ibv_gid);
SAME_SIZE(ibv_context_ops);
SAME_AT(ibv_context_ops, poll_cq);
SAME_AT(ibv_context_ops, req_notify_cq);
SAME_AT(ibv_context_ops, post_send);
SAME_AT(ibv_context_ops, post_recv);
SAME_SIZE(ibv_context);
SAME_AT(ibv_context, ops);
SAME_SIZE(ibv_comp_channel);
SAME_AT(ibv_comp_channel, fd);
SAME_SIZE(ibv_pd);
SAME_SIZE(ibv_mr);
SAME_AT(ibv_mr, lkey);
SAME_AT(ibv_mr, rkey);
SAME_SIZE(ibv_cq);
SAME_SIZE(ibv_qp);
SAME_AT(ibv_qp, qp_num);
SAME_AT(ibv_qp, state);
SAME_SIZE(ibv_sge);
SAME_AT(ibv_sge, lkey);
SAME_SIZE(ibv_send_wr);
SAME_AT(ibv_send_wr, next);
SAME_AT(ibv_send_wr, sg_list);
SAME_AT(ibv_send_wr, num_sge);
SAME_AT(ibv_send_wr, opcode);
SAME_AT(ibv_send_wr, send_flags);
SAME_AT(ibv_send_wr, imm_data);
SAME_AT(ibv_send_wr, wr.rdma.remote_addr);
SAME_AT(ibv_send_wr, wr.rdma.rkey);
SAME_SIZE(ibv_recv_wr);
SAME_AT(ibv_recv_wr, num_sge);
SAME_SIZE(ibv_wc);
SAME_AT(ibv_wc, status);
SAME_AT(ibv_wc, opcode);
SAME_AT(ibv_wc, imm_data);
SAME_AT(ibv_wc, qp_num);
SAME_AT(ibv_wc, wc_flags);
SAME_SIZE(ibv_qp_cap);
SAME_SIZE(ibv_qp_init_attr);
SAME_AT(ibv_qp_init_attr, cap);
SAME_AT(ibv_qp_init_attr, qp_type);
SAME_AT(ibv_qp_init_attr, sq_sig_all);
SAME_SIZE(ibv_global_route);
SAME_AT(ibv_global_route, sgid_index);
SAME_AT(ibv_global_route, hop_limit);
SAME_SIZE(ibv_ah_attr);
SAME_AT(ibv_ah_attr, dlid);
SAME_AT(ibv_ah_attr, is_global);
SAME_AT(ibv_ah_attr, port_num);
SAME_SIZE(ibv_qp_attr);
SAME_AT(ibv_qp_attr, path_mtu);
SAME_AT(ibv_qp_attr, rq_psn);
SAME_AT(ibv_qp_attr, sq_psn);
SAME_AT(ibv_qp_attr, dest_qp_num);
SAME_AT(ibv_qp_attr, qp_access_flags);
SAME_AT(ibv_qp_attr, ah_attr);
SAME_AT(ibv_qp_attr, pkey_index);
SAME_AT(ibv_qp_attr, max_rd_atomic);
SAME_AT(ibv_qp_attr, max_dest_rd_atomic);
SAME_AT(ibv_qp_attr, min_rnr_timer);
SAME_AT(ibv_qp_attr, port_num);
SAME_AT(ibv_qp_attr, timeout);
SAME_AT(ibv_qp_attr, retry_cnt);
SAME_AT(ibv_qp_attr, rnr_retry);

static_assert(ours::IBV_QPT_RC == IBV_QPT_RC && ours::IBV_QPS_RESET == IBV_QPS_RESET &&
              ours::IBV_QPS_INIT == IBV_QPS_INIT && ours::IBV_QPS_RTR == IBV_QPS_RTR &&
              ours::IBV_QPS_RTS == IBV_QPS_RTS && ours::IBV_QPS_ERR == IBV_QPS_ERR, "qp types and states");
static_assert(ours::IBV_WR_RDMA_WRITE == IBV_WR_RDMA_WRITE &&
              ours::IBV_WR_RDMA_WRITE_WITH_IMM == IBV_WR_RDMA_WRITE_WITH_IMM &&
              ours::IBV_SEND_SIGNALED == IBV_SEND_SIGNALED && ours::IBV_SEND_SOLICITED == IBV_SEND_SOLICITED,
              "work request opcode and flags");
static_assert(ours::IBV_WC_SUCCESS == IBV_WC_SUCCESS && ours::IBV_WC_WR_FLUSH_ERR == IBV_WC_WR_FLUSH_ERR &&
              ours::IBV_WC_REM_ACCESS_ERR == IBV_WC_REM_ACCESS_ERR &&
              ours::IBV_WC_RETRY_EXC_ERR == IBV_WC_RETRY_EXC_ERR &&
              ours::IBV_WC_RNR_RETRY_EXC_ERR == IBV_WC_RNR_RETRY_EXC_ERR && ours::IBV_WC_RDMA_WRITE == IBV_WC_RDMA_WRITE &&
              ours::IBV_WC_RECV_RDMA_WITH_IMM == IBV_WC_RECV_RDMA_WITH_IMM && ours::IBV_WC_WITH_IMM == IBV_WC_WITH_IMM,
              "completion statuses, opcodes, flags");
static_assert(ours::IBV_ACCESS_LOCAL_WRITE == IBV_ACCESS_LOCAL_WRITE &&
              ours::IBV_ACCESS_REMOTE_WRITE == IBV_ACCESS_REMOTE_WRITE, "access flags");
static_assert(ours::IBV_QP_STATE == IBV_QP_STATE && ours::IBV_QP_ACCESS_FLAGS == IBV_QP_ACCESS_FLAGS &&
              ours::IBV_QP_PKEY_INDEX == IBV_QP_PKEY_INDEX && ours::IBV_QP_PORT == IBV_QP_PORT &&
              ours::IBV_QP_AV == IBV_QP_AV && ours::IBV_QP_PATH_MTU == IBV_QP_PATH_MTU &&
              ours::IBV_QP_TIMEOUT == IBV_QP_TIMEOUT && ours::IBV_QP_RETRY_CNT == IBV_QP_RETRY_CNT &&
              ours::IBV_QP_RNR_RETRY == IBV_QP_RNR_RETRY && ours::IBV_QP_RQ_PSN == IBV_QP_RQ_PSN &&
              ours::IBV_QP_MAX_QP_RD_ATOMIC == IBV_QP_MAX_QP_RD_ATOMIC &&
              ours::IBV_QP_MIN_RNR_TIMER == IBV_QP_MIN_RNR_TIMER && ours::IBV_QP_SQ_PSN == IBV_QP_SQ_PSN &&
              ours::IBV_QP_MAX_DEST_RD_ATOMIC == IBV_QP_MAX_DEST_RD_ATOMIC && ours::IBV_QP_DEST_QPN == IBV_QP_DEST_QPN,
              "modify_qp attribute masks");

