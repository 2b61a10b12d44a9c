"""The deployment search: MegaScale-Infer's Algorithm 1 widened to GPU types.

For every (attention GPU, expert GPU) pair, every feasible tp_a and tp_e, every feasible
number of experts per expert node, every attention replica count n_a and every m in
1..N_m, binary-search the largest global batch B whose iteration latency meets the TBT
SLO and whose KV cache fits the n_a attention nodes (constraint 8); rank by throughput
per cost, watt or GPU. n_a is searched rather than solved from T_a = T_e (constraint 1)
because the KV cache often needs more attention nodes than balance would give; each
candidate reports its T_a/T_e so the balance stays visible. All configurations are
searched at once as numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megainfer.config import ModelConfig
from megainfer.errors import PlanError
from megainfer.plan import (attention_tp_fits, AttentionSpec, check_tensor_parallel, expert_tp_fits, ExpertSpec,
                            PipelineSpec, Plan, PredictedPerformance, RebalanceSpec, SchedulerSpec, SLOSpec)
from planner.catalog import GPU, Catalog
from planner.round_host_cost import host_bound
from planner.perf_model import PREFILL_CHUNK_TOKENS, PerfModel, Side

OBJECTIVES = ("cost", "power", "gpu")
TP_SIZES = (1, 2, 4, 8)
MAX_BATCH = 1 << 17  # sequences; the binary search's upper end
# Attention replica counts tried: every count up to 12, then coarser steps.
ATTENTION_NODES = tuple(range(1, 13)) + (14, 16, 20, 24, 32, 40, 48, 64, 96, 128)
SEARCH_STEPS = 18  # > log2(MAX_BATCH)


@dataclass
class Throughput:
    """What any deployment the planner judges delivers: the figures every ranking uses."""

    batch: int  # global batch B, sequences
    tbt: float  # time between tokens, seconds
    gpus: int
    cost_per_hour: float
    power_w: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.tbt

    @property
    def per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    @property
    def per_cost(self) -> float:
        return self.tokens_per_s / self.cost_per_hour

    @property
    def per_watt(self) -> float:
        return self.tokens_per_s / self.power_w

    def objective(self, name: str) -> float:
        return {"cost": self.per_cost, "power": self.per_watt, "gpu": self.per_gpu}[name]

    def as_dict(self) -> dict:
        return {**self.__dict__, "tokens_per_s": self.tokens_per_s, "per_gpu": self.per_gpu,
                "per_cost": self.per_cost, "per_watt": self.per_watt}


@dataclass
class Candidate(Throughput):
    """One disaggregated deployment and what the model predicts for it. Times in seconds."""

    attention_gpu: str
    expert_gpu: str
    tp_a: int
    tp_e: int
    n_a: int  # attention nodes
    expert_nodes: int
    experts_per_node: int
    m: int  # micro-batches
    t_a: float
    t_e: float
    t_c: float
    # One dense layer (DeepSeek's first) per micro-batch on an attention node, FFN included: no
    # exchange, so outside the pipeline (0: the model has none).
    t_dense: float = 0.0
    # The host's CPU time per M2N round on each side (planner/round_host_cost.py; 0: not charged).
    # Where it exceeds T_a or T_e the host sets the pace: charged in the TBT, and refused by the search.
    host_a: float = 0.0
    host_e: float = 0.0
    # Skewed expert popularity (planner/expert_popularity.py): spare expert slots per node, the
    # hottest expert node's load over the mean with them, and without any (and T_e then).
    redundant_per_node: int = 0
    expert_imbalance: float = 1.0
    expert_imbalance_no_redundancy: float = 1.0
    t_e_no_redundancy: float = 0.0

    @property
    def host_bound(self) -> bool:
        return self.host_a > self.t_a or self.host_e > self.t_e

    @property
    def t_f(self) -> float:
        return max(self.t_a, self.t_e)

    # Constraints (1)-(3) of §4.1, reported rather than enforced: the iteration model
    # already charges a plan that breaks them.
    @property
    def balance(self) -> float:
        """T_a / T_e: constraint (1) wants this near 1."""
        return self.t_a / self.t_e

    @property
    def network_hidden(self) -> bool:
        """Constraint (2): T_c < T_f."""
        return self.t_c < self.t_f

    @property
    def pipeline_full(self) -> bool:
        """Constraint (3): m·T_f >= 2·(T_f + T_c)."""
        return self.m * self.t_f >= 2 * (self.t_f + self.t_c) * (1 - 1e-9)

    def to_plan(self, model: str, dtype: str, tbt_slo_ms: float, seq_len: int) -> Plan:
        return Plan(
            model=model, dtype=dtype,
            attention=AttentionSpec(gpu=self.attention_gpu, tp=self.tp_a, nodes=self.n_a),
            experts=ExpertSpec(gpu=self.expert_gpu, tp=self.tp_e, nodes=self.expert_nodes,
                               experts_per_node=self.experts_per_node, redundant_per_node=self.redundant_per_node,
                               # Spare slots serve once a re-placement fills them: from the decode window.
                               rebalance=RebalanceSpec() if self.redundant_per_node else None),
            pipeline=PipelineSpec(micro_batches=self.m, global_batch=self.batch),
            # Each attention node must admit its share of the global batch, and one step must carry
            # every one of its decodes plus a prefill chunk.
            scheduler=SchedulerSpec(max_num_seqs=-(-self.batch // self.n_a),
                                    max_num_batched_tokens=-(-self.batch // self.n_a) + PREFILL_CHUNK_TOKENS),
            slo=SLOSpec(tbt_ms=tbt_slo_ms),
            predicted=PredictedPerformance(
                t_a_ms=round(self.t_a * 1e3, 4), t_e_ms=round(self.t_e * 1e3, 4), t_c_ms=round(self.t_c * 1e3, 4),
                tbt_ms=round(self.tbt * 1e3, 4), tokens_per_s=round(self.tokens_per_s, 1),
                tokens_per_s_per_cost=round(self.per_cost, 2), seq_len=seq_len, gpus=self.gpus,
                cost_per_hour=round(self.cost_per_hour, 4)))

    def as_dict(self) -> dict:
        return {**super().as_dict(), "balance": self.balance, "network_hidden": self.network_hidden,
                "pipeline_full": self.pipeline_full}


@dataclass
class SearchResult:
    candidates: list[Candidate]  # best first; the best m per structural configuration
    configurations: int  # configurations searched
    fastest: Candidate | None = None  # the lowest-TBT configuration (for an unmeetable SLO)
    notes: list[str] = field(default_factory=list)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model: ModelConfig, catalog: Catalog, attention_gpus: list[str], expert_gpus: list[str], *,
           tbt_slo_s: float, perf: PerfModel, max_micro_batches: int = 4, objective: str = "cost") -> SearchResult:
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if max_micro_batches < 1:
        raise PlanError(f"--max-micro-batches must be at least 1, got {max_micro_batches}")
    att_cfgs, exp_cfgs = _configurations(model, catalog, attention_gpus, expert_gpus, perf)
    grid = SearchGrid(model, perf, att_cfgs, exp_cfgs, max_micro_batches)
    first, best, batch, feasible = _largest_batches(grid, tbt_slo_s)
    fits = grid.capacity >= grid.m
    fastest = grid.candidate(int(np.argmin(np.where(fits, first["tbt"], np.inf))), first, grid.m) \
        if fits.any() else None
    throughput = batch / best["tbt"]
    score = {"cost": throughput / grid.cost, "power": throughput / grid.power, "gpu": throughput / grid.gpus}[objective]
    ranked = grid.best_per_configuration(np.where(feasible, score, -np.inf))
    candidates = [grid.candidate(int(i), best, batch) for i in ranked]
    return SearchResult(candidates=candidates, configurations=len(grid.m), fastest=fastest)


def _configurations(model: ModelConfig, catalog: Catalog, attention_gpus: list[str], expert_gpus: list[str],
                    perf: PerfModel) -> tuple[list[tuple[GPU, int]], list[tuple[GPU, int, int, int]]]:
    """The attention configurations (GPU, tp_a) and expert configurations (GPU, tp_e, experts per
    node, spare slots per node) whose weights fit; a PlanError that says why when one side has none."""
    att = list(dict.fromkeys(catalog[n] for n in attention_gpus))
    exp = list(dict.fromkeys(catalog[n] for n in expert_gpus))
    # Only the tp's the runtime can split the model over: heads for attention, the intermediate
    # size for experts (megainfer.plan.check_tensor_parallel, which deploy applies too).
    att_tps = [tp for tp in TP_SIZES if attention_tp_fits(model, tp)]
    exp_tps = [tp for tp in TP_SIZES if expert_tp_fits(model, tp)]
    att_cfgs = [(g, tp) for g in att for tp in att_tps
                if tp <= g.gpus_per_node and perf.max_sequences_per_attention_node(g.memory_bytes, tp) >= 1]
    # With skew priced, each expert configuration also for 1..redundant_experts spare slots per node
    # (held experts e + R, which must fit); a single expert node has nothing to balance.
    spare = range(perf.redundant_experts + 1) if perf.skew is not None else range(1)
    exp_cfgs = [(g, tp, e, r) for g in exp for tp in exp_tps if tp <= g.gpus_per_node
                for e in divisors(model.num_experts) for r in spare
                if (r == 0 or e < model.num_experts) and perf.expert_node_fits(g.memory_bytes, tp, e + r)]
    _check_fits(model, perf, att, exp, att_cfgs, exp_cfgs, max(att_tps))
    return att_cfgs, exp_cfgs


def _largest_batches(grid: SearchGrid, tbt_slo_s: float) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """Binary-search every row's largest global batch whose TBT meets the SLO, whose KV cache fits
    and (with a host model) whose rounds the host can post. Returns the figures at one sequence per
    micro-batch, the figures at the batch found, that batch, and which rows are feasible."""
    host = grid.perf.host
    lo = grid.m.copy()  # one sequence per micro-batch: does even that meet the SLO and fit?
    first = grid.evaluate(lo)
    feasible = (first["tbt"] <= tbt_slo_s) & (grid.capacity >= grid.m)
    hi = np.where(feasible, np.maximum(grid.capacity, lo), lo)
    for _ in range(int(np.log2(max(hi.max(), 2))) + 1):  # largest B in [lo, hi] with tbt <= SLO
        mid = np.floor((lo + hi + 1) / 2)
        at = grid.evaluate(mid)
        ok = at["tbt"] <= tbt_slo_s
        if host is not None:  # a batch whose rounds the host cannot post is no answer either
            ok &= ~host_bound(at["t_a"], at["t_e"], at["host_a"], at["host_e"])
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid - 1)
    best = grid.evaluate(lo)
    if host is not None:  # the host cannot post these rounds within the micro-batch's compute
        feasible &= ~host_bound(best["t_a"], best["t_e"], best["host_a"], best["host_e"])
    return first, best, lo, feasible


class SearchGrid:
    """Every row the search judges, one per (attention config, expert config, n_a, m), as flat
    numpy arrays: the per-configuration constants are computed once on the small per-side arrays
    and spread over the rows, so a batch per row is evaluated in a few array operations."""

    def __init__(self, model: ModelConfig, perf: PerfModel, att_cfgs: list[tuple[GPU, int]],
                 exp_cfgs: list[tuple[GPU, int, int, int]], max_micro_batches: int) -> None:
        self.model, self.perf, self.att_cfgs, self.exp_cfgs = model, perf, att_cfgs, exp_cfgs
        e_per_cfg = np.array([e for _, _, e, _ in exp_cfgs], dtype=np.float64)
        held_cfg = np.array([e + r for _, _, e, r in exp_cfgs], dtype=np.float64)  # experts each node holds
        # Skew: each row's T_e is the hottest node's, b_e times this (1 for uniform routing).
        self.hot_cfg = np.array([perf.hot_factor(e, r) for _, _, e, r in exp_cfgs], dtype=np.float64)
        a_side = perf.sides(att_cfgs, "attention")
        e_side = perf.sides([(g, tp) for g, tp, _, _ in exp_cfgs], "experts", held_cfg)
        step_pieces = perf.step_lines(att_cfgs)
        a_pieces = perf.attention_pieces(a_side)
        e_pieces = perf.expert_pieces(e_side, held_cfg)
        seqs_cfg = perf.max_sequences_per_attention_node(np.array([g.memory_bytes for g, _ in att_cfgs]), a_side.tp)
        hit_cfg = perf.node_hit_probability(e_per_cfg)

        n_a_values = np.array(ATTENTION_NODES, dtype=np.float64)
        m_values = np.arange(1, max_micro_batches + 1, dtype=np.float64)
        ia, ie, i_n, i_m = (x.reshape(-1) for x in np.meshgrid(
            np.arange(len(att_cfgs)), np.arange(len(exp_cfgs)), np.arange(len(n_a_values)), np.arange(len(m_values)),
            indexing="ij"))
        self.ia, self.ie = ia, ie
        self.n_a, self.m = _f32(n_a_values[i_n]), _f32(m_values[i_m])
        self.n_e = model.num_experts / e_per_cfg[ie]
        self.hot = _f32(self.hot_cfg[ie])
        # Only the network needs per-row hardware figures.
        self.a_rows = Side(nic=a_side.nic[ia], tp=a_side.tp[ia])
        self.e_rows = Side(nic=e_side.nic[ie], tp=e_side.tp[ie])
        self.a_lin = [(_f32(slope[ia]), _f32(const[ia])) for slope, const in a_pieces]
        self.d_lin = [(_f32(slope[ia]), _f32(const[ia])) for slope, const in a_side.dense_lines]  # [] without dense layers
        self.e_lin = [(_f32(slope[ie]), _f32(const[ie])) for slope, const in e_pieces]
        self.step_lin = [(_f32(slope[ia]), _f32(const[ia])) for slope, const in step_pieces]
        # T_c = msg / util(msg) * seconds_per_byte, msg = b_a * bytes_per_token_sent
        self.bytes_per_token_sent = _f32(hit_cfg[ie] * perf.token_bytes / (self.a_rows.tp * self.e_rows.tp))
        self.seconds_per_byte = _f32(perf.transfer_seconds_per_byte(self.a_rows, self.e_rows, self.n_a, self.n_e))
        # The host's messages, per token.
        self.record_bytes_per_rank = _f32(hit_cfg[ie] * perf.record_bytes / self.a_rows.tp)
        self.capacity = _f32(np.minimum(self.n_a * seqs_cfg[ia], MAX_BATCH))  # sequences whose KV fits
        a_gpus, e_gpus = self.n_a * self.a_rows.tp, self.n_e * self.e_rows.tp
        self.gpus = a_gpus + e_gpus
        self.cost = a_gpus * _per_gpu(att_cfgs, ia, "price") + e_gpus * _per_gpu(exp_cfgs, ie, "price")
        self.power = a_gpus * _per_gpu(att_cfgs, ia, "power_w") + e_gpus * _per_gpu(exp_cfgs, ie, "power_w")

    def evaluate(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """T_a, T_e, T_c and the TBT of every row at its global `batch` (and the host's round
        times, with a host model)."""
        model, perf, n_a, m = self.model, self.perf, self.n_a, self.m
        g = batch / m  # tokens of one micro-batch across all attention nodes
        b_a = g / n_a
        b_e = g * (model.top_k / model.num_experts) * self.hot
        t_a = np.maximum.reduce([s * b_a + c for s, c in self.a_lin])
        t_e = np.maximum.reduce([s * b_e + c for s, c in self.e_lin])
        t_d = np.maximum.reduce([s * b_a + c for s, c in self.d_lin]) if self.d_lin else 0.0
        msg = b_a * self.bytes_per_token_sent
        t_c = msg / _f32(perf.utilization(msg)) * self.seconds_per_byte
        step_s = np.maximum.reduce([s * (batch / n_a) + c for s, c in self.step_lin])
        if perf.host is None:
            return dict(t_a=t_a, t_e=t_e, t_c=t_c, t_d=t_d, tbt=perf.iteration_time(t_a, t_e, t_c, m, step_s, t_d))
        # An attention rank's round: its n_e expert nodes; an expert node's: every attention rank.
        # A message is a rank's share of a node's records, whole (an expert node's leader takes
        # it and shares it with its ranks), as `bench host` measures it.
        host_msg = b_a * self.record_bytes_per_rank
        host_a = _f32(perf.host.attention.round_s(self.n_e, host_msg))
        host_e = _f32(perf.host.expert.round_s(n_a * self.a_rows.tp, host_msg))
        tbt = perf.iteration_time(np.maximum(t_a, host_a), np.maximum(t_e, host_e), t_c, m, step_s, t_d)
        return dict(t_a=t_a, t_e=t_e, t_c=t_c, t_d=t_d, tbt=tbt, host_a=host_a, host_e=host_e)

    def best_per_configuration(self, score: np.ndarray) -> np.ndarray:
        """The best-scoring row (n_a, m) of each structural configuration (GPU pair, tp's, experts
        per node) with a finite score, best first: sorted by configuration, then by score, each
        configuration's first row."""
        group = self.ia * len(self.exp_cfgs) + self.ie
        order = np.lexsort((-score, group))
        first_of_group = order[np.r_[True, group[order][1:] != group[order][:-1]]]
        first_of_group = first_of_group[np.isfinite(score[first_of_group])]
        return first_of_group[np.argsort(-score[first_of_group], kind="stable")]

    def candidate(self, i: int, values: dict[str, np.ndarray], batch: np.ndarray) -> Candidate:
        """Row `i` at `batch`, with its `evaluate` figures `values`."""
        (ga, tp_a), (ge, tp_e, e, r) = self.att_cfgs[self.ia[i]], self.exp_cfgs[self.ie[i]]
        skew = self._skew_figures(i, ge, tp_e, e, r, float(batch[i]))
        return Candidate(
            attention_gpu=ga.name, expert_gpu=ge.name, tp_a=tp_a, tp_e=tp_e, n_a=int(self.n_a[i]),
            expert_nodes=int(self.n_e[i]), experts_per_node=e, m=int(self.m[i]), batch=int(batch[i]),
            t_a=float(values["t_a"][i]), t_e=float(values["t_e"][i]), t_c=float(values["t_c"][i]),
            t_dense=float(np.broadcast_to(values["t_d"], values["t_a"].shape)[i]), tbt=float(values["tbt"][i]), gpus=int(self.gpus[i]), cost_per_hour=float(self.cost[i]),
            power_w=float(self.power[i]),
            host_a=float(values["host_a"][i]) if "host_a" in values else 0.0,
            host_e=float(values["host_e"][i]) if "host_e" in values else 0.0, **skew)

    def _skew_figures(self, i: int, gpu: GPU, tp: int, e: int, r: int, batch: float) -> dict:
        """Row `i`'s spare slots, the hottest node's imbalance with them, and without any: the
        imbalance and T_e the same configuration would have with no spare slot."""
        perf = self.perf
        b_e = batch / self.m[i] * self.model.top_k / self.model.num_experts
        side = perf.sides([(gpu, tp)], "experts", np.array([e], dtype=np.float64))
        t_e0 = float(perf.expert_time(side, b_e * perf.hot_factor(e, 0), np.array([e], dtype=np.float64))[0])
        return dict(redundant_per_node=r, expert_imbalance=perf.expert_imbalance(e, r),
                    expert_imbalance_no_redundancy=perf.expert_imbalance(e, 0), t_e_no_redundancy=t_e0)


