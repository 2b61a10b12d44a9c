"""plan.yaml: the deployment plan `megainfer plan` writes and `megainfer deploy` reads.

Torch-free. Every section is a dataclass; loading rejects unknown keys and out-of-range
values with a PlanError that names the key (`experts.tp`, `pipeline.micro_batches`, ...).

Top-level keys beside the sections:

    model: mixtral-8x22b   # preset, checkpoint directory, hub id in the local cache, megainfer-demo
    dtype: bfloat16        # float32 | bfloat16 | float16: what the nodes run (and the planner sized)
    max_model_len: 8192    # optional: prompt plus generated tokens per request, at most; default
                           # the model's max_position_embeddings, which it may not exceed
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from megainfer.config import DTYPE_BYTES, GPU_MEMORY_UTILIZATION, ModelConfig, check_gpu_memory_utilization
from megainfer.errors import PlanError
from megainfer.expert_replicas import ExpertReplicas, from_assignment

# serve.router: how requests are spread over attention nodes (megainfer/routing/policies.py
# implements each; the schema names them so it imports no router).
ROUTERS = ("round_robin", "random", "least_loaded", "predictive", "prefix_affinity")

PREFILL_POLICIES = ("chunked", "layered")
TRANSPORT_BACKENDS = ("auto", "shm", "tcp", "rdma", "nixl")
CPU = "cpu"  # the GPU type of a CPU plan


def _positive(section: str, **values: float) -> None:
    for key, value in values.items():
        if value <= 0:
            raise PlanError(f"{section}.{key} must be positive, got {value}")


@dataclass
class AttentionSpec:
    gpu: str = CPU  # GPU type (a catalog name) or "cpu"
    tp: int = 1  # GPUs per attention node (tensor parallel)
    nodes: int = 1  # attention nodes (n_a, data parallel)

    def __post_init__(self) -> None:
        _positive("attention", tp=self.tp, nodes=self.nodes)


REBALANCE_PHASES = ("decode", "prefill", "all")


@dataclass
class RebalanceSpec:
    """plan.yaml's `experts.rebalance`: re-place experts while serving, from the tokens each
    expert took over a window of steps (megainfer/engine/expert_load_window.py, planner/expert_placement.py)."""

    window_steps: int = 64  # the steps whose expert loads a re-placement is computed from
    interval_s: float = 60.0  # seconds between re-placements; 0: only when asked (`megainfer deploy --rebalance`)
    phase: str = "decode"  # whose loads count: decode steps (stable, as MegaScale-Infer uses), prefill, or all
    floor_tokens: float = 0.0  # K, the cost of an expert held at all, in tokens of the window

    def __post_init__(self) -> None:
        _positive("experts.rebalance", window_steps=self.window_steps)
        if self.interval_s < 0 or self.floor_tokens < 0:
            raise PlanError(f"experts.rebalance: interval_s ({self.interval_s}) and floor_tokens "
                            f"({self.floor_tokens}) must not be negative")
        if self.phase not in REBALANCE_PHASES:
            raise PlanError(f"experts.rebalance.phase {self.phase!r} is not one of {', '.join(REBALANCE_PHASES)}")


@dataclass
class ExpertSpec:
    gpu: str = CPU
    tp: int = 1  # GPUs per expert node
    nodes: int = 1  # expert nodes
    experts_per_node: int | None = None  # None: the model's experts spread evenly over the nodes
    # Spare expert slots per node, for replicas of hot experts (MegaScale-Infer's redundancy);
    # filled by the first re-placement, so they serve once `rebalance` is set or one is asked for.
    redundant_per_node: int = 0
    rebalance: RebalanceSpec | None = None

    def __post_init__(self) -> None:
        _positive("experts", tp=self.tp, nodes=self.nodes)
        if self.experts_per_node is not None:
            _positive("experts", experts_per_node=self.experts_per_node)
        if self.redundant_per_node < 0:
            raise PlanError(f"experts.redundant_per_node must not be negative, got {self.redundant_per_node}")


@dataclass
class PipelineSpec:
    micro_batches: int = 2  # m: micro-batches ping-ponging per iteration
    global_batch: int = 64  # B: sequences decoding at once in one instance
    # Dispatches and answers written device to device between nodes of one host (CUDA IPC;
    # megainfer/disagg/device_slots.py), and across hosts by the adapter where both links are
    # rdma in the compiled core; the host carrying only headers; tensor-parallel size 1.
    device_slots: bool = False

    def __post_init__(self) -> None:
        _positive("pipeline", micro_batches=self.micro_batches, global_batch=self.global_batch)
        if self.global_batch < self.micro_batches:
            raise PlanError(f"pipeline.global_batch ({self.global_batch}) must be at least "
                            f"pipeline.micro_batches ({self.micro_batches})")


@dataclass
class SchedulerSpec:
    prefill_policy: str = "chunked"
    group_tokens: int = 512  # layered prefill: prompt tokens per layer group
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    layered_chunk_tokens: int = 8192  # layered prefill: prompt tokens of one cohort (longer prompts go in chunks)
    # Attention balancing: admit prompt tokens only while a step's predicted time stays under this.
    target_step_ms: float | None = None
    # The next step scheduled once this one is under way, this one settled inside the next
    # (vLLM's async scheduling). null: on for GPU plans, off for CPU plans, whose layers run on
    # the host's own cores, so bookkeeping beside them hides nothing (`Plan.async_scheduling`).
    async_scheduling: bool | None = None
    # Automatic prefix caching on the attention nodes (vLLM v1's default; scheduling/prefix_cache.py).
    enable_prefix_caching: bool = True
    # KV-cache blocks per attention node instead of what memory allows (vLLM's
    # num_gpu_blocks_override): to study a smaller cache (eviction, preemption) on a large machine.
    num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise PlanError(f"scheduler.async_scheduling must be true, false or null, got {self.async_scheduling!r}")
        if self.num_kv_blocks is not None:
            _positive("scheduler", num_kv_blocks=self.num_kv_blocks)
        if not isinstance(self.enable_prefix_caching, bool):
            raise PlanError(f"scheduler.enable_prefix_caching must be true or false, got "
                            f"{self.enable_prefix_caching!r}")
        if self.target_step_ms is not None:
            _positive("scheduler", target_step_ms=self.target_step_ms)
        if self.prefill_policy not in PREFILL_POLICIES:
            raise PlanError(f"scheduler.prefill_policy {self.prefill_policy!r} is not one of "
                            f"{', '.join(PREFILL_POLICIES)}")
        _positive("scheduler", group_tokens=self.group_tokens, max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens, layered_chunk_tokens=self.layered_chunk_tokens)


@dataclass
class SLOSpec:
    tbt_ms: float = 150.0  # time between tokens, milliseconds

    def __post_init__(self) -> None:
        _positive("slo", tbt_ms=self.tbt_ms)


@dataclass
class TransportSpec:
    backend: str = "auto"
    # Verbs devices rdma may use, e.g. [mlx5_0, mlx5_2]: each rank takes the one nearest its GPU
    # whose port is ACTIVE (docs/transport.md); empty: all of them. A name a host lacks is passed
    # over there; MEGAINFER_RDMA_DEVICE on a host overrides the list on that host.
    rdma_devices: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.backend not in TRANSPORT_BACKENDS:
            raise PlanError(f"transport.backend {self.backend!r} is not one of {', '.join(TRANSPORT_BACKENDS)}")
        if not all(isinstance(name, str) and name.strip() for name in self.rdma_devices):
            raise PlanError(f"transport.rdma_devices must list verbs device names (e.g. [mlx5_0, mlx5_1]), "
                            f"got {self.rdma_devices!r}")


@dataclass
class ServeSpec:
    host: str = "127.0.0.1"
    port: int = 50051
    router: str = "round_robin"
    # A request that arrives while its replica re-wires after a fault waits this long for it
    # (or goes to a healthy replica) before it fails with UNAVAILABLE; 0: fail at once.
    recovery_wait_s: float = 60.0
    # The share of each GPU's total memory a node may use (vLLM's --gpu-memory-utilization): an
    # attention rank's KV cache gets what its profiling step leaves of it (memory_profile.py).
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    # CUDA: decode runs eager instead of as CUDA graphs captured at start-up (vLLM's
    # --enforce-eager; `megainfer deploy --enforce-eager` sets it; megainfer/disagg/decode_graphs.py).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise PlanError(f"serve.enforce_eager must be true or false, got {self.enforce_eager!r}")
        if not 0 < self.port < 65536:
            raise PlanError(f"serve.port must lie in 1..65535, got {self.port}")
        check_gpu_memory_utilization(self.gpu_memory_utilization, "serve.gpu_memory_utilization", PlanError)
        if not 0 <= self.recovery_wait_s <= 3600:
            raise PlanError(f"serve.recovery_wait_s must lie in 0..3600 seconds, got {self.recovery_wait_s}")
        if self.router not in ROUTERS:
            raise PlanError(f"serve.router {self.router!r} is not one of {', '.join(ROUTERS)}")


@dataclass
class AutoscalePolicy:
    """plan.yaml's `autoscale` section."""

    min_replicas: int = 1
    max_replicas: int = 1
    predicted_ttft_s: float = 2.0  # add a replica when a new request's best predicted TTFT passes this
    idle_s: float = 60.0  # retire the newest replica after it has been idle this long

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise PlanError(f"autoscale.min_replicas must be at least 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise PlanError(f"autoscale.max_replicas ({self.max_replicas}) must be at least "
                            f"autoscale.min_replicas ({self.min_replicas})")
        for key in ("predicted_ttft_s", "idle_s"):
            if getattr(self, key) <= 0:
                raise PlanError(f"autoscale.{key} must be positive, got {getattr(self, key)}")


