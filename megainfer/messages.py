"""Every type that crosses a process boundary, declared here and nowhere else (as SGLang's
`io_struct.py`). Each crosses as the dataclass or enum it is: Ray pickles it, the driver reads
attributes, never keys.

| type             | from                         | to                                  | carries                                   |
|------------------|------------------------------|-------------------------------------|-------------------------------------------|
| `Plan`           | driver (deploy)              | every node actor, at construction   | the plan (megainfer/plan.py)              |
| `SamplingParams` | driver frontend              | attention node (`add_request`)      | a request's sampling settings             |
| `RequestDelta`   | attention node / engine loop | frontend -> the request's stream    | one request's tokens of one step, or its end |
| `DeltaBatch`     | attention node (`poll`)      | driver (`DeltaDelivery`) -> streams | the deltas after a cursor, as `DeltaColumns` |
| `DeltaColumns`   | inside `DeltaBatch`; `Engine.step_columns` | `StreamRegistry.deliver_batch` | a step's plain deltas as columns, the others whole |
| `Logprob`        | inside `RequestDelta`        | the servers, `LLM`                  | one token's log-probability and rank      |
| `RequestMetrics` | inside a request's last `RequestDelta` | the servers' metrics      | queue, prefill, decode times; token counts |
| `NodeHealth`     | every node actor (`health`)  | node group (supervision, info)      | status, error, what the node is doing     |
| `RankPlacement`  | every node actor (`placement`) | node group (`placements`, tests)  | the Ray node, GPU type and GPUs of a rank |
| `NodeStats`      | attention leader (`stats`)   | frontend (metrics endpoint, benches)| engine counters and M2N histograms        |
| `EngineStats`    | inside `NodeStats`; `EngineBackend` | metrics endpoint, benches    | the engine's counters, kernel report, expert load |
| `ExpertLoad`     | inside `EngineStats`         | metrics endpoint, energy estimate   | experts a step activated, bytes read      |
| `ExpertLoadReport` | inside `EngineStats`       | rebalancer, metrics, `/admin/experts/load` | each (layer, expert)'s pairs over the window |
| `StagedPlacement` | every expert rank (`stage_experts`) | rebalancer                | what a re-placement's staging loaded       |
| `RebalanceReport` | the rebalancer (driver)     | `/admin/experts/rebalance`, `bench eplb` | what a re-placement moved, when it switched |
| `NodeResources`  | every node actor (`resources`) | `bench soak`, leak checks         | resident memory, KV blocks, M2N slots held |
| `NodeState`      | attention leader (`state`)   | frontend -> router                  | scheduler snapshot, measured steps        |
| `StepSample`     | inside `NodeState`           | router's step-time model            | one step's work and seconds               |
| `SchedulingKnobs`| inside `NodeState`           | router's forecast                   | the scheduler settings to reproduce       |
| `LayeredSettings`| inside `SchedulingKnobs`     | router's forecast                   | a layered-prefill policy's settings       |
| `RequestLengths` | inside `NodeState`           | router's forecast                   | one request's prompt, tokens, cached, max_tokens |
| `PrefixSummary`  | inside `NodeState`           | frontend's `PrefixIndex` -> routers | the node's cached prefix keys, added and dropped |
| `HistogramSnapshot` | inside `NodeStats`        | metrics endpoint                    | bucket counts of a latency histogram      |
| `NodeTimeline`   | every node actor (`timeline`) | `bench pipeline` (table, Gantt)    | the node's spans: steps, computes, waits, messages |
| `Span`           | inside `NodeTimeline`        | `bench pipeline`                    | one interval or instant on the node's clock |

Enums used in them: `FinishReason`, `ErrorCode`, `NodeStatus`, `NodeRole`, `SpanKind`. `NodeLoad` is what the
frontend derives from a `NodeState` for the heuristic routers (it stays in the driver).

Declared elsewhere because their packages must not import megainfer:
- the M2N message header (`transport/wire.py`): attention rank <-> expert node, every
  (layer, micro-batch); its byte layout is documented there;
- a tensor-parallel step (`megainfer/disagg/step_sync.py`): attention leader -> its follower
  ranks over the node's gloo control group, an int64 tensor whose layout is documented there
  (torch.distributed carries tensors, not objects);
- each node's runtime configuration (`deploy/runtime_config.py`: `AttentionRuntime`,
  `ExpertRuntime`): driver -> node actor at construction, beside the plan;
- the gRPC messages (`megainfer/v1/inference.proto`): client <-> server;
- a node's kernel report (`kernels/startup.py`: `KernelReport`, its `choice.Decision`s): every
  node, at start, inside `EngineStats` and `RankPlacement` (which implementation each operator
  runs, decided before serving).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from kernels.startup import KernelReport  # no import at run time: the CLI's --help and plan stay torch-free


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's max length reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # this request failed; the others go on

    def __str__(self) -> str:
        return self.value


class ErrorCode(str, enum.Enum):
    """Why a request failed (with FinishReason.ERROR)."""

    UNAVAILABLE = "unavailable"  # the deployment could not serve it now: retry later
    INTERNAL = "internal"  # a bug or a request the model could not process

    def __str__(self) -> str:
        return self.value


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`)."""

    logprob: float  # natural log, of the distribution the token was sampled from before filtering
    rank: int  # 1 for the most likely token of the position
    decoded_token: str | None = None  # the token's text alone (None without a tokenizer)