def _f32(x) -> np.ndarray:
    """float32 is exact for batches below 2**24 and halves the memory traffic of each step."""
    return np.asarray(x, dtype=np.float32)


def _per_gpu(cfgs: list[tuple], idx: np.ndarray, figure: str) -> np.ndarray:
    """A GPU figure (price, power_w) of each row's configuration in `cfgs`."""
    return np.array([getattr(c[0], figure) for c in cfgs])[idx]


def _check_fits(model: ModelConfig, perf: PerfModel, att: list[GPU], exp: list[GPU], attention_fits, expert_fits,
                max_tp_a: int) -> None:
    if not attention_fits:
        need = perf.attention_weight_bytes() + perf.kv_bytes_per_sequence()
        heads = f" (its {model.num_kv_heads} KV heads split over at most {max_tp_a})" \
            if max_tp_a < max(TP_SIZES) else ""
        raise PlanError(
            f"{model.name}: the attention half does not fit any TP size on {', '.join(g.name for g in att)}: "
            f"it needs {need / 1e9:.1f} GB (weights and one sequence's KV cache) per node, "
            f"more than {max_tp_a} GPUs of one node hold{heads}; choose GPUs with more memory")
    if not expert_fits:
        one = model.expert_params * model.num_moe_layers * perf.dtype_bytes
        raise PlanError(
            f"{model.name}: one expert ({one / 1e9:.1f} GB across its {model.num_moe_layers} MoE layers) does not fit "
            f"any TP size on {', '.join(g.name for g in exp)}; choose GPUs with more memory")


