"""`bench serve`'s figures, with `vllm bench serve`'s definitions, printed block and JSON keys.

Over the successful requests:
- output tokens: the server's usage count, else the generated text's tokens (no special tokens);
- TTFT per request; TPOT = (latency - TTFT) / (output tokens - 1) for requests of more than one
  token; ITL every gap between consecutive streamed chunks, pooled over requests; E2EL the latency;
- throughputs over the benchmark's duration; goodput the requests per second that met every
  --goodput SLO (a one-token request's TPOT counts as 0 there);
- peak output tokens per second over one-second buckets (one token per chunk) and the peak number
  of requests in flight at once (a sweep over [start, end) intervals).
Statistics are reported in ms: mean, median, std and each --metric-percentiles percentile.

Beyond vLLM's keys, where they apply: cached_tokens (per request, the server's
usage.prompt_tokens_details.cached_tokens, None where it gave none) and mean_cached_tokens (over
the successful requests that report it), when any request reports it; per_turn (a conversation's
turn k: its requests' TTFT statistics); and the prefix-caching comparison's block and figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.tools.bench.serve_requests import RequestOutput
from megainfer.errors import ConfigError
from megainfer.tokenizer import Tokenizer

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = {"ttft": ("TTFT", "Time to First Token"),
                      "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                      "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
WIDTH = 50  # the block's width, vLLM's


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float  # req/s
    request_goodput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    samples: dict[str, list[float]]  # "ttft", "tpot", "itl", "e2el" -> seconds


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (ms)."""
    slo = {}
    for item in items:
        name, sep, value = item.partition(":")
        try:
            ms = float(value) if sep else None
        except ValueError:
            ms = None
        if name not in GOODPUT_METRICS or ms is None or not ms >= 0:
            raise ConfigError(f"--goodput {item!r}: write KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)} and MS "
                              f"a non-negative number of milliseconds, e.g. --goodput ttft:500 tpot:50")
        slo[name] = ms
    return slo


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < p <= 100 for p in values):
        raise ConfigError(f"--metric-percentiles {text!r}: write percentiles in (0, 100] separated by commas, "
                          f"e.g. 50,90,99")
    return values


def output_lengths(outputs: list[RequestOutput], tokenizer: Tokenizer) -> list[int]:
    """Each request's output tokens (0 for a failed one): the server's count, else the text's."""
    return [(o.output_tokens or len(tokenizer.encode(o.generated_text, add_special_tokens=False))) if o.success
            else 0 for o in outputs]


def calculate_metrics(outputs: list[RequestOutput], duration_s: float, output_lens: list[int],
                      goodput_ms: dict[str, float]) -> BenchmarkMetrics:
    ok = [(o, n) for o, n in zip(outputs, output_lens) if o.success]
    ttfts = [o.ttft for o, _ in ok]
    all_tpots = [(o.latency - o.ttft) / (n - 1) if n > 1 else 0.0 for o, n in ok]
    samples = {"ttft": ttfts, "tpot": [t for t, (_, n) in zip(all_tpots, ok) if n > 1],
               "itl": [gap for o, _ in ok for gap in o.itl], "e2el": [o.latency for o, _ in ok]}
    per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": samples["e2el"]}
    good = sum(all(per_request[name][i] * 1e3 <= slo for name, slo in goodput_ms.items()) for i in range(len(ok)))
    total_input = sum(o.prompt_len for o, _ in ok)
    total_output = sum(output_lens)
    peak_tokens, peak_requests = _peaks([o for o, _ in ok])
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / duration_s, request_goodput=good / duration_s,
        output_throughput=total_output / duration_s, total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_requests, samples=samples)