# One position: token id -> its Logprob. The sampled (or prompt) token comes first, then the
# top-k of the position by rank (vLLM's shape: the chosen token appears once even when in the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """How one request's time was spent, on its last delta (what the servers' histograms observe)."""

    prompt_tokens: int
    generation_tokens: int
    queued_s: float  # arrival to first scheduled
    prefill_s: float  # first scheduled to first generated token
    decode_s: float  # first generated token to the last
    e2e_s: float  # arrival to the end
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache


@dataclass
class RequestDelta:
    """One request's progress in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # text completed by these tokens ("" while a character is incomplete or may start a stop string)
    finished: bool = False
    finish_reason: FinishReason | None = None  # once finished
    error: str | None = None  # why it failed, when finish_reason is ERROR
    error_code: ErrorCode | None = None  # when it failed
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when the request asked for logprobs
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first delta only, when asked; None for position 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's field)
    metrics: RequestMetrics | None = None  # on the last delta of a request that ran

    @classmethod
    def failure(cls, request_id: str, error: str, code: ErrorCode = ErrorCode.UNAVAILABLE,
                new_token_ids: list[int] | None = None) -> "RequestDelta":
        """The last delta of a request that failed."""
        return cls(request_id, new_token_ids or [], "", True, FinishReason.ERROR, error, code)


class NodeStatus(str, enum.Enum):
    WIRING = "wiring"  # starting, loading weights or waiting for its data plane
    SERVING = "serving"
    BROKEN = "broken"  # its data plane failed; waiting to be re-wired
    DEAD = "dead"  # did not answer (the actor died or hangs); Ray may be restarting it

    def __str__(self) -> str:
        return self.value


class NodeRole(str, enum.Enum):
    ATTENTION = "attention"
    EXPERT = "expert"
    ENGINE = "engine"  # a colocated engine: both halves in one process

    def __str__(self) -> str:
        return self.value


@dataclass
class NodeHealth:
    """A node actor's answer to `health()` (one per rank; followers have rank > 0)."""

    name: str
    role: NodeRole
    status: NodeStatus
    rank: int = 0  # within the node's tensor-parallel group; 0 leads
    error: str | None = None  # why it is broken or dead
    running: int = 0  # attention leader: requests running, waiting
    waiting: int = 0
    experts: list[int] = field(default_factory=list)  # expert node: the expert ids it holds (first layer)
    steps: int = 0  # expert node: steps served, tokens computed
    tokens: int = 0
    pairs: list[int] = field(default_factory=list)  # expert node: (token, expert) pairs computed, per layer, so far
    placement_version: int = 0  # expert node: the expert placement it serves (deploy/expert_rebalance.py)
    timing: dict[str, float] = field(default_factory=dict)  # seconds per phase, summed over steps
    device_slot_peers: list[str] = field(default_factory=list)  # peers reached device to device (device_slots.py)

    @property
    def serving(self) -> bool:
        return self.status is NodeStatus.SERVING

    def detail(self) -> str:
        """One line for ServerInfo."""
        if not self.serving:
            return self.error or ""
        if self.rank:
            return "tensor-parallel follower"
        slots = f", device slots with {', '.join(self.device_slot_peers)}" if self.device_slot_peers else ""
        if self.role is NodeRole.ATTENTION:
            return f"running {self.running}, waiting {self.waiting}{slots}"
        return f"experts {self.experts}, steps {self.steps}{slots}"


