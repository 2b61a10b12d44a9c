"""`megainfer bench simulator`: the simulator against the engine it models, on one trace.

The closed loop: a trace (generated, or a JSONL file) is served by the real colocated engine
(`megainfer serve` in a subprocess, one per prefill policy, the trace replayed by `bench serve`'s
code over gRPC) and simulated (`megainfer.tools.simulator`, its step model reading the operator profile
measured on this machine by `megainfer profile`), with the same scheduler settings and the same
number of KV blocks. Mean TTFT, mean time between tokens and output throughput are compared as
sim / real ratios against a tolerance.

The figures are defined the same way on both sides:
- TTFT: arrival (the request leaving the client) -> first token, per request, averaged;
- TBT: (last token - first token) summed over requests / (output tokens - 1) summed, i.e. the
  mean over every gap between consecutive tokens (the real side counts tokens, not streamed
  chunks, so a chunk carrying two tokens cannot shift it);
- output throughput: output tokens / (first arrival -> last token).

The server runs with the profile's dtype, device and thread count unless told otherwise, since
the profile's times hold only there. A real run shares this machine with the client (and, on a
shared machine, with whatever else runs): its timings carry that noise; the simulation has none.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megainfer.tools.bench import serve_bench
from megainfer.config import ModelConfig
from megainfer.model_resolution import resolve_model
from megainfer.tools.m2n_report import machine
from megainfer.tools.bench.report import format_table, write_json
from megainfer.tools.bench.serve_datasets import DatasetSpec
from megainfer.errors import ConfigError, MegaInferError
from megainfer.sampling_params import SamplingParams
from megainfer.server.client import Client
from megainfer.tools.simulator.experiment import SimulationSpec
from megainfer.tools.simulator.sim import Simulator
from megainfer.tools.bench.workload import SimRequest, arrival_times, describe, load_trace
from planner.operator_profile import OperatorProfile
from planner.step_cost_model import ColocatedStepModel

POLICIES = ("chunked", "layered")
METRICS = (("ttft_mean_s", "TTFT mean (ms)", 1e3), ("tbt_mean_s", "TBT mean (ms)", 1e3),
           ("output_throughput", "output tok/s", 1.0))
SERVER_START_TIMEOUT_S = 300.0  # loading weights and binding the port
SERVER_STOP_TIMEOUT_S = 30.0
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 64, 4
# The serving path's own latency (the request's way in over gRPC, the engine loop picking it up,
# the first token's way out) is timed with requests of this many prompt and output tokens
# sent one at a time to the idle server, this many times.
PATH_PROMPT_TOKENS, PATH_OUTPUT_TOKENS, PATH_REQUESTS = 8, 2, 15
_ADDRESS = re.compile(r"gRPC megainfer\.v1\.Inference on (\S+)")


@dataclass
class CheckSpec:
    """What `bench simulator` is told."""

    model: str
    profile: str  # operator profile JSON (`megainfer profile --model M`)
    trace: str | None = None  # a JSONL trace; None: generated from the fields below
    requests: int = 180
    rate: float = 3.0  # requests per second, Poisson
    input_len: tuple[int, int] = (64, 512)  # uniform, inclusive
    output_len: tuple[int, int] = (16, 64)
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    chunk_size: int = 256  # --max-num-batched-tokens of the server
    group_tokens: int = 128
    num_layer_groups: int | None = None
    max_num_seqs: int = 256
    threads: int | None = None  # None: the profile's
    dtype: str | None = None  # None: the profile's
    tolerance: float = 0.15
    server_log: str | None = None  # a directory for the servers' logs; None: a temporary one

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if not self.policies or bad:
            raise ConfigError(f"--policy {','.join(bad or self.policies) or '(none)'}: choose from "
                              f"{', '.join(POLICIES)}")
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"--tolerance must lie in (0, 1) (0.15 is 15%), got {self.tolerance}")
        if self.trace is None:
            if self.requests <= 0:
                raise ConfigError(f"--requests must be positive, got {self.requests}")
            if not self.rate > 0 or not math.isfinite(self.rate):
                raise ConfigError(f"--rate must be a positive number of requests per second, got {self.rate}")


def generate_trace(num_requests: int, rate: float, input_len: tuple[int, int], output_len: tuple[int, int],
                   seed: int) -> list[SimRequest]:
    """Poisson arrivals (the first at 0), lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    times = arrival_times(rng, num_requests, rate, "poisson", 1.0)
    inputs = rng.integers(input_len[0], input_len[1] + 1, size=num_requests)
    outputs = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return [SimRequest(float(t), int(i), int(o)) for t, i, o in zip(times, inputs, outputs)]