@dataclass
class PredictedPerformance:
    """plan.yaml's `predicted` section: what the planner's performance model predicts for this
    plan (per layer and micro-batch for the T's, per iteration for tbt)."""

    t_a_ms: float = 0.0  # attention time of one micro-batch on one node, one layer
    t_e_ms: float = 0.0  # expert time of one micro-batch on one node, one layer
    t_c_ms: float = 0.0  # one-way attention<->expert transfer of one micro-batch, one layer
    tbt_ms: float = 0.0  # iteration latency: time between tokens
    tokens_per_s: float = 0.0  # decode throughput of one instance
    tokens_per_s_per_cost: float = 0.0  # tokens/s per unit of price per hour
    seq_len: int = 0  # mean context length the prediction assumed
    gpus: int = 0  # GPUs of one instance
    cost_per_hour: float = 0.0  # price of one instance per hour, catalog units


_SECTIONS = {"attention": AttentionSpec, "experts": ExpertSpec, "pipeline": PipelineSpec,
             "scheduler": SchedulerSpec, "slo": SLOSpec, "transport": TransportSpec, "serve": ServeSpec,
             "autoscale": AutoscalePolicy, "predicted": PredictedPerformance}


@dataclass
class Plan:
    model: str  # preset name, checkpoint directory, hub id in the local cache, or megainfer-demo
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # per request, prompt plus output; None: the model's max_position_embeddings
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    experts: ExpertSpec = field(default_factory=ExpertSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    slo: SLOSpec = field(default_factory=SLOSpec)
    transport: TransportSpec = field(default_factory=TransportSpec)
    serve: ServeSpec = field(default_factory=ServeSpec)
    autoscale: AutoscalePolicy | None = None  # replicas grown and retired on predicted TTFT
    predicted: PredictedPerformance | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise PlanError("model must name a preset or a checkpoint directory")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise PlanError(f"max_model_len must be positive, got {self.max_model_len}")
        if (self.attention.gpu == CPU) != (self.experts.gpu == CPU):
            raise PlanError("attention.gpu and experts.gpu must both be 'cpu' or both name GPU types")
        if self.pipeline.device_slots and (self.attention.tp > 1 or self.experts.tp > 1):
            raise PlanError(f"pipeline.device_slots serves nodes of tensor-parallel size 1 (attention.tp is "
                            f"{self.attention.tp}, experts.tp {self.experts.tp}): set it to false, or both tp to 1")
        if self.autoscale is not None and self.experts.rebalance is not None:
            raise PlanError("experts.rebalance re-places the experts of one replica; with autoscale's many "
                            "replicas it is not supported yet: drop one of the two sections")
        if self.autoscale is not None and self.serve.router != "predictive":
            raise PlanError(f"autoscale acts on predicted TTFT: set serve.router to 'predictive' "
                            f"(it is {self.serve.router!r})")

    @property
    def is_cpu(self) -> bool:
        return self.attention.gpu == CPU and self.experts.gpu == CPU

    @property
    def async_scheduling(self) -> bool:
        """`scheduler.async_scheduling`, null resolved: on unless the plan runs on CPUs."""
        chosen = self.scheduler.async_scheduling
        return not self.is_cpu if chosen is None else chosen

    def expert_assignment(self, model: ModelConfig) -> list[list[int]]:
        """Expert ids of each expert node: contiguous, equal shares."""
        self.check_model(model)
        per = model.num_experts // self.experts.nodes
        return [list(range(n * per, (n + 1) * per)) for n in range(self.experts.nodes)]

    def expert_replicas(self, model: ModelConfig) -> ExpertReplicas:
        """The deployment's first placement: `expert_assignment`, with room for
        `experts.redundant_per_node` more experts per node (empty until a re-placement)."""
        return ExpertReplicas.uniform(from_assignment(self.expert_assignment(model), self.expert_room(model)),
                                      model.num_layers)

    def expert_room(self, model: ModelConfig) -> int:
        """Weight rows per expert node and layer: its share of the experts plus `experts.redundant_per_node`."""
        return model.num_experts // self.experts.nodes + self.experts.redundant_per_node

    @property
    def places_experts(self) -> bool:
        """Can experts move or gain replicas while serving (slot tables on the attention side)?"""
        return self.experts.redundant_per_node > 0 or self.experts.rebalance is not None

    def check_model(self, model: ModelConfig) -> None:
        """Cross-checks that need the model's shapes."""
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise PlanError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                            f"({model.max_position_embeddings}); lower it or leave it out")
        check_tensor_parallel(model, self.attention.tp, self.experts.tp)
        nodes, per = self.experts.nodes, self.experts.experts_per_node
        if per is None:
            if model.num_experts % nodes:
                raise PlanError(f"experts.nodes ({nodes}) must divide the model's {model.num_experts} experts")
        elif nodes * per != model.num_experts:
            raise PlanError(f"experts.nodes x experts.experts_per_node = {nodes} x {per} = {nodes * per}, "
                            f"but the model has {model.num_experts} experts")

    # -- YAML ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for optional in ("max_model_len", "autoscale", "predicted"):
            if data[optional] is None:
                del data[optional]
        if not data["transport"]["rdma_devices"]:  # unset: left out
            del data["transport"]["rdma_devices"]
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(self.to_yaml())
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan is a mapping of sections, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{source}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
        if "model" not in data:
            raise PlanError(f"{source}: 'model' is required (a preset name or a checkpoint directory)")
        kwargs: dict[str, Any] = {"model": _coerce(data["model"], str, "model", source)}
        if "dtype" in data:
            kwargs["dtype"] = _coerce(data["dtype"], str, "dtype", source)
        if data.get("max_model_len") is not None:
            kwargs["max_model_len"] = _coerce(data["max_model_len"], int, "max_model_len", source)
        for name, section_cls in _SECTIONS.items():
            if data.get(name) is not None:
                kwargs[name] = _section(section_cls, data[name], name, source)
        try:
            return cls(**kwargs)
        except PlanError as exc:
            raise PlanError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise PlanError(f"{path}: not valid YAML{line} ({getattr(exc, 'problem', exc)})") from None
        return cls.from_dict(data, source=str(path))