@dataclass
class RankPlacement:
    """Where one rank's actor runs, as Ray placed it."""

    name: str
    node_id: str  # the Ray node (host) it runs on
    accelerator_type: str | None  # that host's GPU type as Ray declares it (accelerator_type:<GPU>)
    gpu_ids: list[str] = field(default_factory=list)  # the GPUs Ray gave it (CUDA_VISIBLE_DEVICES)
    links: dict[str, str] = field(default_factory=dict)  # M2N peer -> the backend that pair uses (shm, nixl, ...)
    kernels: KernelReport | None = None  # which implementation each of the rank's operators runs


@dataclass
class DeltaColumns:
    """Token deltas in columns, in order: the plain ones (one new token and its text, nothing
    else: almost every delta of a step) as three lists, the others whole, each with the number of
    plain deltas before it, so each request's order holds. What an engine step gives
    (`Engine.step_columns`) and an attention node's poll answer carries: lists of str and int
    pickle and unpickle in C, and the driver fans them out to streams without an object per
    delta (`StreamRegistry.deliver_batch`)."""

    request_ids: list[str] = field(default_factory=list)  # the plain deltas, in order
    token_ids: list[int] = field(default_factory=list)  # each one's new token
    texts: list[str] = field(default_factory=list)  # each one's new text
    others: list[tuple[int, RequestDelta]] = field(default_factory=list)  # (plain deltas before it, delta)

    @classmethod
    def of(cls, deltas: list[RequestDelta]) -> "DeltaColumns":
        columns = cls()
        ids, tokens, texts, others = columns.request_ids, columns.token_ids, columns.texts, columns.others
        for d in deltas:
            if d.finished or len(d.new_token_ids) != 1 or d.logprobs is not None or d.prompt_logprobs is not None \
                    or d.stop_reason is not None or d.metrics is not None or d.error is not None:
                others.append((len(ids), d))
                continue
            ids.append(d.request_id)
            tokens.append(d.new_token_ids[0])
            texts.append(d.new_text)
        return columns

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.others)

    @property
    def deltas(self) -> list[RequestDelta]:
        """Every delta as an object, in order (the offline API, warm-up, tests)."""
        plain = list(map(RequestDelta, self.request_ids, ([t] for t in self.token_ids), self.texts))
        out: list[RequestDelta] = []
        taken = 0
        for before, delta in self.others:
            out += plain[taken:before]
            out.append(delta)
            taken = before
        return out + plain[taken:]

    def extend(self, more: "DeltaColumns") -> None:
        """Append `more`'s deltas after these."""
        offset = len(self.request_ids)
        self.request_ids += more.request_ids
        self.token_ids += more.token_ids
        self.texts += more.texts
        self.others += [(before + offset, delta) for before, delta in more.others]

    def without_places(self, places: list[int]) -> "DeltaColumns":
        """These deltas without the plain ones at `places` (the others keep their order)."""
        dropped = set(places)
        kept_before = [0]  # plain deltas kept before each place
        for place in range(len(self.request_ids)):
            kept_before.append(kept_before[-1] + (place not in dropped))
        keep = [p for p in range(len(self.request_ids)) if p not in dropped]
        return DeltaColumns([self.request_ids[p] for p in keep], [self.token_ids[p] for p in keep],
                            [self.texts[p] for p in keep], [(kept_before[b], d) for b, d in self.others])


