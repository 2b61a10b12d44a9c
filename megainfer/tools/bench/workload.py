"""Requests for the simulator: arrival time, prompt length, output length.

Built-in workloads model the two traces the layered-prefill paper ("From Tokens to Layers",
arXiv 2510.08055) serves: ShareGPT conversations (the openchat ShareGPT4 trace, filtered to 8K
tokens) and arXiv summarisation. Lengths are log-normal, clipped to the trace's length filter
and the model's context:

- arxiv: matched to the mean and standard deviation the paper reports for its arXiv workload
  (input mean 9,194, std 5,754, p90 17,152; output mean 231, std 104, p90 386 tokens). A
  log-normal through mean and std puts p90 5% low (16,250 and 365); one through mean and
  p90 puts std 17-18% high, so mean and std it is.
- sharegpt: matched to the median and 90th percentile Sarathi-Serve (OSDI'24, Table 2)
  publishes for the trace the paper's artifact samples.
- sharegpt-lp: that trace's own lengths, as the paper's benchmark driver draws them (its
  prompt and output lengths in 1,001 quantiles each, traces/sharegpt_lp_lengths.json: mean,
  p90 and std 2,340 / 5,696 / 2,088 and 438 / 834 / 265, as the paper quotes). A log-normal
  through the same mean and std has the same second moment but a tail the trace does not: its
  p99 prompt is 10,400 tokens where the trace's is 7,434 (and none above 8,141), which near
  capacity queues every prompt behind prompts the paper never sent.

Arrivals are Poisson, or bursty (gamma inter-arrival times with a chosen coefficient of
variation; CV 1 is Poisson). `exact_rate` scales a draw's arrivals so that it offers exactly the
rate asked for: n Poisson arrivals conditioned on spanning (n - 1) / rate seconds (exponential
gaps over their sum are uniform spacings, so only the draw's own rate error goes). Near capacity
that error dominates a run: 1,560 arrivals at 2.6 req/s stray from the rate by 2.5% (one standard
deviation), and at 90% load a 6% faster draw more than doubles the mean wait. A JSONL trace of
{"arrival": s, "input_len": n, "output_len": n} lines replays recorded traffic instead.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from megainfer.errors import ConfigError

_Z90 = 1.2815515655446004  # standard normal 90th percentile


def _strata(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` probabilities in random order, one from each of n equal-probability strata (Latin
    hypercube), so a few hundred requests already follow the trace's mean, p90 and std:
    independent draws of 300 arXiv prompts miss the std by 10% or more at many seeds."""
    return (rng.permutation(n) + rng.random(n)) / n