def write_trace(requests: list[SimRequest], path: Path) -> None:
    """The JSONL format load_trace reads."""
    path.write_text("".join(json.dumps({"arrival": r.arrival_s, "input_len": r.input_len,
                                        "output_len": r.output_len}) + "\n" for r in requests))


# -- the real engine -----------------------------------------------------------------------
@dataclass
class ServerSettings:
    """The flags of `megainfer serve` that decide its schedule and its speed."""

    model: str
    policy: str
    chunk_size: int
    group_tokens: int
    num_layer_groups: int | None
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    device: str
    threads: int | None
    seed: int

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "megainfer", "serve", "--model", self.model, "--no-http", "--port", "0",
                "--host", "127.0.0.1", "--prefill-policy", self.policy,
                "--max-num-batched-tokens", str(self.chunk_size), "--group-tokens", str(self.group_tokens),
                "--max-num-seqs", str(self.max_num_seqs), "--num-kv-blocks", str(self.num_kv_blocks),
                "--block-size", str(self.block_size), "--dtype", self.dtype, "--device", self.device,
                "--seed", str(self.seed)]
        if self.num_layer_groups is not None:
            argv += ["--num-layer-groups", str(self.num_layer_groups)]
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        return argv


@contextlib.contextmanager
def running_server(settings: ServerSettings, log_path: Path) -> Iterator[str]:
    """`megainfer serve` in a subprocess, up and warmed (one short request); yields its gRPC
    address (the port is chosen by the OS and read from the server's log). Stopped with SIGINT
    on exit, killed if it does not stop."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(settings.argv(), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        address = _wait_for_address(proc, log_path)
        _warm_up(address)
        yield address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for_address(proc: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = _ADDRESS.search(log_path.read_text(errors="replace"))
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise MegaInferError(f"`megainfer serve` exited with status {proc.returncode} before serving; its "
                                 f"log ({log_path}) ends:\n{_tail(log_path)}")
        time.sleep(0.2)
    raise MegaInferError(f"`megainfer serve` did not print its gRPC address within {SERVER_START_TIMEOUT_S:g} s; "
                         f"its log ({log_path}) ends:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _warm_up(address: str) -> None:
    """One short request, so that lazy initialisation does not land in the trace's first TTFT."""
    client = Client(address, timeout_s=30.0)
    try:
        params = SamplingParams(max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True)
        for _ in client.generate(list(range(2, 2 + WARMUP_PROMPT_TOKENS)), params, request_id="warm-up"):
            pass
    finally:
        client.close()


def request_path_seconds(address: str, step_model: ColocatedStepModel, model: ModelConfig,
                         engine_config) -> float:
    """The serving path's latency outside engine steps: the median TTFT of a tiny request sent
    alone to the idle server, less the simulated TTFT of the same request (its one prefill
    step). The simulator prices engine steps only; a TTFT measured through gRPC also holds the
    request's way in and its first token's way out, which this adds back to every simulated
    TTFT. Measured on the server before the trace, never fitted to the trace."""
    client = Client(address, timeout_s=30.0)
    params = SamplingParams(max_tokens=PATH_OUTPUT_TOKENS, ignore_eos=True)
    prompt = list(range(2, 2 + PATH_PROMPT_TOKENS))
    ttfts = []
    try:
        for i in range(PATH_REQUESTS):
            began = time.perf_counter()
            first = None
            for _ in client.generate(prompt, params, request_id=f"path-{i}"):
                first = first or time.perf_counter()
            ttfts.append(first - began)
    finally:
        client.close()
    alone = Simulator(model, step_model, engine_config).run([SimRequest(0.0, PATH_PROMPT_TOKENS, PATH_OUTPUT_TOKENS)])
    return max(0.0, float(np.median(ttfts)) - float(alone.ttft_s[0]))