@dataclass
class DeltaBatch:
    """An attention node's answer to a poll: the token deltas after the poller's cursor, and the
    cursor to acknowledge them with. Deltas stay on the node until acknowledged, so a poll whose
    answer never reached the poller (it timed out while the node was stopped, and ran later)
    loses nothing: the next poll returns them again. `incarnation` names the node's process; a
    restarted node starts counting anew."""

    incarnation: str
    last: int  # sequence number of the last delta in the batch (the cursor if there are none)
    columns: DeltaColumns = field(default_factory=DeltaColumns)

    def __len__(self) -> int:
        return len(self.columns)

    @property
    def deltas(self) -> list[RequestDelta]:
        return self.columns.deltas


@dataclass
class NodeResources:
    """What one rank holds, for leak checks and soak reports (`resources()` on every node actor):
    its process's resident memory, its KV blocks (attention leaders; 0 elsewhere) and its M2N
    slots. On an idle deployment every block and slot is free: anything else is a leak."""

    name: str
    role: NodeRole
    rank: int = 0
    pid: int = 0
    rss_bytes: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    slots_held: int = 0  # received messages this rank has not released yet
    slots_unreleased: int = 0  # messages this rank sent whose slot the peer has not released yet
    requests: int = 0  # requests it holds (running, waiting or queued; attention leaders)

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def idle(self) -> bool:
        """Holds nothing: no request, KV block or M2N slot."""
        return not (self.requests or self.kv_blocks_used or self.slots_held or self.slots_unreleased)


@dataclass
class HistogramSnapshot:
    """Bucket counts of a latency histogram (seconds), summable across nodes with the same bounds."""

    bounds: list[float]
    buckets: list[int]  # len(bounds) + 1: the last counts everything above the last bound
    sum: float = 0.0


@dataclass
class ExpertLoad:
    """Experts one step activated and the expert-weight bytes that step had to read."""

    activated: list[list[int]]  # per layer, the expert ids that received at least one token
    bytes_read: int  # activated (layer, expert) pairs x bytes of one expert's weights


@dataclass
class ExpertLoadReport:
    """Tokens routed to each (layer, expert) over an engine's last `window` steps, decode steps
    and steps with prompt tokens apart (megainfer/engine/expert_load_window.py): what a re-placement of
    the experts is computed from (deploy/expert_rebalance.py). A disaggregated attention node's
    window holds the expert nodes' own counts, the whole deployment's (`node_pairs` set); a
    colocated engine's, its gating kernel's."""

    decode: np.ndarray  # [layers, experts] int64, (token, expert) pairs of the window's decode-only steps
    prefill: np.ndarray  # [layers, experts] int64, those of its steps with prompt tokens
    decode_steps: int
    prefill_steps: int
    # [layers, expert nodes] int64: the pairs each expert node computed over the window, every
    # step; None where the counts are the gating kernel's (no expert node counted them)
    node_pairs: np.ndarray | None = None

    def of(self, phase: str) -> np.ndarray:
        """The loads of `phase`: "decode", "prefill" or "all"."""
        if phase == "decode":
            return self.decode
        if phase == "prefill":
            return self.prefill
        return self.decode + self.prefill

    @classmethod
    def deployment(cls, reports: "list[ExpertLoadReport]") -> "ExpertLoadReport":
        """The deployment's window from its attention leaders' reports: where the expert nodes
        counted, any one holds all of it (the first); else their gating counts added up."""
        if reports[0].node_pairs is not None:
            return reports[0]
        return cls(sum(r.decode for r in reports), sum(r.prefill for r in reports),
                   sum(r.decode_steps for r in reports), sum(r.prefill_steps for r in reports))


