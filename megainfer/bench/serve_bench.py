"""`megainfer bench serve`: online load against a running server, measured, printed and saved
as `vllm bench serve` does it, so a megainfer run sits beside a vLLM or SGLang run of the same
workload.

The workload (serve_datasets.py) depends only on the tokenizer, the seed and the dataset
arguments; requests go out on vLLM's schedule: all at once for a rate of inf, else gaps drawn
from a gamma distribution of shape --burstiness and mean 1/rate (burstiness 1 is a Poisson
process; the gaps are scaled so the last request leaves at num_prompts / rate), with at most
--max-concurrency in flight. A trace (--dataset-name trace) brings its own schedule: each request
leaves at its arrival after the start, so --request-rate and --burstiness do not apply and are
refused. One asyncio client carries every request (serve_requests.py); the figures are vLLM's
(serve_metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from megainfer.bench.serve_datasets import DatasetSpec, SampleRequest, sample_requests
from megainfer.bench.serve_metrics import (PERCENTILE_METRICS, calculate_metrics, format_block, output_lengths,
                                           result_fields)
from megainfer.bench.serve_requests import (BACKENDS, OPENAI_ENDPOINTS, REQUEST_FUNCS, RequestInput, RequestOutput,
                                            open_session, server_model)
from megainfer.errors import CheckpointError, ConfigError, MegaInferError, RequestError
from megainfer.model_resolution import resolve_model
from megainfer.sampling_params import SamplingParams
from megainfer.tokenizer import Tokenizer, load_tokenizer

DEFAULT_PORTS = {"megainfer-grpc": 50051, "openai": 8000, "openai-chat": 8000}  # megainfer serve's; vLLM's


@dataclass
class ServeBenchConfig:
    """Everything `bench serve` is told, checked where it is built (flag names in the errors)."""

    backend: str = "openai"
    base_url: str | None = None  # http://host:port for the HTTP backends, host:port for megainfer-grpc
    host: str = "127.0.0.1"
    port: int | None = None  # None: DEFAULT_PORTS[backend]
    endpoint: str | None = None  # None: the backend's OpenAI path
    model: str | None = None  # None: asked of the server
    served_model_name: str | None = None  # the name requests ask for; None: the model
    tokenizer: str | None = None  # None: the model
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k where given
    goodput_ms: dict[str, float] = field(default_factory=dict)
    percentile_metrics: list[str] = field(default_factory=lambda: ["ttft", "tpot", "itl"])
    metric_percentiles: list[float] = field(default_factory=lambda: [99.0])
    label: str | None = None
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.backend == "megainfer-grpc" and self.endpoint is not None:
            raise ConfigError(f"--endpoint {self.endpoint} is a path of the HTTP backends; megainfer-grpc calls "
                              f"megainfer.v1.Inference/Generate")
        suffix = OPENAI_ENDPOINTS.get(self.backend, "").removeprefix("/v1")
        if self.endpoint is not None and not self.endpoint.endswith(suffix):
            raise ConfigError(f"--endpoint {self.endpoint}: --backend {self.backend} needs a path ending in {suffix} "
                              f"(e.g. {OPENAI_ENDPOINTS[self.backend]})")
        if self.dataset.name == "trace":
            if math.isfinite(self.request_rate) or self.burstiness != 1.0:
                raise ConfigError("--request-rate and --burstiness pace generated requests; --dataset-name trace "
                                  "sends each request at its arrival in the trace: drop them (or rescale the "
                                  "trace's arrivals)")
            if self.backend == "openai-chat":
                raise ConfigError("--dataset-name trace sends prompts of exactly input_len token ids, which "
                                  "/v1/chat/completions cannot take (its chat template adds tokens); use --backend "
                                  "openai or megainfer-grpc")
        if not self.request_rate > 0:
            raise ConfigError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ConfigError(f"--burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ConfigError(f"--max-concurrency must be positive, got {self.max_concurrency}")
        if not self.percentile_metrics or not set(self.percentile_metrics) <= set(PERCENTILE_METRICS):
            raise ConfigError(f"--percentile-metrics {','.join(self.percentile_metrics)!r}: choose from "
                              f"{','.join(PERCENTILE_METRICS)}")
        try:
            SamplingParams(**self.sampling)
        except RequestError as exc:
            raise ConfigError(f"--temperature/--top-p/--top-k: {exc}") from None

    @property
    def target(self) -> str:
        """host:port for megainfer-grpc, the base URL for the HTTP backends."""
        if self.base_url is not None:
            base = self.base_url.rstrip("/")
            return base.removeprefix("grpc://") if self.backend == "megainfer-grpc" else base
        port = self.port if self.port is not None else DEFAULT_PORTS[self.backend]
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}" if self.backend == "megainfer-grpc" else f"http://{host}:{port}"

    @property
    def api_url(self) -> str:
        return self.target if self.backend == "megainfer-grpc" else \
            self.target + (self.endpoint or OPENAI_ENDPOINTS[self.backend])


def arrival_times(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start at which each request leaves (vLLM's get_request)."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    # Scaled so the last leaves at n / rate: a sum of random gaps misses it by a few percent,
    # which would move the throughput from seed to seed.
    return times * (n / request_rate) / times[-1] if times[-1] > 0 else times


def load_bench_tokenizer(name: str) -> tuple[Tokenizer, int]:
    """The tokenizer of model `name` and the model's context (max_position_embeddings)."""
    try:
        cfg, checkpoint = resolve_model(name)
    except (ConfigError, CheckpointError) as exc:
        raise ConfigError(f"--tokenizer {name}: {exc}") from None
    tokenizer = load_tokenizer(checkpoint, cfg)
    if tokenizer is None:
        raise ConfigError(f"--tokenizer {name}: it has no tokenizer.json and its vocabulary is not bytes; pass "
                          f"--tokenizer a checkpoint directory (or Hugging Face id) with a tokenizer")
    return tokenizer, cfg.max_position_embeddings


