"""The `pair` check: one attention node and one expert node in two processes on one device
(torch.multiprocessing spawn, no Ray), ping-ponging m micro-batches over M2N endpoints. The
attention node's greedy tokens must equal the colocated engine's, and the expert node must
have served exactly the attention node's steps. Measured: decode tokens/s at m = 1 and m = 2
(their ratio: what the ping-pong buys on one GPU, where the two sides share the device), and
each node's busy fraction from its own timeline. Then m = 2 again over device slots
(megainfer/disagg/device_slots.py: on CUDA the bytes go device to device through CUDA IPC, the
host carrying only headers; on the CPU through a shared /dev/shm region), tokens equal, its
decode tokens/s against the staged path's. On a GPU decode runs as CUDA graphs
(megainfer/disagg/decode_graphs.py), and m = 2 runs once more with --enforce-eager: decode
tokens/s with graphs over without.

The model is the shipped demo checkpoint (`megainfer-demo`, a Mixtral-style MoE), in bfloat16
on CUDA (the staging between nodes then carries bf16 records) and float32 on the CPU. Each
node's link is a plain transport `Endpoint` (an ExpertLink where nothing re-wires it)."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megainfer.expert_replicas import ExpertReplicas
from megainfer.config import ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.hf_config import from_pretrained
from megainfer.messages import NodeTimeline
from megainfer.model_resolution import DEMO_MODEL, resolve_model
from megainfer.tools.gpucheck.context import CheckContext
from transport import Endpoint, EndpointSpec, RoundFailed
from transport import core as m2n_core

SECRET = b"megainfer-gpucheck-pair-secret!!"
ATTENTION, EXPERT = "attention0", "expert0"
BATCH_TOKENS = 64  # the engine's token budget: what one micro-batch can carry, what the slots hold
WAIT_S = 180  # longest wait for a child process's next word
PEER_TIMEOUT_S = 60  # a node's longest wait for its peer (first steps compile kernels)


@dataclass
class AttentionResult:
    tokens: list[list[int]]  # per prompt, its greedy tokens
    steps: int  # engine steps taken (the expert node must have served as many)
    decode_tokens: int  # tokens sampled in steps with no prompt left to prefill
    decode_seconds: float  # wall time of those steps
    timeline: NodeTimeline | None
    direct_peers: int = 0  # expert nodes reached through device slots
    decode: str = ""  # how decode ran: CUDA graphs or eager (the kernel report's line)


@dataclass
class ExpertResult:
    steps: int
    timeline: NodeTimeline | None


@dataclass(frozen=True)
class PairSpec:
    path: str  # checkpoint directory
    device: str
    dtype: str
    backend: str  # the M2N backend between the two (shm on one host)
    micro_batches: int
    max_tokens: int
    record_timeline: bool = False
    device_slots: bool = False  # dispatches and answers device to device (device_slots.py)
    enforce_eager: bool = False  # on CUDA: decode eager, not CUDA graphs (decode_graphs.py)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(device=self.device, dtype=self.dtype, num_kv_blocks=64, block_size=8,
                            max_num_batched_tokens=BATCH_TOKENS, max_num_seqs=BATCH_TOKENS,
                            enforce_eager=self.enforce_eager)


def _greedy(max_tokens: int):
    from megainfer import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _answer_bytes(model: ModelConfig, spec: PairSpec) -> int:
    """The largest answer of one (layer, micro-batch): a row per token of the batch."""
    return BATCH_TOKENS * model.hidden_size * getattr(torch, spec.dtype).itemsize


def _endpoint(name: str, rank: int, slot_bytes: int, spec: PairSpec) -> Endpoint:
    return Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, listen="127.0.0.1:0", slot_bytes=slot_bytes,
                                 num_slots=spec.micro_batches, backend=spec.backend, timeout_s=PEER_TIMEOUT_S))


def _wire(endpoint: Endpoint, conn) -> None:
    """Trade addresses through the parent, then connect to the peer."""
    conn.send(endpoint.address)
    endpoint.connect(conn.recv())


def generate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int, int, float]:
    """(tokens per prompt, steps, decode tokens, decode seconds): the engine stepped until done;
    a step is a decode step once every prompt has its first token."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, _greedy(max_tokens))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    steps = decode_tokens = 0
    decode_seconds = 0.0
    runner = engine.runner
    while engine.has_unfinished_requests():
        decoding = all(tokens.values())
        t0, step = time.perf_counter(), getattr(runner, "step_id", steps)
        deltas = engine.step()
        if hasattr(runner, "record_step"):
            runner.record_step(step, t0)
        if decoding:
            if torch.cuda.is_available() and engine.config.device.startswith("cuda"):
                torch.cuda.synchronize()
            decode_seconds += time.perf_counter() - t0
            decode_tokens += sum(len(d.new_token_ids) for d in deltas)
        for d in deltas:
            tokens[d.request_id].extend(d.new_token_ids)
        steps += 1
    return [tokens[f"r{i}"] for i in range(len(prompts))], steps, decode_tokens, decode_seconds