@dataclass
class StagedPlacement:
    """An expert rank's answer to a re-placement's stage: its new experts loaded, not yet serving."""

    version: int
    bytes_loaded: int  # weights of the experts that moved onto this rank (its slice of them)
    experts_loaded: int  # (layer, slot)s whose expert changed
    seconds: float


@dataclass
class RebalanceReport:
    """One re-placement of a deployment's experts (deploy/expert_rebalance.py)."""

    version: int  # the placement it made (or tried to)
    phase: str  # whose window loads it balanced: decode, prefill or all
    window_tokens: int  # (token, expert) pairs in that window
    imbalance_before: float  # busiest expert node over the mean, the window's loads on the old placement
    imbalance_after: float  # the same loads on the new placement (predicted: the shares as planned)
    bytes_moved: int = 0  # expert weights loaded onto their new nodes (every rank's slice)
    experts_moved: int = 0  # (layer, slot)s whose expert changed
    stage_s: float = 0.0  # the slowest rank's loading, while serving
    switch_step: int = -1  # the step every rank switched at (-1: it did not)
    switch_s: float = 0.0  # from the staging done to every node past the switch step (serving all along)
    seconds: float = 0.0  # the whole re-placement, window to every node past the switch
    error: str = ""  # why the old placement still serves, where it does

    def summary(self) -> str:
        if self.error:
            return f"expert placement {self.version} not made: {self.error}"
        return (f"expert placement {self.version}: imbalance {self.imbalance_before:.2f} -> "
                f"{self.imbalance_after:.2f} on {self.window_tokens} {self.phase} pairs; {self.experts_moved} "
                f"experts moved ({self.bytes_moved / 2**20:.1f} MiB, staged in {self.stage_s:.2f} s), switched "
                f"at step {self.switch_step}, {self.seconds:.2f} s in all")


@dataclass
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0  # prompt, recomputed and decode tokens run through the model
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_kv_blocks: int = 0
    expert_tokens: list[list[int]] = field(default_factory=list)  # cumulative [layer][expert] routed tokens
    expert_activations: int = 0  # cumulative activated (layer, expert) pairs over steps
    expert_bytes_read: int = 0  # cumulative expert-weight bytes read
    last_step_expert_load: ExpertLoad | None = None
    expert_window: ExpertLoadReport | None = None  # routed tokens over the last steps (EngineConfig.expert_load_window)
    energy_j: float | None = None  # GPU energy since the engine started (None: unavailable, see below)
    energy_per_token_j: float | None = None
    energy_unavailable: str = ""  # why energy is unavailable, where it is
    kernels: KernelReport | None = None  # which implementation each operator runs (decided at start)
    kernel_builds_while_serving: int = 0  # Triton variants built after start: steps that stalled (want 0)
    prefix_caching: bool = False  # automatic prefix caching is on
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's counter)
    prefix_cache_hits: int = 0  # of those, tokens found cached


@dataclass
class NodeStats:
    """An attention leader's counters: its engine's, and its M2N latencies per message."""

    engine: EngineStats
    m2n_send: HistogramSnapshot  # one send to one expert node
    m2n_receive_wait: HistogramSnapshot  # the wait for one expert node's answer