def real_figures(result: dict) -> dict:
    """bench serve's result -> the compared figures, defined as the simulator defines them."""
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    if not ok:
        raise MegaInferError(f"every request of the real run failed; the first error: {result['errors'][0]}")
    ttfts = np.array([result["ttfts"][i] for i in ok])
    latencies = np.array([result["latencies"][i] for i in ok])
    starts = np.array([result["start_times"][i] for i in ok])
    outputs = np.array([result["output_lens"][i] for i in ok])
    gaps = np.maximum(outputs - 1, 0)
    window = float((starts + latencies).max() - starts.min())
    return {
        "completed": len(ok), "failed": len(result["errors"]) - len(ok),
        "ttft_mean_s": float(ttfts.mean()),
        "tbt_mean_s": float((latencies - ttfts)[gaps > 0].sum() / gaps.sum()) if gaps.sum() else 0.0,
        "output_throughput": float(outputs.sum() / window) if window > 0 else 0.0,
        # bench serve's own figures, for reference: chunks, not tokens; its duration starts at t = 0
        "mean_itl_s": result["mean_itl_ms"] / 1e3, "bench_output_throughput": result["output_throughput"],
        "duration_s": window, "output_tokens": int(outputs.sum()),
    }


# -- the loop ------------------------------------------------------------------------------
@dataclass
class PolicyCheck:
    policy: str
    server: ServerSettings  # what the real engine was started with
    real: dict
    sim: dict
    comparison: dict = field(default_factory=dict)  # metric -> {real, sim, ratio, within}


def compare(real: dict, sim: dict, tolerance: float) -> dict:
    out = {}
    for key, _, _ in METRICS:
        ratio = sim[key] / real[key] if real[key] > 0 else math.nan
        out[key] = {"real": real[key], "sim": sim[key], "ratio": ratio,
                    "within": bool(math.isfinite(ratio) and abs(ratio - 1) <= tolerance)}
    return out


