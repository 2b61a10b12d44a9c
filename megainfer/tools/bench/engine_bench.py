"""`megainfer bench engine`: offline throughput of the engine against transformers' generate.

The workload is random token ids with uniformly drawn prompt and output lengths; every
request generates exactly its output length (EOS ignored). transformers runs the same
prompts and weights in the same process, batched and left-padded with `max_new_tokens`
set to the batch's longest output (vLLM's HF baseline); both sides count only the
requested tokens.
"""

from __future__ import annotations

import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megainfer.tools.bench.report import format_table, write_json
from megainfer.engine.engine import Engine
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.model.weights import RandomWeights, save_checkpoint
from megainfer.sampling_params import SamplingParams


@dataclass
class EngineBenchSpec:
    model: str
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0
    vs_hf: bool = False
    hf_batch_size: int = 64


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class RunResult:
    system: str
    elapsed_s: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)  # per request, arrival to first token (megainfer)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s

    @property
    def mean_ttft_s(self) -> float | None:
        return sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else None

    def as_dict(self) -> dict:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s, "requests_per_s": self.requests_per_s,
                "mean_ttft_s": self.mean_ttft_s}


def make_workload(spec: EngineBenchSpec, vocab_size: int) -> Workload:
    rng = random.Random(spec.seed)
    prompts, outs = [], []
    for _ in range(spec.num_prompts):
        n = rng.randint(*spec.input_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(n)])
        outs.append(rng.randint(*spec.output_len))
    return Workload(prompts, outs)


def run_megainfer(engine: Engine, work: Workload) -> RunResult:
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(f"bench-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    generated = 0
    ttft = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            generated += len(delta.new_token_ids)
            if delta.finished:
                if delta.error:
                    raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                ttft.append(delta.metrics.queued_s + delta.metrics.prefill_s)  # arrival to first token
    elapsed = time.perf_counter() - start
    if generated != work.output_tokens:
        raise RuntimeError(f"megainfer generated {generated} tokens, the workload asks for {work.output_tokens}")
    return RunResult("megainfer", elapsed, len(work.prompts), work.prompt_tokens, work.output_tokens, ttft)


def run_transformers(model, work: Workload, batch_size: int, pad_id: int) -> RunResult:
    device = model.device
    start = time.perf_counter()
    for b in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[b:b + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        new = max(work.output_lens[b:b + batch_size])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return RunResult("transformers", elapsed, len(work.prompts), work.prompt_tokens, work.output_tokens)


def load_transformers_model(engine: Engine, model: str, tmp: Path):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ConfigError("--vs-hf needs transformers: pip install 'megainfer[test]'") from None
    path = Path(model)
    if not path.is_dir():  # a preset: write its seeded weights as a checkpoint transformers can read
        path = save_checkpoint(engine.model_config, RandomWeights(engine.config.seed), tmp / "checkpoint",
                               dtype=engine.config.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, engine.config.dtype))
    return hf.to(engine.config.device).eval()


def run_engine_bench(spec: EngineBenchSpec, config: EngineConfig, json_path: str | None = None) -> int:
    engine = Engine(spec.model, config.replace(show_progress=True))
    work = make_workload(spec, engine.model_config.vocab_size)
    print(f"workload: {spec.num_prompts} prompts, input {spec.input_len[0]}:{spec.input_len[1]} "
          f"({work.prompt_tokens} tokens), output {spec.output_len[0]}:{spec.output_len[1]} "
          f"({work.output_tokens} tokens); model {engine.model_config.name}, {config.dtype}, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    warm = Workload(work.prompts[:2], [4, 4])
    run_megainfer(engine, warm)
    before = engine.stats().expert_bytes_read
    results = [run_megainfer(engine, work)]
    stats = engine.stats()
    expert_bytes = stats.expert_bytes_read - before
    if spec.vs_hf:
        with tempfile.TemporaryDirectory() as tmp:
            hf = load_transformers_model(engine, spec.model, Path(tmp))
            run_transformers(hf, warm, spec.hf_batch_size, pad_id=0)
            results.append(run_transformers(hf, work, spec.hf_batch_size, pad_id=0))
    rows = [[r.system, r.elapsed_s, r.requests_per_s, r.output_tokens_per_s, r.total_tokens_per_s,
             f"{r.mean_ttft_s * 1e3:.0f}" if r.mean_ttft_s is not None else "-"] for r in results]
    print(format_table(["system", "time s", "req/s", "output tok/s", "total tok/s", "mean TTFT ms"], rows))
    ratio = results[0].output_tokens_per_s / results[1].output_tokens_per_s if spec.vs_hf else None
    if ratio is not None:
        print(f"megainfer / transformers output throughput: {ratio:.2f}x")
    energy = (f"{stats.energy_per_token_j:.3f} J/token" if stats.energy_per_token_j is not None
              else f"unavailable ({stats.energy_unavailable})")
    print(f"prefill policy {config.prefill_policy}, preemptions {stats.num_preemptions}, steps {stats.num_steps}, "
          f"expert-weight bytes read {expert_bytes / 2**20:,.0f} MiB, energy {energy}")
    if json_path:
        write_json(json_path, {
            "benchmark": "engine", "spec": asdict(spec), "dtype": config.dtype, "device": config.device,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "torch": torch.__version__,
            "results": [r.as_dict() for r in results], "ratio_output_tokens_per_s": ratio,
            "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
            "prefill_policy": config.prefill_policy, "expert_bytes_read": expert_bytes,
            "energy_per_token_j": stats.energy_per_token_j, "energy_unavailable": stats.energy_unavailable,
        })
    return 0
