"""`megainfer profile` end to end: resolve what to measure, time every grid point of every
operator (one progress bar over them all), measure the device's peaks and the engine's step
overhead, and assemble the `OperatorProfile`; plus the summary table the CLI prints."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import re
import shlex
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from megainfer.config import SUPPORTED_MODEL_TYPES, ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.model.weights import RandomWeights, SafetensorsCheckpoint
from megainfer.model_resolution import resolve_model
from megainfer.tools.profiler import device_info
from megainfer.tools.profiler.allreduce_timing import measure_allreduce
from megainfer.tools.profiler.operator_grid import OperatorGrid, default_grid, pricing_grid
from megainfer.tools.profiler.operator_timing import OperatorBench
from megainfer.tools.profiler.timing import median_seconds
from planner.operator_profile import OPERATOR_AXES, OperatorProfile, OperatorTable, model_shape

logger = logging.getLogger(__name__)

# Per grid point: GPU timings are short and steady, the CPU's noisier; --quick is a first look.
DEFAULT_MIN_TIME_S = {"cuda": 0.05, "cpu": 0.1}
QUICK_MIN_TIME_S = 0.005
KERNEL_OPERATORS = ("dense", "attention_decode", "attention_prefill", "moe", "lm_head", "sampling")
MIN_MODEL_LEN = 64  # step_overhead's requests need room for their prompt and decode steps
KV_POOL_BYTES = {"cpu": 1 << 30}  # CPU cap of the bench's KV pool; CUDA: a quarter of free memory


@dataclass(frozen=True)
class ProfileRequest:
    """What `megainfer profile` was asked (the CLI's flags)."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    tp: int = 1
    threads: int | None = None
    max_model_len: int | None = None
    quick: bool = False
    min_time_ms: float | None = None
    seed: int = 0

    def command(self) -> str:
        """The command line that repeats this profile."""
        argv = ["megainfer", "profile", "--model", self.model, "--device", self.device, "--dtype", self.dtype,
                "--tp", str(self.tp)]
        for flag, value in (("--threads", self.threads), ("--max-model-len", self.max_model_len),
                            ("--min-time-ms", self.min_time_ms)):
            if value is not None:
                argv += [flag, str(value)]
        return shlex.join(argv + (["--quick"] if self.quick else []))


@dataclass
class ProfileResult:
    profile: OperatorProfile
    spent_s: dict[str, float]  # operator (or "device peaks") -> seconds spent measuring it
    skipped: dict[str, str] = field(default_factory=dict)  # operator -> why it was not measured
    wall_s: float = 0.0


@dataclass(frozen=True)
class ResolvedTarget:
    model: ModelConfig
    checkpoint: Path | None
    config: EngineConfig  # dtype and device concrete
    max_model_len: int
    device: torch.device
    dtype: torch.dtype


def resolve_target(request: ProfileRequest) -> ResolvedTarget:
    """The model, device and dtype to profile; ConfigError naming the flag for what cannot be."""
    model, checkpoint = resolve_model(request.model)
    if model.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"--model {request.model}: a {model.model_type} preset is shape-only (megainfer has no "
                          f"{model.model_type} layers to time); profile a {' or '.join(SUPPORTED_MODEL_TYPES)} model")
    if not (request.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", request.device)):
        raise ConfigError(f"--device {request.device!r} is not a device; choose auto, cpu, cuda or cuda:N")
    if request.tp < 1:
        raise ConfigError(f"--tp {request.tp}: tensor parallelism must be at least 1")
    config = EngineConfig(dtype=request.dtype, device=request.device, seed=request.seed,
                          max_model_len=request.max_model_len, num_threads=request.threads).resolve(model)
    device = torch.device(config.device)
    if device.type == "cpu" and checkpoint is None and not model.runnable_with_random_weights:
        # The bench holds whole layers of random weights (a paper-scale preset's one layer of
        # experts is ~10 GB in float32): on a GPU that is the point, on this host's memory it is not.
        raise ConfigError(f"--model {request.model}: a paper-scale preset is shape-only on the CPU "
                          f"({model.num_params / 1e9:.0f}B parameters of random weights); profile it with --device "
                          "cuda, or profile a checkpoint or a runnable preset (megainfer-demo, tiny-mixtral) here")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {request.device}: torch sees no GPU here; pass --device cpu")
        needed = (device.index or 0) + request.tp
        if needed > torch.cuda.device_count():
            raise ConfigError(f"--tp {request.tp} on {device} needs GPUs up to cuda:{needed - 1}, torch sees "
                              f"{torch.cuda.device_count()}; lower --tp")
    for name, size in (("query heads", model.num_heads), ("KV heads", model.num_kv_heads),
                       ("expert intermediate size", model.expert_intermediate_size)):
        if size % request.tp:
            raise ConfigError(f"--tp {request.tp} does not divide {model.name}'s {size} {name}; pick a --tp "
                              "that divides the heads, the KV heads and the expert intermediate size")
    max_model_len = config.resolved_max_model_len(model)
    if max_model_len < MIN_MODEL_LEN:
        raise ConfigError(f"--max-model-len {max_model_len}: profiling needs at least {MIN_MODEL_LEN}")
    return ResolvedTarget(model, checkpoint, config, max_model_len, device, getattr(torch, config.dtype))


def _measure_allreduce(target, grid, tp: int, min_time_s: float, bar) -> OperatorTable:
    """The all-reduce table across `tp` spawned ranks, at the grid's byte sizes."""
    bar.set_description("allreduce")
    (bytes_axis,) = grid.axes["allreduce"]
    seconds = measure_allreduce(bytes_axis, tp, target.device, target.dtype, min_time_s, torch.get_num_threads())
    bar.update(len(bytes_axis))
    return OperatorTable((tuple(map(float, bytes_axis)),), np.asarray(seconds))


def run_profile(request: ProfileRequest, show_progress: bool = True) -> ProfileResult:
    began = time.perf_counter()
    target = resolve_target(request)
    if request.threads:
        torch.set_num_threads(request.threads)
    kind = target.device.type
    if kind == "cuda":
        torch.cuda.set_device(target.device)
    free_before = torch.cuda.mem_get_info(target.device)[0] if kind == "cuda" else None
    min_time_s = (request.min_time_ms / 1e3 if request.min_time_ms is not None
                  else QUICK_MIN_TIME_S if request.quick else DEFAULT_MIN_TIME_S[kind])
    dtype_bytes = target.dtype.itemsize
    grid = default_grid(target.model, kind, target.max_model_len, request.tp, dtype_bytes, request.quick)
    overhead_skip = _step_overhead_skip_reason(target, free_before)
    if overhead_skip is not None:
        logger.warning("step_overhead will not be measured: %s", overhead_skip)
    pricing = pricing_grid(target.model, grid) if request.tp > 1 and overhead_skip is None else None
    total = grid.total_points + (pricing.total_points if pricing else 0)
    if overhead_skip is not None:
        total -= grid.num_points("step_overhead")

    def timer(fn) -> float:
        return median_seconds(fn, target.device, min_time_s)

    spent: dict[str, float] = {}
    tables: dict[str, OperatorTable] = {}
    with tqdm(total=total, desc="profiling", unit="point", disable=not show_progress) as bar:
        bench = _bench(target, grid, request.tp, request.seed, free_before)
        bench.warm_up()
        for operator in KERNEL_OPERATORS:
            started = time.perf_counter()
            tables[operator] = _measure_table(bench, operator, grid.axes[operator], timer, bar)
            spent[operator] = time.perf_counter() - started
        del bench
        if request.tp > 1:
            started = time.perf_counter()
            tables["allreduce"] = _measure_allreduce(target, grid, request.tp, min_time_s, bar)
            spent["allreduce"] = time.perf_counter() - started
        started = time.perf_counter()
        device = device_info.profiled_device(target.device, target.dtype, request.tp, min_time_s)
        spent["device peaks"] = time.perf_counter() - started
        if overhead_skip is None:
            started = time.perf_counter()
            prices = tables if pricing is None else _pricing_tables(target, pricing, request.seed, free_before,
                                                                    timer, bar)
            tables["step_overhead"] = _measure_step_overhead(target, request, grid, prices, bar)
            spent["step_overhead"] = time.perf_counter() - started
    profile = OperatorProfile(
        device=device, model=model_shape(target.model), dtype=target.config.dtype, tp=request.tp,
        operators={op: tables[op] for op in OPERATOR_AXES if op in tables},
        kv_cache_tokens=device_info.kv_cache_tokens(target.model, target.config, target.max_model_len, request.tp,
                                                    free_before),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=request.command(),
        versions=_versions())
    skipped = {} if overhead_skip is None else {"step_overhead": overhead_skip}
    return ProfileResult(profile, spent, skipped, time.perf_counter() - began)


def _bench(target: ResolvedTarget, grid: OperatorGrid, tp: int, seed: int, free_before: int | None) -> OperatorBench:
    """One rank's layer at `tp`, with a KV pool for the grid's largest batch (capped in bytes)."""
    model, block = target.model, target.config.block_size
    blocks = max(1, _blocks_needed(grid, block))
    block_bytes = 2 * block * (model.num_kv_heads // tp) * model.head_dim * target.dtype.itemsize
    budget = KV_POOL_BYTES["cpu"] if free_before is None else free_before // 4
    weights = SafetensorsCheckpoint(target.checkpoint) if target.checkpoint else RandomWeights(seed)
    return OperatorBench(model, weights, target.dtype, target.device, target.max_model_len,
                         min(blocks, max(1, budget // block_bytes)), block, tp_size=tp, seed=seed)


def _blocks_needed(grid: OperatorGrid, block: int) -> int:
    """KV blocks the largest point of each attention grid uses (every sequence its own)."""
    def blocks(tokens: int) -> int:
        return -(-tokens // block)

    needed = [grid.axes["dense"][0][-1]]  # dense: that many sequences at context 1
    if "attention_decode" in grid.axes:
        seqs, contexts = grid.axes["attention_decode"]
        needed.append(seqs[-1] * blocks(contexts[-1]))
    if "attention_prefill" in grid.axes:
        tokens, cached = grid.axes["attention_prefill"]
        needed.append(blocks(tokens[-1] + cached[-1]))
    return max(needed)


def _measure_table(bench: OperatorBench, operator: str, axes: tuple[tuple[int, ...], ...], timer,
                   bar: tqdm) -> OperatorTable:
    bar.set_description(operator)
    shape = tuple(len(values) for values in axes)
    seconds = np.zeros(shape)
    for index in np.ndindex(*shape):
        seconds[index] = bench.time_point(operator, timer, tuple(values[i] for values, i in zip(axes, index)))
        bar.update(1)
    return OperatorTable(tuple(tuple(float(v) for v in values) for values in axes), seconds)


def _pricing_tables(target: ResolvedTarget, pricing: OperatorGrid, seed: int, free_before: int | None, timer,
                    bar: tqdm) -> dict[str, OperatorTable]:
    """Unsharded (tp = 1) tables at the points step_overhead's subtraction reads: the engine it
    times runs the whole model in one process."""
    bench = _bench(target, pricing, 1, seed, free_before)
    bench.warm_up()
    return {op: _measure_table(bench, op, axes, timer, bar) for op, axes in pricing.axes.items()}


def _step_overhead_skip_reason(target: ResolvedTarget, free_before: int | None) -> str | None:
    """Why the engine cannot run this model here, if it cannot."""
    model = target.model
    if target.checkpoint is None and not model.runnable_with_random_weights:
        return f"{model.name} is a shape-only preset (no weights to run the engine with); pass a checkpoint"
    if free_before is not None:
        weights = model.num_params * target.dtype.itemsize
        if weights > free_before:
            return (f"{model.name}'s weights ({weights / 2**30:.0f} GiB) do not fit one GPU's free "
                    f"{free_before / 2**30:.0f} GiB; the engine runs the whole model on one device")
    return None


def _measure_step_overhead(target: ResolvedTarget, request: ProfileRequest, grid: OperatorGrid,
                           prices: dict[str, OperatorTable], bar: tqdm) -> OperatorTable:
    from megainfer.engine.engine import Engine
    from megainfer.tools.profiler.engine_overhead import measure_step_overhead

    bar.set_description("step_overhead")
    if target.device.type == "cuda":
        torch.cuda.empty_cache()  # the bench's KV pool is gone; the engine sizes its cache from what is free
    (batch_sizes,) = grid.axes["step_overhead"]
    engine = Engine(request.model, dataclasses.replace(target.config, max_num_seqs=batch_sizes[-1]))
    seconds = measure_step_overhead(engine, batch_sizes, grid.overhead_steps, prices, lambda: bar.update(1))
    return OperatorTable((tuple(map(float, batch_sizes)),), np.asarray(seconds))


def _versions() -> dict:
    versions = {"torch": torch.__version__}
    for package in ("triton", "megainfer"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


# -- what the CLI prints and names ------------------------------------------------------------
def default_output_name(profile: OperatorProfile) -> str:
    """`<device>-<model>-tp<T>-<dtype>.json`, e.g. cpu-megainfer-demo-tp1-float32.json."""
    device = profile.device
    device_slug = "cpu" if device.kind == "cpu" else (device.catalog_name or device.name)
    model_slug = Path(str(profile.model.get("name") or "model").rstrip("/")).name
    return f"{_slug(device_slug)}-{_slug(model_slug)}-tp{profile.tp}-{profile.dtype}.json"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unnamed"


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def summary_table(result: ProfileResult) -> str:
    profile = result.profile
    rows = [("operator", "points", "axes", "seconds (min .. max)", "time spent")]
    for operator, table in profile.operators.items():
        axes = ", ".join(f"{name} {values[0]:g}..{values[-1]:g}" for name, values in
                         zip(OPERATOR_AXES[operator], table.axes))
        rows.append((operator, str(table.seconds.size), axes,
                     f"{_duration(table.seconds.min())} .. {_duration(table.seconds.max())}",
                     _duration(result.spent_s.get(operator, 0.0))))
    for operator, why in result.skipped.items():
        rows.append((operator, "0", "not measured", why, ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    d = profile.device
    lines += ["", f"device: {d.name} x{d.count} ({d.kind}{f', catalog {d.catalog_name}' if d.catalog_name else ''}"
                  f"{f', {d.threads} threads' if d.kind == 'cpu' else ''}); {profile.dtype}, tp {profile.tp}",
              f"peak: {d.peak_flops / 1e9:.1f} GFLOP/s GEMM, {d.peak_bytes_per_s / 1e9:.1f} GB/s copy "
              f"(measured in {_duration(result.spent_s.get('device peaks', 0.0))}); KV cache: "
              f"{profile.kv_cache_tokens if profile.kv_cache_tokens is not None else 'n/a'} tokens",
              f"total: {_duration(result.wall_s)}"]
    return "\n".join(lines)
