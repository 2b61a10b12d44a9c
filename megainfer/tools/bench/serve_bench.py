"""`megainfer bench serve`: online load against a running server, measured, printed and saved
as `vllm bench serve` does it, so a megainfer run sits beside a vLLM or SGLang run of the same
workload.

The workload (serve_datasets.py) depends only on the tokenizer, the seed and the dataset
arguments; requests go out on vLLM's schedule: all at once for a rate of inf, else gaps drawn
from a gamma distribution of shape --burstiness and mean 1/rate (burstiness 1 is a Poisson
process; the gaps are scaled so the last request leaves at num_prompts / rate), with at most
--max-concurrency in flight. A trace (--dataset-name trace) brings its own schedule: each request
leaves at its arrival after the start, so --request-rate and --burstiness do not apply and are
refused. A conversation (--dataset-name conversation, openai-chat only) paces its turns the same
way, turn-major, and each turn leaves no earlier than its slot and no earlier than the completion of
its conversation's previous turn (failed or not: the history holds the recorded replies, not the
server's), so conversations run side by side while each one's turns run in order; the result adds
each turn's TTFT. One asyncio client carries every request (serve_requests.py); the figures are
vLLM's (serve_metrics.py).

--compare-prefix-caching measures automatic prefix caching in one invocation, on the same requests
and schedule twice: POST /reset_prefix_cache (vLLM's route; gRPC: ResetPrefixCache; a server
without it gets a printed note and no reset), the requests with a distinct `cache_salt` each
(vLLM's body field, the sampling message's over gRPC: no request shares cached blocks, caching in
effect off), reset again, the same requests without salts (caching on). It prints both result
blocks and the ratio of mean TTFT (on / off) with the mean cached prompt tokens of each run where
the server reports them; the result holds
both runs ("caching_off", "caching_on") and those figures. The off run goes first, so it also bears
any warm-up of the server: warm it with a short run beforehand. Datasets whose requests share
prefixes show the effect: prefix_repetition, conversation, random with --random-prefix-len.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from megainfer.tools.bench.serve_datasets import DatasetSpec, SampleRequest, sample_requests
from megainfer.tools.bench.serve_metrics import (PERCENTILE_METRICS, calculate_metrics, comparison_fields, format_block,
                                           format_comparison, format_turn_block, output_lengths, per_turn_fields,
                                           result_fields)
from megainfer.tools.bench.serve_requests import (BACKENDS, OPENAI_ENDPOINTS, REQUEST_FUNCS, RequestInput, RequestOutput,
                                            open_session, reset_prefix_cache, server_model)
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
    compare_prefix_caching: bool = False  # two runs: every request salted (caching off), then unsalted (on)

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
        self._check_dataset_and_mode()
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

    def _check_dataset_and_mode(self) -> None:
        if self.dataset.name == "trace":
            if math.isfinite(self.request_rate) or self.burstiness != 1.0:
                raise ConfigError("--request-rate and --burstiness pace generated requests; --dataset-name trace "
                                  "sends each request at its arrival in the trace: drop them (or rescale the "
                                  "trace's arrivals)")
            if self.backend == "openai-chat":
                raise ConfigError("--dataset-name trace sends prompts of exactly input_len token ids, which "
                                  "/v1/chat/completions cannot take (its chat template adds tokens); use --backend "
                                  "openai or megainfer-grpc")
        if self.dataset.name == "conversation" and self.backend != "openai-chat":
            raise ConfigError(f"--dataset-name conversation sends each turn as chat messages (the conversation so "
                              f"far), which only /v1/chat/completions takes: use --backend openai-chat, not "
                              f"{self.backend}")

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
    """Run the benchmark; print vLLM's block; return the dict vLLM saves (comparing prefix caching:
    each run's under "caching_off" and "caching_on", beside the comparison's figures)."""
    return asyncio.run(_run(config, metadata or {}))


async def _run(config: ServeBenchConfig, metadata: dict[str, str]) -> dict[str, Any]:
    async with open_session(config.backend, config.target, config.max_concurrency) as session:
        model_name, model_id = await _model_names(config, session)
        tokenizer_id = config.tokenizer or model_id
        tokenizer, max_model_len = load_bench_tokenizer(tokenizer_id)
        requests = sample_requests(config.dataset, tokenizer, max_model_len)
        _print_traffic(config, requests)
        if config.compare_prefix_caching:
            body = await _compare_prefix_caching(config, requests, session, model_name, tokenizer)
        else:
            body = (await _measure(config, requests, session, model_name, tokenizer))[0]
    header = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": config.backend,
              "backend": config.backend, "label": config.label, "model_id": model_id, "tokenizer_id": tokenizer_id,
              "num_prompts": len(requests), **metadata,
              "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
              "burstiness": config.burstiness, "max_concurrency": config.max_concurrency}
    return {**header, **body}


async def _model_names(config: ServeBenchConfig, session: Any) -> tuple[str, str]:
    """The name requests ask for and the model's id (the default tokenizer)."""
    if config.model is not None:
        return config.served_model_name or config.model, config.model
    print("Model not specified, fetching first model from server...")
    served = await server_model(config.backend, session, config.target)
    print(f"First model name: {served.name}, first model id: {served.root}")
    return config.served_model_name or served.name, served.root