@dataclass(frozen=True)
class StepSample:
    """One step's work (what the step-time model reads) and, once run, its seconds."""

    tokens: int  # tokens computed, every sequence together
    seqs: int  # sequences in the step
    kv_tokens: float  # cached tokens attention reads, summed over sequences
    score_pairs: float  # query-key pairs attention scores (causal inside a chunk)
    seconds: float = 0.0
    # The replica-wide number of the step on a disaggregated node, whose attention nodes all run
    # every numbered step together; -1 on a colocated engine.
    step: int = -1
    # Nodes in lockstep: the largest of any one node's (tokens, kv_tokens, score_pairs), since
    # the attention nodes compute side by side; None for one node's step (its own work).
    peak: tuple[float, float, float] | None = None

    @classmethod
    def lockstep(cls, samples: list["StepSample"]) -> "StepSample":
        """One step of nodes in lockstep: their work adds up (the expert nodes compute it all),
        the busiest node's share bounds the attention half, and the step lasts as long as the
        slowest node saw it last."""
        return cls(sum(s.tokens for s in samples), sum(s.seqs for s in samples),
                   sum(s.kv_tokens for s in samples), sum(s.score_pairs for s in samples),
                   max(s.seconds for s in samples), samples[0].step,
                   (float(max(s.tokens for s in samples)), max(s.kv_tokens for s in samples),
                    max(s.score_pairs for s in samples)))

    def work(self) -> tuple[float, float, float, float]:
        """(tokens, seqs, kv_tokens, score_pairs): one node's row in a lockstep forecast."""
        return (float(self.tokens), float(self.seqs), self.kv_tokens, self.score_pairs)