def attention_node(spec: PairSpec, prompts: list[list[int]], conn) -> None:
    try:
        from megainfer import Engine
        from megainfer.disagg.pipelined_runner import PipelinedModelRunner

        torch.set_num_threads(1)
        model = from_pretrained(spec.path)
        link = _endpoint(ATTENTION, 0, BATCH_TOKENS * model.hidden_size * 4, spec)

        def runner(mc, cfg, weights, max_len):
            return PipelinedModelRunner(mc, cfg, weights, max_len, link=link, expert_nodes=[EXPERT],
                                        replicas=ExpertReplicas.of_assignment([list(range(mc.num_experts))], mc.num_layers),
                                        micro_batches=spec.micro_batches, name=ATTENTION,
                                        device_slot_bytes=_answer_bytes(mc, spec) if spec.device_slots else 0)

        engine = Engine(spec.path, spec.engine_config(), runner_factory=runner)
        engine.runner.timeline.switch(spec.record_timeline)
        _wire(link, conn)
        tokens, steps, decode_tokens, decode_seconds = generate(engine, prompts, spec.max_tokens)
        timeline = engine.runner.timeline.read() if spec.record_timeline else None
        slots = engine.runner.slots
        conn.send(AttentionResult(tokens, steps, decode_tokens, decode_seconds, timeline,
                                  int(slots.direct.sum()) if slots is not None else 0, engine.runner.kernels.decode))
        link.close()  # the expert node's next round fails with the peer closed: its cue to stop
    except BaseException:
        conn.send(traceback.format_exc())


def expert_node(spec: PairSpec, conn) -> None:
    try:
        from megainfer.disagg.expert_link import dispatch_bytes
        from megainfer.disagg.expert_worker import ExpertWorker
        from megainfer.model.weights import SafetensorsCheckpoint

        torch.set_num_threads(1)
        model = from_pretrained(spec.path)
        dtype = getattr(torch, spec.dtype)
        records = dispatch_bytes(BATCH_TOKENS, model.hidden_size, model.top_k, dtype)
        link = _endpoint(EXPERT, 100, records, spec)
        worker = ExpertWorker(model, list(range(model.num_experts)), spec.dtype, spec.device,
                              SafetensorsCheckpoint(spec.path), attention_nodes=[ATTENTION],
                              micro_batches=spec.micro_batches, link=link, profile_tokens=BATCH_TOKENS,
                              name=EXPERT, device_slot_bytes=records if spec.device_slots else 0,
                              decode_graph_tokens=0 if spec.enforce_eager else BATCH_TOKENS)
        worker.timeline.switch(spec.record_timeline)
        _wire(link, conn)
        try:
            while True:
                worker.run_step()
        except RoundFailed as exc:  # the attention node is done: it closed its end
            if not exc.peers_closed:
                raise
        conn.send(ExpertResult(worker.steps, worker.timeline.read() if spec.record_timeline else None))
        link.close()
    except BaseException:
        conn.send(traceback.format_exc())


def _receive(conn, who: str, processes) -> object:
    """The next word of the `who` process; an error as soon as any of `processes` died silently."""
    deadline = time.monotonic() + WAIT_S
    while not conn.poll(1.0):
        dead = [p for p in processes if p.exitcode not in (None, 0)]
        if dead and not conn.poll(0):
            raise RuntimeError(f"a node process died with exit code {dead[0].exitcode} before the {who} process "
                               "answered")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {who} process said nothing for {WAIT_S} s")
    message = conn.recv()
    if isinstance(message, str) and "Traceback" in message:
        raise RuntimeError(f"the {who} process failed:\n{message}")
    return message


def run_pair(spec: PairSpec, prompts: list[list[int]]) -> tuple[AttentionResult, ExpertResult]:
    ctx = mp.get_context("spawn")
    attention_conn, attention_end = ctx.Pipe()
    expert_conn, expert_end = ctx.Pipe()
    processes = [ctx.Process(target=attention_node, args=(spec, prompts, attention_end)),
                 ctx.Process(target=expert_node, args=(spec, expert_end))]
    for process in processes:
        process.start()
    try:
        attention_address = _receive(attention_conn, "attention", processes)
        expert_address = _receive(expert_conn, "expert", processes)
        attention_conn.send({EXPERT: expert_address})
        expert_conn.send({ATTENTION: attention_address})
        return _receive(attention_conn, "attention", processes), _receive(expert_conn, "expert", processes)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()


def colocated(spec: PairSpec, prompts: list[list[int]]) -> list[list[int]]:
    from megainfer import Engine

    return generate(Engine(spec.path, spec.engine_config()), prompts, spec.max_tokens)[0]