def _print_traffic(config: ServeBenchConfig, requests: list[SampleRequest]) -> None:
    if config.dataset.name == "trace":
        print(f"Traffic: trace arrivals, {len(requests)} requests over {requests[-1].arrival_s:.2f} s")
    else:
        distribution = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {config.request_rate}")
        print(f"Burstiness factor: {config.burstiness} ({distribution})")
    if config.dataset.name == "conversation":
        conversations = len({r.conversation for r in requests})
        print(f"Conversations: {conversations}, {len(requests)} turns (each after its conversation's previous one)")
    print(f"Maximum request concurrency: {config.max_concurrency}")


async def _compare_prefix_caching(config: ServeBenchConfig, requests: list[SampleRequest], session: Any,
                                  model_name: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """The same requests twice, after a cache reset each: salted apart (caching off), then unsalted (on);
    both runs' fields and the comparison's figures."""
    runs, outputs = {}, {}
    salt = f"megainfer-bench-{secrets.token_hex(8)}-"  # one per invocation: no earlier run's blocks match either
    noted = False
    for name, salt_prefix in (("caching_off", salt), ("caching_on", None)):
        if not await reset_prefix_cache(config.backend, session, config.target) and not noted:
            where = (f"ResetPrefixCache at {config.target} is not implemented (an older megainfer server)"
                     if config.backend == "megainfer-grpc" else
                     f"POST {config.target}/reset_prefix_cache found no such route (vLLM serves it with "
                     f"VLLM_SERVER_DEV_MODE=1)")
            print(f"Note: {where}; the runs go on without emptying the prefix cache, so the caching-on "
                  f"run may also hit blocks cached before this benchmark")
            noted = True
        print(f"Prefix caching {'off (a distinct cache_salt per request)' if salt_prefix else 'on (no salts)'}:")
        runs[name], outputs[name] = await _measure(config, requests, session, model_name, tokenizer, salt_prefix)
    figures = comparison_fields(outputs["caching_off"], outputs["caching_on"])
    print(format_comparison(figures))
    return {"compare_prefix_caching": True, **figures, **runs}


async def _measure(config: ServeBenchConfig, requests: list[SampleRequest], session: Any, model_name: str,
                   tokenizer: Tokenizer, salt_prefix: str | None = None) -> tuple[dict[str, Any], list[RequestOutput]]:
    """One run of the requests: its result fields (vLLM's, plus per_turn for a conversation),
    printed as vLLM's block, and its outputs."""
    outputs, duration = await _send(config, requests, session, model_name, salt_prefix)
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
    if config.dataset.name == "conversation":
        fields["per_turn"] = per_turn_fields(outputs, [r.turn for r in requests], config.metric_percentiles)
        print(format_turn_block(fields["per_turn"]))
    return fields, outputs


def _request_input(config: ServeBenchConfig, request: SampleRequest, model_name: str,
                   salt_prefix: str | None) -> RequestInput:
    # Token ids go as they are where the API takes them; the chat endpoint gets their text.
    ids = request.prompt_token_ids
    return RequestInput(
        prompt=request.prompt if ids is None or config.backend == "openai-chat" else list(ids),
        prompt_len=request.prompt_len, output_len=request.expected_output_len, model=model_name, url=config.api_url,
        request_id=request.request_id, ignore_eos=config.ignore_eos, sampling=config.sampling,
        messages=[{"role": role, "content": text} for role, text in request.messages] if request.messages else None,
        cache_salt=None if salt_prefix is None else salt_prefix + request.request_id)


async def _send(config: ServeBenchConfig, requests: list[SampleRequest], session: Any, model_name: str,
                salt_prefix: str | None = None) -> tuple[list[RequestOutput], float]:
    func = REQUEST_FUNCS[config.backend]
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), disable=config.disable_tqdm, file=sys.stderr)

    async def one(inp: RequestInput, after: asyncio.Task | None) -> RequestOutput:
        if after is not None:
            await asyncio.wait([after])  # the conversation's previous turn, whatever its outcome
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
    latest: dict[int, asyncio.Task] = {}  # conversation -> the task of its latest turn sent
    start = time.perf_counter()
    for request, at in zip(requests, times):
        if (wait := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        task = asyncio.create_task(one(_request_input(config, request, model_name, salt_prefix),
                                       latest.get(request.conversation)))
        if request.conversation is not None:
            latest[request.conversation] = task
        tasks.append(task)
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
