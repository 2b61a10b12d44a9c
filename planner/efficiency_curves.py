"""Efficiency curves: how close each class of operator comes to a GPU's datasheet peaks, as a
function of its problem size, plus the fixed costs the roofline leaves out (kernel launches,
the serving framework's work per step).

The roofline prices an operator at max(FLOPs / peak FLOP/s, bytes / peak bandwidth). Real
kernels reach a fraction of either peak that grows with the problem and saturates: a GEMM of
8 rows cannot fill the tensor cores, a 1 MB read cannot fill HBM. Each curve is that fraction
as `peak · x / (x + half)` of a size x (tokens per GEMM, bytes read), two numbers per leg.
Where a profile measured an operator (`operator_profile`), its table wins; the curves price
everything else.

The curves live in a YAML file (planner/efficiency_curves.yaml by default): a `default`
entry, and per-GPU entries fitted to published measurements that override it field by field.
docs/performance-model.md gives the fits' data and method.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from megainfer.errors import PlanError

DEFAULT_CURVES = Path(__file__).with_name("efficiency_curves.yaml")


# Fields a curves entry may leave out (0: the term is off), added since the first fits.
OPTIONAL_FIELDS = ("moe_width_half", "layer_host_s", "moe_quantized_flops_half", "moe_quantized_bandwidth",
                   "moe_overlap", "request_latency_s", "moe_tuned_bandwidth")


@dataclass(frozen=True)
class Saturation:
    """Achieved fraction of a peak at size x: peak · x / (x + half)."""

    peak: float
    half: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.peak <= 1) or not (self.half >= 0) or not math.isfinite(self.half):
            raise PlanError(f"an efficiency curve needs 0 < peak <= 1 and half >= 0, got {self.peak}, {self.half}")

    def __call__(self, x):
        return self.peak * x / (x + self.half)


@dataclass(frozen=True)
class OperatorCurves:
    """One operator class: its FLOP-rate curve (x: tokens per GEMM, or query tokens for
    attention) and its bandwidth curve (x: bytes the call reads)."""

    flops: Saturation
    bandwidth: Saturation

    def with_bandwidth_share(self, share: float) -> "OperatorCurves":
        """The same curves with the bandwidth's peak scaled by `share` (at most the whole peak): a
        kernel that streams the same bytes at another rate."""
        return OperatorCurves(self.flops, Saturation(min(1.0, self.bandwidth.peak * share), self.bandwidth.half))


@dataclass(frozen=True)
class EfficiencyCurves:
    gemm: OperatorCurves  # dense projections, router, LM head
    moe: OperatorCurves  # grouped expert GEMMs; flops x: tokens per expert
    attention: OperatorCurves  # flops x: a prefill chunk's query tokens; bandwidth x: KV bytes read
    launch_s: float  # one kernel launch (and its share of synchronisation)
    step_overhead_s: float  # the framework's fixed cost per step (scheduling, preparation, output)
    step_overhead_per_seq_s: float  # and per sequence in the step
    allreduce_latency_s: float  # one tensor-parallel all-reduce, beyond its bytes
    link: float  # achieved fraction of NVLink/PCIe bandwidth in an all-reduce
    source: str = ""  # where the figures come from
    # The expert GEMMs' FLOP rate also grows with their width (an expert's intermediate size on
    # one rank: 384 for Qwen3-30B-A3B at TP 2, 1,440 for gpt-oss-120b): x / (x + this). 0: no
    # width term (what a fit to one model cannot pin down; validation.py fits it across models).
    moe_width_half: float = 0.0
    # The host's time to issue one layer of a step. The layered-prefill paper's engine replays
    # each layer as captured graph pieces and calls its attention eagerly in between (a compiled
    # function's guards, FlashAttention's own launches); a layer too large for its graphs is
    # launched kernel by kernel. The host issues layers while the GPU runs the ones before, so
    # a step's layers take max(their kernels, layers x this): decode steps of small batches,
    # whose layers finish in less, wait for the host. 0: the host always keeps ahead.
    layer_host_s: float = 0.0
    # Experts stored in 4 bits (MXFP4) run a different kernel: weights dequantized in registers
    # (W4A16, Marlin-style), memory-bound to more tokens per expert than the bf16 grouped GEMM.
    # Its FLOP curve's half-saturation in tokens per expert (the peak is the bf16 one's); 0: as bf16.
    moe_quantized_flops_half: float = 0.0
    # The same kernel's weight streaming as a share of the bf16 grouped GEMM's achieved bandwidth
    # (each 4-bit load is unpacked and scaled before its MMA, which a plain bf16 load is not);
    # 0: as bf16.
    moe_quantized_bandwidth: float = 0.0
    # How the expert GEMMs' weight streaming and their MMAs combine: 0 the roofline's max (they
    # overlap fully); p > 0 the p-norm of the two times, p = 1 their sum (they serialise), larger
    # p closer to the max. A grouped GEMM of 32 to 128 tokens per expert sits where both matter.
    moe_overlap: float = 0.0
    # A request's way outside the engine's steps, as a client measures TTFT: the HTTP request,
    # tokenisation, the hand-over to the engine's process and the first token's way back. Added
    # to every TTFT (not to the time between tokens, which streams); 0: none.
    request_latency_s: float = 0.0
    # The expert GEMMs' weight streaming where the engine runs tiles tuned for the experts'
    # shape on that GPU, as a share of what its default tiles achieve (vLLM's fused_moe reads
    # them from a file named by the experts, their width per rank and the device, and falls back
    # to small default tiles where it has none: 16 x 32 x 64 with Triton's default stages for
    # decode-sized calls). Applies to a step model built with `tuned_expert_tiles`; 0: as default.
    moe_tuned_bandwidth: float = 0.0

    @classmethod
    def load(cls, gpu: str, path: str | os.PathLike | None = None) -> "EfficiencyCurves":
        """The curves for `gpu`: its entry over the file's default, or the default alone."""
        path = Path(path) if path else DEFAULT_CURVES
        if not path.is_file():
            raise PlanError(f"--curves {str(path)!r}: no such file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise PlanError(f"{path}: not valid YAML ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("default"), dict):
            raise PlanError(f"{path}: an efficiency-curves file is a mapping with a `default` entry and GPU entries")
        merged = dict(data["default"])
        own = data.get(gpu)
        if own is not None:
            if not isinstance(own, dict):
                raise PlanError(f"{path}: entry {gpu!r} must be a mapping of curve fields")
            for key, value in own.items():
                merged[key] = {**merged[key], **value} if isinstance(value, dict) and isinstance(
                    merged.get(key), dict) else value
        merged.setdefault("source", "")
        if own is None:
            merged["source"] = f"default curves ({gpu} has no fitted entry): {merged['source']}"
        return cls.from_dict(merged, f"{path}: {gpu if own is not None else 'default'}")

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "EfficiencyCurves":
        names = {f.name for f in dataclasses.fields(cls)}
        if "eager_layer_s" in data:  # a curves file written before session 23
            raise PlanError(f"{where}: eager_layer_s is no longer a curves field: the host's time to issue every "
                            "layer is layer_host_s (docs/performance-model.md); delete the line, or write the file "
                            "again with `megainfer simulate --validate --write-curves PATH`")
        unknown = sorted(set(data) - names)
        if unknown:
            raise PlanError(f"{where}: unknown field {unknown[0]!r}; fields: {', '.join(sorted(names))}")
        missing = sorted(names - set(data) - {"source", *OPTIONAL_FIELDS})
        if missing:
            raise PlanError(f"{where}: missing field {missing[0]!r}")
        try:
            ops = {name: OperatorCurves(Saturation(*map(float, data[name]["flops"])),
                                         Saturation(*map(float, data[name]["bandwidth"])))
                   for name in ("gemm", "moe", "attention")}
            scalars = {name: float(data[name]) for name in ("launch_s", "step_overhead_s", "step_overhead_per_seq_s",
                                                             "allreduce_latency_s", "link")}
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{where}: gemm/moe/attention need flops: [peak, half] and bandwidth: [peak, half]; "
                            f"the rest are numbers ({exc})") from None
        if any(v < 0 or not math.isfinite(v) for v in scalars.values()) or not 0 < scalars["link"] <= 1:
            raise PlanError(f"{where}: times must be finite and >= 0, link in (0, 1]")
        optional = {}
        for name in OPTIONAL_FIELDS:
            try:
                optional[name] = float(data.get(name, 0.0))
            except (TypeError, ValueError):
                optional[name] = math.nan
            if not optional[name] >= 0 or not math.isfinite(optional[name]):
                raise PlanError(f"{where}: {name} must be a finite number >= 0, got {data.get(name)!r}")
        return cls(**ops, **scalars, source=str(data.get("source", "")), **optional)

    def with_values(self, **changes) -> "EfficiencyCurves":
        """A copy with some fields replaced (the fit's search)."""
        return dataclasses.replace(self, **changes)
