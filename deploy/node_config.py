"""What a node actor derives from the plan: its engine configuration, weights and slot sizes."""

from __future__ import annotations

from megainfer.config import EngineConfig, ModelConfig, resolve_model
from megainfer.disagg.expert_link import dispatch_bytes
from megainfer.model.weights import RandomWeights, SafetensorsCheckpoint, WeightSource
from megainfer.errors import PlanError
from megainfer.plan import Plan

# Seconds a node waits on a peer before declaring it gone.
PEER_TIMEOUT_S = 20.0


def engine_config(plan: Plan, num_threads: int | None) -> EngineConfig:
    return EngineConfig(dtype=plan.dtype, device="cpu" if plan.attention.gpu == "cpu" else "cuda",
                        max_num_seqs=plan.scheduler.max_num_seqs,
                        max_num_batched_tokens=plan.scheduler.max_num_batched_tokens,
                        prefill_policy=plan.scheduler.prefill_policy, group_tokens=plan.scheduler.group_tokens,
                        target_step_ms=plan.scheduler.target_step_ms, num_threads=num_threads)


def checked_model(plan: Plan) -> ModelConfig:
    """The plan's model, checked against the plan before anything starts."""
    model, _ = weights_of(plan)
    plan.check_model(model)
    if model.expert_intermediate_size % plan.experts.tp:
        raise PlanError(f"experts.tp = {plan.experts.tp} does not divide the experts' intermediate size "
                        f"({model.expert_intermediate_size}); choose a tp that divides it")
    return model


def weights_of(plan: Plan) -> tuple[ModelConfig, WeightSource]:
    model, checkpoint = resolve_model(plan.model)
    return model, SafetensorsCheckpoint(checkpoint) if checkpoint else RandomWeights(0)


def slot_sizes(plan: Plan, model: ModelConfig) -> tuple[int, int]:
    """(attention node's receive slot, expert node's receive slot) in bytes: one micro-batch
    may carry the whole step's tokens."""
    import torch

    tokens = plan.scheduler.max_num_batched_tokens
    dtype = getattr(torch, plan.dtype)
    return (tokens * model.hidden_size * torch.empty(0, dtype=dtype).element_size(),
            dispatch_bytes(tokens, model.hidden_size, model.top_k, dtype))


def bind_host(host: str) -> str:
    """Where a node's endpoint listens: the given host (127.0.0.1 on an embedded single-machine
    Ray), else this node's address in the cluster, which is what peers elsewhere can reach."""
    if host:
        return host
    import ray

    return ray.util.get_node_ip_address()


def node_names(plan: Plan) -> tuple[list[str], list[str]]:
    """(attention nodes, i.e. their leader ranks; expert nodes)."""
    return ([f"attention{i}" for i in range(plan.attention.nodes)],
            [f"expert{k}" for k in range(plan.experts.nodes)])


def attention_rank_name(node: int, rank: int) -> str:
    return f"attention{node}" if rank == 0 else f"attention{node}.{rank}"


def attention_rank_names(plan: Plan) -> list[str]:
    """Every rank of every attention node: each is an M2N peer of every expert node."""
    return [attention_rank_name(i, r) for i in range(plan.attention.nodes) for r in range(plan.attention.tp)]


def tp_master_address(host: str) -> str:
    """A free TCP port on `host` (this node's address) for a tensor-parallel group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def join_tp_group(master: str, rank: int, world_size: int, on_gpu: bool) -> None:
    """The node's own group: gloo for CPU ranks, nccl for GPU ranks; never across nodes."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://{master}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S * 3))
