"""A plan turned into what each node runs with: one function (`runtime_of`) that the node
actors start from and that `megainfer deploy PLAN --dry-run` prints.

Per attention node: the token budget, the sequence limit, the layered chunk size, the KV
heads each rank holds, the receive-slot size; per expert node: its experts and its slot
size. Slots hold the largest message a step can produce: every token one micro-batch may
carry (a whole chunked step, or the decodes plus a whole layered cohort), divided among the
attention ranks that share the sending. KV blocks are sized on the nodes themselves, from
the free memory all ranks of a node agree on (`allocate_kv_caches`); for a dry run they are
estimated from the GPU catalog's memory, and the batch the runtime can hold is compared
with the batch the plan's `predicted:` section assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megainfer.config import DTYPE_BYTES, ModelConfig, estimated_attention_step_bytes, kv_cache_budget_bytes
from megainfer.disagg.staging_sizes import StagingBytes, attention_staging, expert_staging, load_round_bytes
from megainfer.engine_config import EXPERT_LOAD_WINDOW, EngineConfig
from megainfer.errors import PlanError
from megainfer.model_resolution import resolve_model
from megainfer.plan import Plan

DEVICES = ("cpu", "cuda")
AUTO_DEVICE = "auto"  # the plan's own: cpu for a CPU plan, cuda for a GPU plan


@dataclass(frozen=True)
class AttentionRuntime:
    index: int
    name: str  # rank 0's name; the others are name.1, name.2, ...
    ranks: tuple[str, ...]
    engine: EngineConfig  # token budget, sequence limit, layered chunk, device, dtype
    kv_heads_per_rank: int
    receive_slot_bytes: int  # one expert node's answer to one micro-batch, this rank's share
    num_slots: int  # per peer: the micro-batches in flight
    staging_bytes: StagingBytes  # on CUDA: pinned host memory per micro-batch and direction, reserved at start
    cpu_slots: tuple[int, ...] = ()  # on the CPU: each rank's core slot (deploy/node_process.py)
    cpu_ranks: int = 0  # on the CPU: the deployment's ranks, all of them
    peers: int = 0  # M2N peers of each rank: every expert node
    peer_slot_bytes: int = 0  # their receive slots, which this rank writes into (0: unknown)


@dataclass(frozen=True)
class ExpertRuntime:
    index: int
    name: str
    ranks: tuple[str, ...]
    device: str
    expert_ids: tuple[int, ...]
    receive_slot_bytes: int  # one attention rank's dispatch of one micro-batch
    num_slots: int
    num_threads: int | None
    staging_bytes: StagingBytes  # on CUDA: pinned host memory per micro-batch and direction (the leader's)
    cpu_slots: tuple[int, ...] = ()  # on the CPU: each rank's core slot (deploy/node_process.py)
    cpu_ranks: int = 0  # on the CPU: the deployment's ranks, all of them
    profile_tokens: int = 0  # the most tokens of one (layer, micro-batch): every attention node's
    gpu_memory_utilization: float = 0.9  # plan serve.gpu_memory_utilization (memory_profile.py)
    peers: int = 0  # M2N peers of the node's leader: every attention rank
    peer_slot_bytes: int = 0  # their receive slots, which this node writes into (0: unknown)
    # The most tokens of one decode (layer, micro-batch), every attention node's: the largest
    # CUDA graph size (decode_graphs.py); 0: none captured (a CPU, or serve.enforce_eager).
    decode_graph_tokens: int = 0


@dataclass(frozen=True)
class DeploymentRuntime:
    plan: Plan
    model: ModelConfig
    device: str
    attention: tuple[AttentionRuntime, ...]
    experts: tuple[ExpertRuntime, ...]

    @property
    def is_rehearsal(self) -> bool:
        """A GPU plan's placement with CPU tensors."""
        return self.device == "cpu" and not self.plan.is_cpu

    @property
    def micro_batch_tokens(self) -> int:
        """The most tokens one micro-batch can carry (what the slots are sized for)."""
        return step_tokens(self.attention[0].engine)


