"""A GPU's entry in the planner's efficiency-curves YAML, written by the fit
(`python -m megainfer.tools.simulator.curve_fit --write`): its text, and the file with that entry
replaced (or appended), every other line and comment kept."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from planner.efficiency_curves import OPTIONAL_FIELDS, EfficiencyCurves, Saturation


def _number(value: float) -> str:
    return f"{value:.4g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.3e}".replace("e-0", "e-")


def entry_text(gpu: str, curves: EfficiencyCurves, fitted: set[str], result: str = "",
               command: str = "python -m megainfer.tools.simulator.curve_fit --gpu {gpu} --write",
               source: str = "fitted to the layered-prefill paper's Qwen3-30B-A3B runs on 2 x H100 (arXiv 2510.08055)",
               ) -> str:
    """The GPU's YAML entry: the `fitted` fields only (the rest are `default`'s, held fixed in
    the fit); `result` says how the fit ended (objective, evaluations), `command` what wrote it."""
    names = fitted
    fixed = sorted({f"{op}.{leg}" for op in ("gemm", "moe", "attention") for leg in ("flops", "bandwidth")
                    if f"{op}.{leg}.peak" not in names and f"{op}.{leg}.half" not in names} |
                   {f"{op}.{leg}.half" for op in ("gemm", "moe", "attention") for leg in ("flops", "bandwidth")
                    if f"{op}.{leg}.peak" in names and f"{op}.{leg}.half" not in names} |
                   {n for n in ("launch_s", "allreduce_latency_s", "link") if n not in names})
    lines = [f"{gpu}:",
             f"  # Fitted by `{command.format(gpu=gpu)}`"
             + (f" ({result})" if result else "") + ";",
             *textwrap.wrap(f"held at `default`: {', '.join(fixed)}. Data and method: docs/performance-model.md.",
                            width=100, initial_indent="  # ", subsequent_indent="  # "),
             f"  source: \"{source}\""]
    for op in ("gemm", "moe", "attention"):
        legs = []
        for leg in ("flops", "bandwidth"):
            if any(f"{op}.{leg}.{field}" in names for field in ("peak", "half")):
                s: Saturation = getattr(getattr(curves, op), leg)
                legs.append(f"{leg}: [{_number(s.peak)}, {_number(s.half)}]")
        if legs:
            lines.append(f"  {op + ':':10s} {{{', '.join(legs)}}}")
    for name in ("launch_s", "step_overhead_s", "step_overhead_per_seq_s", "allreduce_latency_s", "link",
                 *OPTIONAL_FIELDS):
        if name in names:
            lines.append(f"  {name}: {_number(getattr(curves, name))}")
    return "\n".join(lines) + "\n"


def write_entry(path: Path, gpu: str, text: str) -> None:
    """Replace the GPU's top-level entry in the curves file (or append one), leaving the rest of
    the file, comments included, as it was."""
    source = path.read_text()
    block = re.compile(rf"^{re.escape(gpu)}:[^\n]*\n(?:(?:[ \t]+[^\n]*|[ \t]*)\n)*", re.MULTILINE)
    match = block.search(source)
    if match:
        # Keep blank lines that separated the entry from the next one.
        tail = match.group(0)[len(match.group(0).rstrip("\n")) + 1:]
        source = source[:match.start()] + text + tail + source[match.end():]
    else:
        source = source.rstrip("\n") + "\n" + text
    path.write_text(source)
    EfficiencyCurves.load(gpu, path)  # the file still loads
