"""The load `megainfer bench routing` sends: requests from the simulator's workload vocabulary
(random; mixed, random prompts of which a share are long, as chat turns among the odd pasted
document; ShareGPT-like and arXiv-like length distributions; or a JSONL trace of
arrival/input_len/output_len; any of them behind shared prefixes, `shared_prefixes`), each a stream of random token ids asking for exactly its output
length (EOS ignored), on a Poisson (or bursty) schedule over gRPC. Per request: TTFT, every
inter-token latency (between streamed chunks, spread over the chunk's tokens), TPOT and E2E.

These datasets are length distributions, not text: `megainfer bench serve` (serve_bench.py)
is the benchmark that reads a real ShareGPT file and lines up with `vllm bench serve`.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from megainfer.errors import ConfigError, MegaInferError
from megainfer.sampling_params import SamplingParams
from megainfer.server.client import Client
from megainfer.tools.bench.workload import SimRequest, arrival_times, generate, load_trace, with_shared_prefixes


@dataclass
class ServeBenchSpec:
    server: str
    dataset: str = "random"  # random | mixed | sharegpt | arxiv | a JSONL trace
    request_rate: float = float("inf")  # requests per second; inf: all at once
    num_prompts: int = 100
    input_len: int = 128  # random dataset
    output_len: int = 64
    random_range_ratio: float = 0.0  # random dataset: lengths uniform in [len*(1-r), len*(1+r)]
    long_input_len: int = 1024  # mixed dataset: the long prompts' length (the same range ratio)
    long_fraction: float = 0.2  # mixed dataset: the share of long prompts
    max_model_len: int = 4096  # lengths from sharegpt/arxiv are clipped to fit
    arrival: str = "poisson"
    cv: float = 1.0
    goodput_ttft_ms: float | None = None
    goodput_tpot_ms: float | None = None
    vocab: int = 256  # prompt ids are drawn below this
    seed: int = 0
    shared_prefixes: int = 0  # each prompt starts with one of this many shared prefixes (0: none)
    prefix_len: int = 0  # tokens of each shared prefix (part of the prompt length)


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


GENERATED_DATASETS = ("random", "mixed", "sharegpt", "arxiv")  # any other --dataset is a trace file


def workload(spec: ServeBenchSpec) -> list[SimRequest]:
    if spec.num_prompts <= 0:
        raise ConfigError(f"--num-prompts must be positive, got {spec.num_prompts}")
    rate = spec.request_rate
    if spec.dataset in ("sharegpt", "arxiv"):
        reqs = generate(spec.dataset, num_requests=spec.num_prompts, rate=rate if np.isfinite(rate) else 1.0,
                        max_model_len=spec.max_model_len, arrival=spec.arrival, cv=spec.cv, seed=spec.seed)
    elif spec.dataset in ("random", "mixed"):
        rng = np.random.default_rng(spec.seed)
        times = arrival_times(rng, spec.num_prompts, rate, spec.arrival, spec.cv) if np.isfinite(rate) \
            else np.zeros(spec.num_prompts)
        r = spec.random_range_ratio
        if not 0 <= r < 1:
            raise ConfigError(f"--random-range-ratio must lie in [0, 1), got {r}")

        def lengths(n: int) -> np.ndarray:
            return rng.integers(max(1, round(n * (1 - r))), round(n * (1 + r)) + 1, size=spec.num_prompts)

        ins, outs = lengths(spec.input_len), lengths(spec.output_len)
        if spec.dataset == "mixed":
            if not 0 < spec.long_fraction <= 1:
                raise ConfigError(f"--long-fraction must lie in (0, 1], got {spec.long_fraction}")
            ins = np.where(rng.random(spec.num_prompts) < spec.long_fraction, lengths(spec.long_input_len), ins)
        reqs = [SimRequest(float(t), int(i), int(o)) for t, i, o in zip(times, ins, outs)]
    else:
        return load_trace(spec.dataset, max_model_len=spec.max_model_len, num_requests=spec.num_prompts)
    if not np.isfinite(rate):
        reqs = [SimRequest(0.0, r.input_len, r.output_len) for r in reqs]
    if spec.shared_prefixes:
        reqs = with_shared_prefixes(reqs, num_prefixes=spec.shared_prefixes, prefix_len=spec.prefix_len,
                                    max_model_len=spec.max_model_len, seed=spec.seed)
    return reqs


def prompt_ids(spec: ServeBenchSpec, requests: list[SimRequest]) -> list[list[int]]:
    """Random token ids for each request; a request with a shared prefix starts with that
    prefix's ids (drawn once per prefix), then ids of its own."""
    rng = random.Random(spec.seed)
    prefixes = [[rng.randrange(spec.vocab) for _ in range(spec.prefix_len)] for _ in range(spec.shared_prefixes)]
    return [(prefixes[r.prefix_id] if r.prefix_id >= 0 else []) +
            [rng.randrange(spec.vocab) for _ in range(r.input_len - r.prefix_len)] for r in requests]