def step_tokens(engine: EngineConfig) -> int:
    """The most tokens of one step (EngineConfig.max_step_tokens)."""
    return engine.max_step_tokens


def runtime_of(plan: Plan, device: str | None = None) -> DeploymentRuntime:
    """Every node's runtime configuration. `device`: where tensors live ("cpu" runs a GPU plan's
    placement with CPU tensors, the cluster rehearsal); None or "auto": the plan's own. The
    plan's dtype is concrete (the planner sized memory with it), so every EngineConfig here is
    resolved: nodes never see "auto"."""
    if device in (None, AUTO_DEVICE):
        device = "cpu" if plan.is_cpu else "cuda"
    if device not in DEVICES:
        raise PlanError(f"--device {device!r} is not one of {', '.join(DEVICES)} or {AUTO_DEVICE}")
    if plan.is_cpu and device != "cpu":
        raise PlanError("a CPU plan (attention.gpu: cpu) runs on the CPU; drop --device or plan for GPUs")
    model, _ = resolve_model(plan.model)
    plan.check_model(model)
    threads = 1 if device == "cpu" else None  # CPU ranks share the machine's cores
    s = plan.scheduler
    engine = EngineConfig(dtype=plan.dtype, device=device, max_model_len=plan.max_model_len,
                          max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                          prefill_policy=s.prefill_policy,
                          group_tokens=s.group_tokens, layered_chunk_tokens=s.layered_chunk_tokens,
                          target_step_ms=s.target_step_ms, async_scheduling=plan.async_scheduling, num_threads=threads,
                          gpu_memory_utilization=plan.serve.gpu_memory_utilization,
                          enforce_eager=plan.serve.enforce_eager, enable_prefix_caching=s.enable_prefix_caching,
                          num_kv_blocks=s.num_kv_blocks,
                          expert_load_window=(plan.experts.rebalance.window_steps
                                              if plan.experts.rebalance is not None else EXPERT_LOAD_WINDOW))
    tokens, tp_a = step_tokens(engine), plan.attention.tp
    share = math.ceil(tokens / tp_a)  # each attention rank sends and receives its share of a node's tokens
    value_bytes = DTYPE_BYTES[plan.dtype]
    # An attention rank's receive slot takes one expert node's answer or its load round, the larger.
    answer_bytes = max(share * model.hidden_size * value_bytes,
                       load_round_bytes(model.num_layers, plan.expert_room(model)))
    record = model.hidden_size * value_bytes + model.top_k * 8  # one token's x, int32 ids, float32 weights
    dispatch_bytes = share * record
    # Staged through pinned memory on CUDA, the largest message of each direction (staging_sizes.py).
    a_staging = attention_staging(tokens, model.hidden_size, model.top_k, value_bytes, plan.experts.nodes, tp_a)
    e_staging = expert_staging(tokens, model.hidden_size, model.top_k, value_bytes, plan.attention.nodes)
    m = plan.pipeline.micro_batches
    graph_tokens = 0 if plan.serve.enforce_eager else plan.attention.nodes * math.ceil(s.max_num_seqs / m)
    # CPU ranks take core slots in order: attention ranks, node by node, then expert ranks.
    tp_e, a_ranks = plan.experts.tp, plan.attention.nodes * tp_a
    ranks = a_ranks + plan.experts.nodes * tp_e if device == "cpu" else 0

    def slots(first: int, tp: int) -> tuple[int, ...]:
        return tuple(range(first, first + tp)) if ranks else ()

    attention = tuple(AttentionRuntime(i, f"attention{i}", rank_names(f"attention{i}", tp_a), engine,
                                       model.num_kv_heads // tp_a, answer_bytes, m, a_staging,
                                       slots(i * tp_a, tp_a), ranks, peers=plan.experts.nodes,
                                       peer_slot_bytes=dispatch_bytes)
                      for i in range(plan.attention.nodes))
    experts = tuple(ExpertRuntime(k, f"expert{k}", rank_names(f"expert{k}", tp_e), device, tuple(ids),
                                  dispatch_bytes, m, threads, e_staging, slots(a_ranks + k * tp_e, tp_e), ranks,
                                  profile_tokens=plan.attention.nodes * tokens,
                                  gpu_memory_utilization=plan.serve.gpu_memory_utilization, peers=a_ranks,
                                  peer_slot_bytes=answer_bytes, decode_graph_tokens=graph_tokens)
                    for k, ids in enumerate(plan.expert_assignment(model)))
    return DeploymentRuntime(plan, model, device, attention, experts)


