"""Presentation of `megainfer bench m2n`: the table with ratios, the JSON, the plot."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict

from megainfer.bench.report import format_table, write_json


def parse_sizes(text: str) -> list[int]:
    """'4K,64K,256K,1M' -> bytes (K = 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B")
        if not part:
            continue
        scale = units.get(part[-1], 1)
        number = part[:-1] if part[-1] in units else part
        if not number.isdigit() or int(number) <= 0:
            raise ValueError(f"--sizes: {part!r} is not a size like 4K, 256K or 1M")
        sizes.append(int(number) * scale)
    if not sizes:
        raise ValueError("--sizes: give at least one size, e.g. 4K,64K,256K,1M")
    return sizes


def human(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def table(results, baseline, floor) -> str:
    base = {(r.pattern, r.bytes): r for r in baseline}
    low = {(r.pattern, r.bytes): r for r in floor}
    rows = []
    for r in results:
        b, f = base.get((r.pattern, r.bytes)), low.get((r.pattern, r.bytes))
        rows.append([f"{r.pattern} {r.senders}x{r.receivers}", human(r.bytes), f"{r.p50_us:.1f}", f"{r.p99_us:.1f}",
                     f"{r.p999_us:.1f}", f"{r.gbps:.2f}", f"{r.msg_rate:,.0f}",
                     f"{r.gbps / b.gbps:.1f}x" if b else "-", f"{r.p50_us / b.p50_us:.3f}" if b else "-",
                     f"{r.p99_us / b.p99_us:.3f}" if b else "-",
                     f"{r.gbps / f.gbps:.0%}" if f else "-", f"{r.p99_us / f.p99_us:.2f}x" if f else "-"])
    out = [format_table(["pattern", "size", "p50 us", "p99 us", "p99.9 us", "GB/s", "msg/s", "GB/s vs base",
                         "p50 vs base", "p99 vs base", "GB/s of floor", "p99 vs floor"], rows)]
    for title, rs in (("baseline", baseline), ("floor", floor)):
        if rs:
            out.append(f"\n{title} ({rs[0].system}):")
            out.append(format_table(["pattern", "size", "p50 us", "p99 us", "p99.9 us", "GB/s", "msg/s"],
                                    [[f"{r.pattern} {r.senders}x{r.receivers}", human(r.bytes), f"{r.p50_us:.1f}",
                                      f"{r.p99_us:.1f}", f"{r.p999_us:.1f}", f"{r.gbps:.2f}", f"{r.msg_rate:,.0f}"]
                                     for r in rs]))
    return "\n".join(out)


def save_json(path: str, backend: str, results, baseline, floor) -> None:
    keys = ("pattern", "senders", "receivers", "bytes", "p50_us", "p99_us", "p999_us", "gbps", "msg_rate")
    shape = lambda rs: [{k: asdict(r)[k] for k in keys} for r in rs]  # noqa: E731
    write_json(path, {"backend": backend, "machine": machine(), "results": shape(results),
                      "baseline": shape(baseline), "floor": shape(floor)})


def plot(path: str, backend: str, results, baseline, floor) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, tput) = plt.subplots(1, 2, figsize=(11, 4))
    for rs, label, style in ((results, f"M2N ({backend})", "-o"), (floor, "floor", "--s"),
                             (baseline, "torch.distributed", ":^")):
        if not rs:
            continue
        xs = [r.bytes / 1024 for r in rs]
        lat.plot(xs, [r.p50_us for r in rs], style, label=f"{label} p50")
        lat.plot(xs, [r.p99_us for r in rs], style, alpha=0.45, label=f"{label} p99")
        tput.plot(xs, [r.gbps for r in rs], style, label=label)
    shape = f"{results[0].pattern} {results[0].senders}x{results[0].receivers}"
    for ax, ylabel in ((lat, "latency (us)"), (tput, "throughput (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (KiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    lat.set_title(f"latency, {shape}")
    tput.set_title(f"throughput, {shape}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