@dataclass(frozen=True)
class LogNormalLengths:
    """Token lengths whose natural logarithm is normal with mean `mu` and deviation `sigma`."""
    mu: float
    sigma: float

    @classmethod
    def from_median_p90(cls, median: float, p90: float) -> LogNormalLengths:
        return cls(math.log(median), math.log(p90 / median) / _Z90)

    @classmethod
    def from_mean_std(cls, mean: float, std: float) -> LogNormalLengths:
        variance = math.log1p((std / mean) ** 2)  # of log(length)
        return cls(math.log(mean) - variance / 2, math.sqrt(variance))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths in random order, one from each of n equal-probability strata (_strata)."""
        quantiles = _strata(rng, n)
        normal = NormalDist()
        return np.exp(self.mu + self.sigma * np.array([normal.inv_cdf(q) for q in quantiles]))


@dataclass(frozen=True)
class QuantileLengths:
    """Token lengths drawn from a trace's quantiles: `quantiles[i]` at probability
    i / (len - 1), linear between them."""
    quantiles: tuple[float, ...]

    @classmethod
    def from_trace_file(cls, path: Path) -> tuple[QuantileLengths, QuantileLengths]:
        """(prompt, output) lengths of a trace file (traces/*.json), read once."""
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(tuple(data["prompt"]["quantiles"])), cls(tuple(data["output"]["quantiles"]))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths in random order, one from each of n equal-probability strata (_strata)."""
        return np.interp(_strata(rng, n), np.linspace(0.0, 1.0, len(self.quantiles)), self.quantiles)


_SHAREGPT_LP = QuantileLengths.from_trace_file(Path(__file__).with_name("traces") / "sharegpt_lp_lengths.json")


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    prompt: LogNormalLengths | QuantileLengths
    output: LogNormalLengths | QuantileLengths
    max_total: int | None  # the trace's filter on prompt + output tokens
    source: str


WORKLOADS = {
    "sharegpt": WorkloadSpec("sharegpt", LogNormalLengths.from_median_p90(1730, 5696),
                             LogNormalLengths.from_median_p90(415, 834), 8192,
                             "openchat ShareGPT4, 8K-filtered: median and p90 (Sarathi-Serve Table 2)"),
    "arxiv": WorkloadSpec("arxiv", LogNormalLengths.from_mean_std(9194, 5754), LogNormalLengths.from_mean_std(231, 104),
                          None, "arXiv summarization: mean and std (layered-prefill paper, arXiv 2510.08055)"),
    "sharegpt-lp": WorkloadSpec("sharegpt-lp", *_SHAREGPT_LP, None,
                                "ShareGPT as the layered-prefill paper's driver samples it: the trace's quantiles "
                                "(arXiv 2510.08055)"),
}
ARRIVALS = ("poisson", "bursty")


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    input_len: int
    output_len: int
    prefix_id: int = -1  # its prompt starts with shared prefix `prefix_id` (-1: nothing shared)
    prefix_len: int = 0  # tokens of that prefix (part of input_len)

    def prompt_token_ids(self, own_first: int) -> list[int]:
        """Token ids standing for the prompt where only sharing matters (the simulators' prefix
        caches): prefix p is the same run of ids in every request that has it, the rest are the
        ids from `own_first` on, which no other request uses."""
        shared = range(1 + self.prefix_id * self.prefix_len, 1 + (self.prefix_id + 1) * self.prefix_len) \
            if self.prefix_id >= 0 else range(0)
        return [*shared, *range(own_first, own_first + self.input_len - len(shared))]


def with_shared_prefixes(requests: list[SimRequest], *, num_prefixes: int, prefix_len: int, max_model_len: int,
                         seed: int = 0) -> list[SimRequest]:
    """Each request's prompt behind one of `num_prefixes` shared prefixes of `prefix_len` tokens
    (a system prompt or few-shot examples; vLLM's prefix_repetition), drawn uniformly; prompts are
    shortened to keep prompt + output within `max_model_len`."""
    if num_prefixes <= 0 or prefix_len <= 0:
        raise ConfigError(f"--shared-prefixes and --prefix-len must be positive, got {num_prefixes} and {prefix_len}")
    rng = np.random.default_rng(seed + 1)
    which = rng.integers(0, num_prefixes, len(requests))
    out = []
    for r, p in zip(requests, which):
        room = max_model_len - r.output_len - prefix_len
        if room < 1:
            raise ConfigError(f"--prefix-len {prefix_len} leaves no room for a prompt of its own and "
                              f"{r.output_len} output tokens in a context of {max_model_len}; shorten it")
        out.append(SimRequest(r.arrival_s, prefix_len + min(r.input_len, room), r.output_len, int(p), prefix_len))
    return out


def arrival_times(rng: np.random.Generator, n: int, rate: float, arrival: str, cv: float,
                  exact_rate: bool = False) -> np.ndarray:
    if not rate > 0 or not math.isfinite(rate):
        raise ConfigError(f"--rate must be a positive number of requests per second, got {rate}")
    if arrival not in ARRIVALS:
        raise ConfigError(f"--arrival {arrival!r}: choose one of {', '.join(ARRIVALS)}")
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    else:
        if not cv > 0 or not math.isfinite(cv):
            raise ConfigError(f"--cv must be a positive number (1 is Poisson, above 1 burstier), got {cv}")
        shape = 1.0 / (cv * cv)  # gamma with mean 1/rate and the requested coefficient of variation
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    times = np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0
    if exact_rate and n > 1 and times[-1] > 0:
        times *= (n - 1) / rate / times[-1]  # the draw's pattern, at the rate asked for
    return times


def generate(workload: str, *, num_requests: int, rate: float, max_model_len: int, arrival: str = "poisson",
             cv: float = 1.0, seed: int = 0, exact_rate: bool = False) -> list[SimRequest]:
    """`num_requests` requests of a built-in workload (`exact_rate`: arrivals scaled to offer
    exactly `rate`, the draw's lengths and arrival pattern unchanged)."""
    spec = WORKLOADS.get(workload)
    if spec is None:
        raise ConfigError(f"--workload {workload!r}: choose one of {', '.join(WORKLOADS)} or a JSONL trace file")
    if num_requests <= 0:
        raise ConfigError(f"--requests must be positive, got {num_requests}")
    rng = np.random.default_rng(seed)
    limit = min(max_model_len, spec.max_total or max_model_len)
    outputs = np.clip(np.rint(spec.output.sample(rng, num_requests)), 1, limit // 2).astype(int)
    prompts = np.rint(spec.prompt.sample(rng, num_requests)).astype(int)
    prompts = np.clip(prompts, 1, limit - outputs)
    times = arrival_times(rng, num_requests, rate, arrival, cv, exact_rate)
    return [SimRequest(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs)]


def load_trace(path: str | os.PathLike, *, max_model_len: int, num_requests: int | None = None) -> list[SimRequest]:
    """A JSONL trace: one {"arrival": seconds, "input_len": tokens, "output_len": tokens} per line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--workload {str(path)!r} is neither a built-in workload ({', '.join(WORKLOADS)}) "
                          "nor a trace file")
    requests = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or {"arrival", "input_len", "output_len"} - set(row):
                raise ConfigError(f"{where}: each line needs arrival (s), input_len and output_len (tokens)")
            arrival, n_in, n_out = row["arrival"], row["input_len"], row["output_len"]
            if not isinstance(arrival, (int, float)) or arrival < 0 or not math.isfinite(arrival):
                raise ConfigError(f"{where}: arrival must be seconds >= 0, got {arrival!r}")
            for name, value in (("input_len", n_in), ("output_len", n_out)):
                if not isinstance(value, int) or value < 1:
                    raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
            if n_in + n_out > max_model_len:
                raise ConfigError(f"{where}: input_len + output_len = {n_in + n_out} exceeds the context limit "
                                  f"of {max_model_len} tokens (the model's, or --max-model-len where a bench "
                                  f"sets it)")
            requests.append(SimRequest(float(arrival), n_in, n_out))
            if num_requests is not None and len(requests) == num_requests:
                break
    if not requests:
        raise ConfigError(f"{path}: the trace holds no requests")
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def describe(requests: list[SimRequest]) -> dict[str, dict[str, float]]:
    """Mean, median, p90 and standard deviation of input and output lengths (the paper's Table 4 columns)."""
    out = {}
    for name, values in (("input", [r.input_len for r in requests]), ("output", [r.output_len for r in requests])):
        a = np.asarray(values, dtype=np.float64)
        out[name] = {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
                     "std": float(a.std())}
    return out