def rank_name(node: str, rank: int) -> str:
    """A rank's name: the node's own for its leader (rank 0), node.rank for the others."""
    return node if rank == 0 else f"{node}.{rank}"


def rank_names(node: str, tp: int) -> tuple[str, ...]:
    return tuple(rank_name(node, rank) for rank in range(tp))


@dataclass(frozen=True)
class BatchCheck:
    """What one attention node can hold against what the plan predicted for it."""

    predicted: int | None  # sequences per attention node the plan's prediction assumed
    sequence_limit: int  # max_num_seqs
    decode_budget: int  # decodes one step can carry (the token budget, for chunked prefill)
    kv_blocks_per_rank: int | None  # estimated from the GPU catalog; None on CPUs
    kv_sequences: int | None  # sequences of the predicted length those blocks hold

    @property
    def runtime_batch(self) -> int:
        limits = [self.sequence_limit, self.decode_budget]
        if self.kv_sequences is not None:
            limits.append(self.kv_sequences)
        return min(limits)

    @property
    def reaches_prediction(self) -> bool:
        return self.predicted is None or self.runtime_batch >= self.predicted


def check_batch(runtime: DeploymentRuntime, gpu_memory_bytes: float | None) -> BatchCheck:
    """The batch one attention node can run (the least of its sequence limit, its per-step
    decode budget and the sequences its KV blocks hold at the predicted length)."""
    plan, model, engine = runtime.plan, runtime.model, runtime.attention[0].engine
    predicted = math.ceil(plan.pipeline.global_batch / plan.attention.nodes) if plan.predicted else None
    decode_budget = engine.max_num_seqs if engine.prefill_policy == "layered" else engine.max_num_batched_tokens
    blocks = sequences = None
    if gpu_memory_bytes is not None:
        blocks = estimated_kv_blocks(runtime, gpu_memory_bytes)
        seq_len = plan.predicted.seq_len if plan.predicted and plan.predicted.seq_len else \
            engine.resolved_max_model_len(model)
        sequences = blocks // math.ceil(seq_len / engine.block_size)
    return BatchCheck(predicted, engine.max_num_seqs, decode_budget, blocks, sequences)


def estimated_kv_blocks(runtime: DeploymentRuntime, gpu_memory_bytes: float) -> int:
    """KV blocks of one attention rank, as the node will size them (memory_profile.py) with its
    profiling step estimated: gpu_memory_utilization of the GPU's memory, less the rank's
    weights and its largest step (sampling every running sequence), in blocks of the rank's
    share of the KV heads (the planner sizes batches with the same formula)."""
    plan, model, engine = runtime.plan, runtime.model, runtime.attention[0].engine
    value_bytes = DTYPE_BYTES[plan.dtype]
    tokens = engine.max_step_tokens
    used = model.attention_rank_weight_bytes(value_bytes, plan.attention.tp) + estimated_attention_step_bytes(
        model, value_bytes, min(engine.max_num_seqs, tokens), tokens, plan.experts.nodes)
    budget = kv_cache_budget_bytes(gpu_memory_bytes, engine.gpu_memory_utilization, used)
    budget -= engine.layered_hidden_reserve(model)
    return max(0, int(budget // engine.kv_block_bytes(model, plan.attention.tp)))