def run_serve_bench(spec: ServeBenchSpec, show_progress: bool = True) -> tuple[list[RequestResult], float, int]:
    """Send the workload; return per-request results, the duration and the peak concurrency."""
    requests = workload(spec)
    client = Client(spec.server)
    prompts = prompt_ids(spec, requests)
    results = [RequestResult(r.input_len) for r in requests]
    active, peak = 0, 0
    lock = threading.Lock()
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not show_progress, file=sys.stderr)

    def one(i: int, sent_at: float) -> None:
        nonlocal active, peak
        res = results[i]
        params = SamplingParams(max_tokens=requests[i].output_len, temperature=0.0, ignore_eos=True)
        with lock:
            active += 1
            peak = max(peak, active)
        last = None
        try:
            for msg in client.generate(prompts[i], params):
                n = len(msg.token_ids)
                if not n:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft_s = now - sent_at
                else:
                    res.itl_s.extend([(now - last) / n] * n)
                last = now
                res.output_tokens += n
            res.e2e_s = time.perf_counter() - sent_at
        except MegaInferError as exc:
            res.error = str(exc)
        finally:
            with lock:
                active -= 1
            bar.update(1)

    threads = []
    start = time.perf_counter()
    for i, r in enumerate(requests):
        delay = start + r.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i, time.perf_counter()), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    bar.close()
    client.close()
    return results, duration, peak


def summarize(spec: ServeBenchSpec, results: list[RequestResult], duration: float, peak: int) -> dict:
    ok = [r for r in results if not r.error]
    ms = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else 0.0  # noqa: E731
    mean = lambda xs: statistics.fmean(xs) * 1e3 if xs else 0.0  # noqa: E731
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    good = [r for r in ok if (spec.goodput_ttft_ms is None or r.ttft_s * 1e3 <= spec.goodput_ttft_ms)
            and (spec.goodput_tpot_ms is None or (r.tpot_s or 0.0) * 1e3 <= spec.goodput_tpot_ms)]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_generated_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration, "max_concurrent_requests": peak,
    }
    if spec.goodput_ttft_ms is not None or spec.goodput_tpot_ms is not None:
        summary["request_goodput"] = len(good) / duration
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        summary.update({f"mean_{name}_ms": mean(xs), f"median_{name}_ms": ms(xs, 50), f"p99_{name}_ms": ms(xs, 99)})
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    return summary


def format_summary(s: dict) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda label, value: lines.append(f"{label:<40}{value:<10}")  # noqa: E731
    row("Successful requests:", s["successful_requests"])
    row("Failed requests:", s["failed_requests"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_generated_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    if "request_goodput" in s:
        row("Request goodput (req/s):", f"{s['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Peak concurrent requests:", s["max_concurrent_requests"])
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for key, title, label in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms):", f"{s[f'{stat}_{key}_ms']:.2f}")
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)