def evaluate_plan(model: ModelConfig, perf: PerfModel, catalog: Catalog, *, attention_gpu: str, tp_a: int, n_a: int,
                  expert_gpu: str, tp_e: int, experts_per_node: int, m: int, batch: int,
                  redundant_per_node: int = 0) -> Candidate:
    """The model's prediction for one fixed deployment (no search, no SLO); with `perf.skew`,
    T_e is the hottest expert node's, its `redundant_per_node` spare slots filled by the
    redundancy plan."""
    if model.num_experts % experts_per_node:
        raise PlanError(f"experts_per_node ({experts_per_node}) must divide the model's {model.num_experts} experts")
    check_tensor_parallel(model, tp_a, tp_e)
    ga, ge = catalog[attention_gpu], catalog[expert_gpu]
    a_side = perf.sides([(ga, tp_a)], "attention")
    held = experts_per_node + redundant_per_node
    e_side = perf.sides([(ge, tp_e)], "experts", [held])
    expert_nodes = model.num_experts // experts_per_node
    b_a = batch / m / n_a
    t_a = float(perf.attention_time(a_side, b_a)[0])
    t_d = float(perf.dense_layer_time(a_side, b_a)[0])
    b_e = batch / m * model.top_k / model.num_experts
    t_e = float(perf.expert_time(e_side, b_e * perf.hot_factor(experts_per_node, redundant_per_node), held)[0])
    t_c = float(perf.transfer_time(a_side, e_side, b_a, n_a, expert_nodes, experts_per_node)[0])
    step_s = max(float(s[0]) * batch / n_a + float(c[0]) for s, c in perf.step_lines([(ga, tp_a)]))
    host_a = host_e = 0.0
    if perf.host is not None:  # as the search charges it
        msg = b_a * perf.node_hit_probability(np.array([experts_per_node], dtype=np.float64))[0] * perf.record_bytes \
            / tp_a
        host_a = float(perf.host.attention.round_s(expert_nodes, msg))
        host_e = float(perf.host.expert.round_s(n_a * tp_a, msg))
    return Candidate(
        attention_gpu=ga.name, expert_gpu=ge.name, tp_a=tp_a, tp_e=tp_e, n_a=n_a, expert_nodes=expert_nodes,
        experts_per_node=experts_per_node, m=m, batch=batch, t_a=t_a, t_e=t_e, t_c=t_c, t_dense=t_d,
        host_a=host_a, host_e=host_e,
        redundant_per_node=redundant_per_node, expert_imbalance=perf.expert_imbalance(experts_per_node,
                                                                                      redundant_per_node),
        expert_imbalance_no_redundancy=perf.expert_imbalance(experts_per_node, 0),
        tbt=float(perf.iteration_time(max(t_a, host_a), max(t_e, host_e), t_c, m, step_s, t_d)),
        gpus=n_a * tp_a + expert_nodes * tp_e,
        cost_per_hour=n_a * tp_a * ga.price + expert_nodes * tp_e * ge.price,
        power_w=n_a * tp_a * ga.power_w + expert_nodes * tp_e * ge.power_w)