def run_check(spec: CheckSpec, json_path: str | None = None) -> list[PolicyCheck]:
    """Serve and simulate the trace under each policy; print the comparison; write --json."""
    model, _ = resolve_model(spec.model)
    profile = OperatorProfile.load(spec.profile)
    profile.check_applies(model, 1)
    dtype = spec.dtype or profile.dtype
    if dtype != profile.dtype:
        raise ConfigError(f"--dtype {dtype}: the profile {spec.profile} was measured in {profile.dtype}; its times "
                          f"price that dtype only (pass --dtype {profile.dtype}, or profile with --dtype {dtype})")
    threads = spec.threads or profile.device.threads or None
    step_model = ColocatedStepModel(model, None, 1, profile=profile)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="megainfer-simcheck-")))
        logs = Path(spec.server_log) if spec.server_log else work
        logs.mkdir(parents=True, exist_ok=True)
        trace_path, requests = _trace(spec, model, work)
        print(f"trace: {len(requests)} requests over {requests[-1].arrival_s:.1f} s "
              f"({'from ' + spec.trace if spec.trace else 'generated'}); profile {spec.profile} "
              f"({profile.device.name}, {profile.dtype}, {threads or 'default'} threads)", file=sys.stderr)
        checks = []
        for policy in spec.policies:
            sim_spec = SimulationSpec(model=model, step_model=step_model, workload=str(trace_path),
                                      rate=spec.rate, num_requests=len(requests), policies=(policy,),
                                      chunk_size=spec.chunk_size, group_tokens=spec.group_tokens,
                                      num_layer_groups=spec.num_layer_groups, max_num_seqs=spec.max_num_seqs,
                                      seed=spec.seed)
            engine_config = sim_spec.engine_config(policy)
            # The simulator sizes the KV cache from the profile; the server is given that count.
            num_blocks = Simulator(model, step_model, engine_config).num_blocks
            settings = ServerSettings(spec.model, policy, spec.chunk_size, spec.group_tokens, spec.num_layer_groups,
                                      spec.max_num_seqs, num_blocks, engine_config.block_size, dtype,
                                      profile.device.kind, threads, spec.seed)
            print(f"{policy}: serving the trace (real engine, {num_blocks} KV blocks)", file=sys.stderr)
            with running_server(settings, logs / f"serve-{policy}.log") as address:
                path_s = request_path_seconds(address, step_model, model, engine_config)
                result = serve_bench.run(serve_bench.ServeBenchConfig(
                    backend="megainfer-grpc", base_url=address, model=spec.model, ignore_eos=True,
                    dataset=DatasetSpec("trace", str(trace_path), num_prompts=None, seed=spec.seed,
                                        request_id_prefix=f"{policy}-"), label=f"real-{policy}"))
            real = real_figures(result)
            print(f"{policy}: simulating the trace", file=sys.stderr)
            sim = sim_spec.run(sim_spec.requests())[policy]
            sim["engine_ttft_mean_s"] = sim["ttft_mean_s"]  # the simulator's own, steps only
            sim["request_path_s"] = path_s
            sim["ttft_mean_s"] += path_s
            print(f"{policy}: serving path {path_s * 1e3:.1f} ms per request (measured alone), added to the "
                  "simulated TTFT", file=sys.stderr)
            checks.append(PolicyCheck(policy, settings, real, sim, compare(real, sim, spec.tolerance)))
    host = machine()
    print(format_checks(checks, spec.tolerance))
    print(f"machine: {host['cpu']}, {host['cores']} cores; real timings share it with the client and anything "
          f"else running, the simulation is noise-free")
    if json_path:
        _write_checks(json_path, spec, dtype, threads, host, requests, checks)
    return checks


def _write_checks(json_path: str, spec: CheckSpec, dtype: str, threads, host: dict, requests: list,
                  checks: list[PolicyCheck]) -> None:
    write_json(json_path, {"config": {**asdict(spec), "dtype": dtype, "threads": threads},
                           "machine": host, "trace": {"requests": [asdict(r) for r in requests],
                                                      "stats": describe(requests)},
                           "tolerance": spec.tolerance,
                           "policies": {c.policy: {"server": asdict(c.server), "real": c.real, "sim": c.sim,
                                                   "comparison": c.comparison} for c in checks},
                           "within": {c.policy: {k: v["within"] for k, v in c.comparison.items()} for c in checks}})


def _trace(spec: CheckSpec, model: ModelConfig, work: Path) -> tuple[Path, list[SimRequest]]:
    if spec.trace is not None:
        if not Path(spec.trace).is_file():
            raise ConfigError(f"--trace {spec.trace}: no such file; a trace is a JSONL file of "
                              f'{{"arrival": s, "input_len": tokens, "output_len": tokens}} lines')
        return Path(spec.trace), load_trace(spec.trace, max_model_len=model.max_position_embeddings)
    longest = spec.input_len[1] + spec.output_len[1]
    if longest > model.max_position_embeddings:
        raise ConfigError(f"--input-len-range up to {spec.input_len[1]} plus --output-len-range up to "
                          f"{spec.output_len[1]} is {longest} tokens, beyond {model.name}'s context of "
                          f"{model.max_position_embeddings}; shorten the ranges")
    requests = generate_trace(spec.requests, spec.rate, spec.input_len, spec.output_len, spec.seed)
    path = work / "trace.jsonl"
    write_trace(requests, path)
    return path, requests


def format_checks(checks: list[PolicyCheck], tolerance: float) -> str:
    rows = []
    for check in checks:
        for key, label, scale in METRICS:
            c = check.comparison[key]
            rows.append([check.policy, label, c["real"] * scale, c["sim"] * scale, f"{c['ratio']:.3f}",
                         "yes" if c["within"] else "NO"])
    return format_table(["policy", "metric", "real", "sim", "sim/real", f"within {tolerance:.0%}"], rows)