def _busy_fractions(attention: AttentionResult, expert: ExpertResult) -> dict[str, float]:
    from megainfer.tools.bench.pipeline_overlap import overlap

    nodes = overlap([attention.timeline, expert.timeline]).nodes
    return {f"{n.role.value}_busy": round(n.busy_fraction, 3) for n in nodes}


def check_gpt_oss_pair(ctx: CheckContext) -> None:
    """gpt-oss (the tiny checkpoint: window 8, sinks, biased clamped experts) as a pair at m = 2,
    float32, decode under CUDA graphs on a GPU: the windowed layers' tables and released blocks
    through the graphs' static batches, prompts longer than the window; the colocated tokens."""
    import tempfile

    from megainfer.tools.gpucheck.tiny_checkpoints import write_tiny_checkpoint

    with ctx.case("gpt-oss float32 m = 2: tokens equal to the colocated engine") as case, \
            tempfile.TemporaryDirectory(prefix="gpucheck-gpt-oss-") as tmp:
        try:  # the checkpoint is written by transformers' own classes
            import transformers  # noqa: F401
        except ImportError as exc:
            case.skip(f"transformers cannot be imported here ({exc})")
            return
        write_tiny_checkpoint("gpt_oss", Path(tmp))
        spec = PairSpec(tmp, ctx.device.type, "float32", "shm", 2, 48 if ctx.on_gpu else 12)
        prompts = [[1, 5, 9, 14, 3], list(range(20, 60)), [7] * 12]
        expected = colocated(spec, prompts)
        attention, expert = run_pair(spec, prompts)
        case.figures |= {"steps": attention.steps, "decode": attention.decode}
        if attention.tokens != expected:
            raise AssertionError(f"tokens differ from the colocated engine's: {attention.tokens} vs {expected}")


def run(ctx: CheckContext) -> None:
    _, path = resolve_model(DEMO_MODEL)
    dtype = "bfloat16" if ctx.on_gpu else "float32"
    max_tokens = 64 if ctx.on_gpu else 8
    prompts = [[0, 5, 9, 14, 3], [0, 77, 3], [0, 12, 40, 41, 42, 43, 44, 45], [0, 1000]]
    rates: dict[tuple[int, bool, bool], float] = {}
    expected = None
    # On a GPU decode runs as CUDA graphs; m = 2 once more eager, to compare.
    for m, slots, eager in ((1, False, False), (2, False, False), (2, True, False)) + (
            ((2, False, True),) if ctx.on_gpu else ()):
        spec = PairSpec(str(path), ctx.device.type, dtype, "shm", m, max_tokens, record_timeline=True,
                        device_slots=slots, enforce_eager=eager)
        over = (" over device slots" if slots else "") + (", --enforce-eager" if eager else "")
        with ctx.case(f"{DEMO_MODEL} {dtype} m = {m}{over}: tokens equal to the colocated engine") as case:
            expected = expected or colocated(spec, prompts)
            attention, expert = run_pair(spec, prompts)
            rate = attention.decode_tokens / attention.decode_seconds if attention.decode_seconds else 0.0
            rates[m, slots, eager] = rate
            case.figures |= {"decode_tokens_per_s": round(rate, 1), "steps": attention.steps,
                             "expert_steps": expert.steps, "m2n": "core" if m2n_core.native else "python",
                             "decode": attention.decode}
            if slots:
                case.figures["direct_peers"] = attention.direct_peers
                if attention.direct_peers != 1:
                    raise AssertionError("the expert node was reached through the host, not device slots")
            try:
                case.figures |= _busy_fractions(attention, expert)
            except Exception as exc:  # too few decode steps to measure: a figure missing, not a failure
                case.figures["busy"] = f"not measured ({exc})"
            if attention.tokens != expected:
                raise AssertionError(f"tokens differ from the colocated engine's: {attention.tokens} vs {expected}")
            if expert.steps != attention.steps:
                raise AssertionError(f"the expert node served {expert.steps} steps, the attention node took "
                                     f"{attention.steps}")
    check_gpt_oss_pair(ctx)
    staged = rates.get((2, False, False))
    if rates.get((1, False, False)) and staged:
        with ctx.case("decode tokens/s, m = 2 over m = 1") as case:
            case.figures["m2_over_m1"] = round(staged / rates[1, False, False], 3)
            case.detail = "both nodes share one device here: the ratio shows the ping-pong's cost or gain, not a plan's"
    if staged and rates.get((2, True, False)):
        with ctx.case("decode tokens/s at m = 2, device slots over the staged path") as case:
            case.figures["slots_over_staged"] = round(rates[2, True, False] / staged, 3)
    if staged and rates.get((2, False, True)):
        with ctx.case("decode tokens/s at m = 2, CUDA graphs over eager") as case:
            case.figures["graphs_over_eager"] = round(staged / rates[2, False, True], 3)