def _peaks(ok: list[RequestOutput]) -> tuple[float, int]:
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    buckets = np.zeros(int(np.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1)
    for o in ok:
        chunk_times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        np.add.at(buckets, (chunk_times - t0).astype(int).clip(0, len(buckets) - 1), 1)
    # Ends sort before starts at the same instant: [start, end) intervals that touch do not overlap.
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return float(buckets.max()), peak


def statistics_ms(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean, median, std and pXX of seconds, in ms (all 0 for no values, as vLLM reports them)."""
    xs = np.asarray(values or [0.0]) * 1e3
    out = {"mean": float(xs.mean()), "median": float(np.median(xs)), "std": float(xs.std())}
    for p in percentiles:
        out[f"p{int(p) if int(p) == p else p}"] = float(np.percentile(xs, p))
    return out


def result_fields(metrics: BenchmarkMetrics, duration_s: float, outputs: list[RequestOutput], output_lens: list[int],
                  goodput_ms: dict[str, float], metric_names: list[str], percentiles: list[float]) -> dict:
    """The benchmark part of the JSON vLLM saves (start times relative to the run's start)."""
    t0 = min((o.start_time for o in outputs), default=0.0)
    result = {
        "duration": duration_s, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput_ms else None,
        "output_throughput": metrics.output_throughput, "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time - t0 for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    if any(o.cached_tokens is not None for o in outputs):
        result["cached_tokens"] = [o.cached_tokens for o in outputs]
        result["mean_cached_tokens"] = mean_cached_tokens(outputs)
    for name in metric_names:
        for stat, value in statistics_ms(metrics.samples[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    return result


def format_block(result: dict, max_concurrency: int | None, request_rate: float, metric_names: list[str]) -> str:
    """vLLM's "Serving Benchmark Result" block, line for line."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    if result.get("mean_cached_tokens") is not None:
        row("Mean cached prompt tokens:", result["mean_cached_tokens"], ".2f")
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", float(result["max_concurrent_requests"]), ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name in metric_names:
        label, title = PERCENTILE_METRICS[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=WIDTH, c="-"))
        for key in [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std_")]:
            stat = key.removesuffix(f"_{name}_ms")  # mean, median, p99, p99.9 ...
            word = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            row(f"{word} {label} (ms):", result[key], ".2f")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def mean_cached_tokens(outputs: list[RequestOutput]) -> float | None:
    """Mean cached prompt tokens over the successful requests whose usage says; None where none does."""
    counts = [o.cached_tokens for o in outputs if o.success and o.cached_tokens is not None]
    return float(np.mean(counts)) if counts else None


def mean_ttft_ms(outputs: list[RequestOutput]) -> float | None:
    """Mean TTFT of the successful requests, ms; None where none succeeded."""
    ttfts = [o.ttft for o in outputs if o.success]
    return float(np.mean(ttfts)) * 1e3 if ttfts else None


def per_turn_fields(outputs: list[RequestOutput], turns: list[int], percentiles: list[float]) -> list[dict]:
    """Per conversation turn (1-based): its successful requests and their TTFT statistics (ms)."""
    rows = []
    for turn in sorted(set(turns)):
        ttfts = [o.ttft for o, t in zip(outputs, turns) if t == turn and o.success]
        stats = statistics_ms(ttfts, percentiles)
        rows.append({"turn": turn + 1, "completed": len(ttfts), **{f"{k}_ttft_ms": v for k, v in stats.items()}})
    return rows


def format_turn_block(rows: list[dict]) -> str:
    """TTFT by conversation turn: later turns carry longer histories, which a prefix cache shortens."""
    lines = ["{s:{c}^{n}}".format(s=" TTFT per Conversation Turn ", n=WIDTH, c="=")]
    for row in rows:
        label = f"Turn {row['turn']} mean / median TTFT (ms):"
        lines.append(f"{label:<40} {row['mean_ttft_ms']:.2f} / {row['median_ttft_ms']:.2f} "
                     f"({row['completed']} requests)")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def comparison_fields(off: list[RequestOutput], on: list[RequestOutput]) -> dict[str, float | None]:
    """The prefix-caching comparison's figures: mean TTFT of each run, their ratio, mean cached tokens."""
    ttft_off, ttft_on = mean_ttft_ms(off), mean_ttft_ms(on)
    return {"mean_ttft_ms_caching_off": ttft_off, "mean_ttft_ms_caching_on": ttft_on,
            "mean_ttft_ratio_on_off": ttft_on / ttft_off if ttft_on is not None and ttft_off else None,
            "mean_cached_tokens_caching_off": mean_cached_tokens(off),
            "mean_cached_tokens_caching_on": mean_cached_tokens(on)}


def format_comparison(fields: dict[str, float | None]) -> str:
    """The comparison's block; a figure the runs could not give reads n/a."""
    lines = ["{s:{c}^{n}}".format(s=" Prefix Caching: On vs Off ", n=WIDTH, c="=")]
    for label, key in (("Mean TTFT, caching off (ms):", "mean_ttft_ms_caching_off"),
                       ("Mean TTFT, caching on (ms):", "mean_ttft_ms_caching_on"),
                       ("Mean TTFT ratio (on / off):", "mean_ttft_ratio_on_off"),
                       ("Mean cached prompt tokens, off:", "mean_cached_tokens_caching_off"),
                       ("Mean cached prompt tokens, on:", "mean_cached_tokens_caching_on")):
        value = fields[key]
        lines.append(f"{label:<40} {'n/a' if value is None else format(value, '.2f'):<10}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)