@dataclass(frozen=True)
class LayeredSettings:
    """A layered-prefill policy's settings."""

    num_layers: int  # layers of the model, which the groups cut
    group_tokens: int  # cohort tokens per layer group when the group count is derived
    num_layer_groups: int | None  # fixed number of groups; None: derived from the cohort's tokens
    chunk_tokens: int  # most prompt tokens one cohort carries
    # Derived groups, at most this many (the layered-prefill paper's --num-stages): a cohort
    # then fills chunk_tokens and a big one passes in fewer, fuller groups.
    max_layer_groups: int | None = None
    # With max_layer_groups: (most cohort tokens, groups) rows in rising order; a cohort takes the
    # groups of the first row it fits, max_layer_groups above the last (the paper's engine's
    # get_num_stages table). None: ceil(tokens / group_tokens).
    group_table: tuple[tuple[int, int], ...] | None = None
    # Every member of a cohort may be cut so that it fills chunk_tokens, the rest of a cut prompt
    # leading the next cohort (the paper's engine). False: only the first member is cut, so no
    # prompt waits for two cohorts and a smaller cohort passes its groups sooner.
    fill_cohorts: bool = False

    @classmethod
    def of(cls, num_layers: int, group_tokens: int, num_layer_groups: int | None, chunk_limit: int,
           max_layer_groups: int | None = None, group_table: tuple[tuple[int, int], ...] | None = None,
           fill_cohorts: bool = False) -> "LayeredSettings":
        """The settings with the cohort's token cap worked out: `chunk_limit`, and unless the
        groups are capped by max_layer_groups, at most group_tokens per group (so a step's work,
        tokens x layers, matches a chunked step with a group_tokens budget)."""
        if max_layer_groups is None or num_layer_groups is not None:
            chunk_limit = min(chunk_limit, group_tokens * (num_layer_groups or num_layers))
        return cls(num_layers, group_tokens, num_layer_groups, chunk_limit, max_layer_groups, group_table,
                   fill_cohorts)

    def groups(self, cohort_tokens: int) -> int:
        """G for a cohort of `cohort_tokens`: the fixed count, else the group table's or
        ceil(tokens / group_tokens), capped by max_layer_groups; never more than the layers."""
        if self.num_layer_groups is not None:
            return min(self.num_layer_groups, self.num_layers)
        if self.group_table is not None and self.max_layer_groups is not None:
            groups = next((g for most, g in self.group_table if cohort_tokens <= most), self.max_layer_groups)
        else:
            groups = max(1, -(-cohort_tokens // self.group_tokens))
        if self.max_layer_groups is not None:
            groups = min(groups, self.max_layer_groups)
        return min(groups, self.num_layers)


@dataclass(frozen=True)
class SchedulingKnobs:
    """The scheduler settings a forecast must reproduce."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_policy: str = "chunked"
    layered: LayeredSettings | None = None  # the layered policy's own settings (None: chunked)


class RequestLengths(NamedTuple):
    """One request as a node's snapshot holds it."""

    prompt: int  # prompt tokens
    tokens: int  # tokens so far: prompt and generated
    cached: int  # tokens computed into the KV cache
    max_tokens: int


@dataclass
class PrefixSummary:
    """What a node's prefix cache holds, for routers: the 64-bit routing keys of the full blocks
    it registered and dropped since its last summary (`whole`: `stored` lists every cached block
    instead, replacing what the reader knew), with the salt and block size that name a prompt's
    blocks as the node names them (scheduling/prefix_hash.py)."""

    salt: bytes
    block_size: int
    whole: bool
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    queries: int = 0  # prompt tokens looked up so far (vLLM's prefix_cache_queries)
    hits: int = 0  # of those, found cached (prefix_cache_hits)


@dataclass
class NodeState:
    knobs: SchedulingKnobs
    running: list[RequestLengths] = field(default_factory=list)  # in the scheduler's order
    waiting: list[RequestLengths] = field(default_factory=list)  # queue order
    free_blocks: int = 0
    steps: list[StepSample] = field(default_factory=list)  # measured since the last snapshot
    finished: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output tokens) since the last one
    time: float = 0.0  # the node's clock when taken (seconds; the router's clock must agree)
    steps_done: int = -1  # lockstep nodes: every step numbered below this one has run (-1: colocated)
    prefix: PrefixSummary | None = None  # its prefix cache's changes since the last snapshot (None: off)

    def load(self) -> "NodeLoad":
        """The heuristic routers' view."""
        k = self.knobs
        pending = sum(r.tokens - r.cached for r in self.waiting) + sum(
            r.tokens - r.cached for r in self.running if r.tokens - r.cached > 1)
        return NodeLoad(capacity_tokens=k.num_blocks * k.block_size,
                        used_tokens=sum(r.cached for r in self.running), pending_prefill_tokens=pending,
                        running=len(self.running), waiting=len(self.waiting))


@dataclass
class NodeLoad:
    """What a heuristic router knows of one node."""

    capacity_tokens: int  # KV-cache tokens the node holds in all
    used_tokens: int = 0  # tokens cached now
    pending_prefill_tokens: int = 0  # prompt tokens admitted or queued but not yet computed
    running: int = 0
    waiting: int = 0

    def add(self, prompt_tokens: int) -> None:
        """A request routed here since the last snapshot."""
        self.pending_prefill_tokens += prompt_tokens
        self.waiting += 1

    def freeness(self) -> float:
        """Llumnix: (capacity - cached - pending prefill) / requests carried (one more: the new one)."""
        free = self.capacity_tokens - self.used_tokens - self.pending_prefill_tokens
        return free / (self.running + self.waiting + 1)


class SpanKind(str, enum.Enum):
    """What a node was doing over a span of its timeline (megainfer/disagg/node_timeline.py)."""

    STEP = "step"  # one step of the node's loop: layer -1, micro-batch -1
    COMPUTE = "compute"  # one (layer, micro-batch)'s work here: its attention half, or its experts
    WAIT = "wait"  # waiting for a peer's message of (layer, micro-batch)
    SEND = "send"  # a message of (layer, micro-batch) handed to the transport (an instant)
    ARRIVE = "arrive"  # a message of (layer, micro-batch) found arrived (an instant)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Span:
    """One interval (or, start == end, instant) of a node's timeline, in seconds of the node's
    monotonic clock (`time.perf_counter`); `NodeTimeline.clock_offset` puts it on the reader's."""

    kind: SpanKind
    step: int
    layer: int
    micro_batch: int
    start: float
    end: float
    tokens: int = 0  # COMPUTE, SEND, ARRIVE: the tokens carried; STEP: tokens scheduled
    prefill_tokens: int = 0  # STEP: of those, prompt tokens (0: a decode-only step)


@dataclass
class NodeTimeline:
    """A node's spans since tracing was switched on (oldest dropped past the recorder's capacity)."""

    name: str
    role: NodeRole
    spans: list[Span]
    dropped: int = 0  # spans lost to the capacity
    clock_offset: float = 0.0  # seconds to add to a span's times for the reader's clock (set by the reader)