def run(config: ServeBenchConfig, metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print vLLM's block; return the dict vLLM saves."""
    return asyncio.run(_run(config, metadata or {}))


async def _run(config: ServeBenchConfig, metadata: dict[str, str]) -> dict[str, Any]:
    async with open_session(config.backend, config.target, config.max_concurrency) as session:
        if config.model is None:
            print("Model not specified, fetching first model from server...")
            served = await server_model(config.backend, session, config.target)
            model_name, model_id = config.served_model_name or served.name, served.root
            print(f"First model name: {served.name}, first model id: {served.root}")
        else:
            model_name, model_id = config.served_model_name or config.model, config.model
        tokenizer_id = config.tokenizer or model_id
        tokenizer, max_model_len = load_bench_tokenizer(tokenizer_id)
        requests = sample_requests(config.dataset, tokenizer, max_model_len)
        if config.dataset.name == "trace":
            print(f"Traffic: trace arrivals, {len(requests)} requests over {requests[-1].arrival_s:.2f} s")
        else:
            distribution = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
            print(f"Traffic request rate: {config.request_rate}")
            print(f"Burstiness factor: {config.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {config.max_concurrency}")
        outputs, duration = await _send(config, requests, session, model_name)
    output_lens = output_lengths(outputs, tokenizer)
    metrics = calculate_metrics(outputs, duration, output_lens, config.goodput_ms)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, error in enumerate(failed[:10]):
            print(f"Error {i}: {error}")
    fields = result_fields(metrics, duration, outputs, output_lens, config.goodput_ms, config.percentile_metrics,
                           config.metric_percentiles)
    print(format_block(fields, config.max_concurrency, config.request_rate, config.percentile_metrics))
    header = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": config.backend,
              "backend": config.backend, "label": config.label, "model_id": model_id, "tokenizer_id": tokenizer_id,
              "num_prompts": len(outputs), **metadata,
              "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
              "burstiness": config.burstiness, "max_concurrency": config.max_concurrency}
    return {**header, **fields}


async def _send(config: ServeBenchConfig, requests: list[SampleRequest], session: Any,
                model_name: str) -> tuple[list[RequestOutput], float]:
    func = REQUEST_FUNCS[config.backend]
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), disable=config.disable_tqdm, file=sys.stderr)

    async def one(inp: RequestInput) -> RequestOutput:
        async with limit:
            output = await func(inp, session)
        bar.update(1)
        return output

    if config.dataset.name == "trace":
        times = np.array([request.arrival_s for request in requests])
    else:
        times = arrival_times(len(requests), config.request_rate, config.burstiness,
                              np.random.default_rng(config.dataset.seed))
    tasks = []
    start = time.perf_counter()
    for request, at in zip(requests, times):
        if (wait := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(RequestInput(
            prompt=request.prompt if request.prompt_token_ids is None else list(request.prompt_token_ids),
            prompt_len=request.prompt_len, output_len=request.expected_output_len,
            model=model_name, url=config.api_url, request_id=request.request_id, ignore_eos=config.ignore_eos,
            sampling=config.sampling))))
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return outputs, duration


def result_filename(result: dict[str, Any], config: ServeBenchConfig, result_dir: str | None,
                    result_filename: str | None) -> Path:
    """vLLM's name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, in --result-dir."""
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    name = result_filename or (f"{config.label or config.backend}-{config.request_rate}qps{concurrency}-"
                               f"{str(result['model_id']).rstrip('/').split('/')[-1]}-{result['date']}.json")
    return Path(result_dir or ".") / name


def save_result(result: dict[str, Any], path: Path) -> None:
    try:
        os.makedirs(path.parent, exist_ok=True)
        path.write_text(json.dumps(result))
    except OSError as exc:
        raise MegaInferError(f"cannot write the result to {path}: {exc.strerror or exc}") from None