# -- tensor parallelism the model's shapes allow ------------------------------------------------
# An attention rank holds whole heads: tp must divide the query heads and the KV heads (KV heads
# are never replicated across ranks, so a tp above num_kv_heads cannot run). An expert rank holds
# a 1/tp slice of every expert's intermediate dimension: tp must divide it. AttentionLayer and
# ExpertLayer require exactly this; the planner searches only these sizes and deploy refuses others.
SUGGESTED_TP_LIMIT = 8  # an error's fix names the valid sizes up to this (the GPUs of a node)


def attention_tp_fits(model: ModelConfig, tp: int) -> bool:
    """Whether `tp` attention ranks can split the model's query and KV heads evenly."""
    return model.num_heads % tp == 0 and model.num_kv_heads % tp == 0


def expert_tp_fits(model: ModelConfig, tp: int) -> bool:
    """Whether `tp` expert ranks can split each expert's intermediate dimension evenly."""
    return model.expert_intermediate_size % tp == 0


def check_tensor_parallel(model: ModelConfig, attention_tp: int, experts_tp: int) -> None:
    """PlanError naming attention.tp or experts.tp when the model's shapes do not split over it."""
    if not attention_tp_fits(model, attention_tp):
        fits = [tp for tp in range(1, SUGGESTED_TP_LIMIT + 1) if attention_tp_fits(model, tp)]
        raise PlanError(
            f"attention.tp {attention_tp} does not divide {model.name}'s {model.num_kv_heads} KV heads "
            f"({model.num_heads} query heads): each attention rank holds whole heads and KV heads are not "
            f"replicated; set attention.tp to {_one_of(fits)}")
    if not expert_tp_fits(model, experts_tp):
        fits = [tp for tp in range(1, SUGGESTED_TP_LIMIT + 1) if expert_tp_fits(model, tp)]
        raise PlanError(
            f"experts.tp {experts_tp} does not divide {model.name}'s expert intermediate size "
            f"{model.expert_intermediate_size} (config.json's moe_intermediate_size; Mixtral's intermediate_size): "
            f"each expert rank holds an equal slice of it; set experts.tp to {_one_of(fits)}")


def _one_of(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _coerce(value: Any, kind: type, key: str, source: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise PlanError(f"{source}: {key} must be {kind.__name__}, got {value!r}")
    return value


def _section(section_cls: type, data: Any, name: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise PlanError(f"{source}: {name} must be a mapping, got {data!r}")
    hints = get_type_hints(section_cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise PlanError(f"{source}: unknown key '{name}.{unknown[0]}'; {name} takes {', '.join(hints)}")
    kwargs = {}
    for key, value in data.items():
        kind = hints[key]
        optional = type(None) in getattr(kind, "__args__", ())
        if optional and value is None:
            kwargs[key] = None
            continue
        base = next(a for a in getattr(kind, "__args__", (kind,)) if a is not type(None))
        if dataclasses.is_dataclass(base):  # a nested section (experts.rebalance)
            kwargs[key] = _section(base, value, f"{name}.{key}", source)
            continue
        kwargs[key] = _coerce(value, base, f"{name}.{key}", source)
    try:
        return section_cls(**kwargs)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None
