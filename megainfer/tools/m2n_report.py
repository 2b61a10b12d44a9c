"""Presentation of `megainfer bench m2n`: the table with ratios, the JSON, the plot."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict

from megainfer.tools.bench.report import format_table, write_json


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


def parse_backends(text: str) -> list[str]:
    """'shm,tcp,nixl' -> ['shm', 'tcp', 'nixl']; torch only alone."""
    from transport.bench_spec import BACKENDS

    backends = [b.strip().lower() for b in text.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS + ("torch",)]
    if bad or not backends:
        raise ValueError(f"--backend {text!r}: choose from {', '.join(BACKENDS)} (comma-separated), or torch alone")
    if "torch" in backends and len(backends) > 1:
        raise ValueError("--backend torch runs alone; to compare, use --baseline torch with M2N backends")
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backend {text!r} names a backend twice")
    return backends


def unavailable(backend: str) -> str:
    """Why `backend` cannot run on this machine ('' where it can)."""
    if backend == "rdma":
        from transport.rdma import available
    elif backend == "nixl":
        from transport.nixl import available
    else:
        return ""
    ok, reason = available()
    return "" if ok else reason


def _row(r) -> list[str]:
    return [f"{r.pattern}{' duplex' if r.duplex else ''} {r.senders}x{r.receivers}", human(r.bytes), str(r.iters),
            f"{r.p50_us:.1f}", f"{r.p99_us:.1f}", f"{r.p999_us:.1f}", f"{r.gbps:.2f}", f"{r.msg_rate:,.0f}"]


RAW_COLUMNS = ["pattern", "size", "iters", "p50 us", "p99 us", "p99.9 us", "GB/s", "msg/s"]


def table(results, baseline, floor) -> str:
    """One backend's M2N rows with their ratios to the baseline and the floor, then those two."""
    base = {r.bytes: r for r in baseline}
    low = {r.bytes: r for r in floor}
    rows = []
    for r in results:
        b, f = base.get(r.bytes), low.get(r.bytes)
        rows.append(_row(r) + [f"{r.gbps / b.gbps:.1f}x" if b else "-", f"{r.p50_us / b.p50_us:.3f}" if b else "-",
                               f"{r.p99_us / b.p99_us:.3f}" if b else "-",
                               f"{r.gbps / f.gbps:.0%}" if f else "-", f"{r.p99_us / f.p99_us:.2f}x" if f else "-"])
    out = [format_table(RAW_COLUMNS + ["GB/s vs base", "p50 vs base", "p99 vs base", "GB/s of floor",
                                       "p99 vs floor"], rows)]
    for title, rs in (("baseline", baseline), ("floor", floor)):
        if rs:
            out.append(f"\n{title} ({rs[0].system} over {rs[0].backend}):")
            out.append(format_table(RAW_COLUMNS, [_row(r) for r in rs]))
    return "\n".join(out)


def tables(results) -> str:
    """Every backend's table (ratios against the torch baseline and that backend's floor)."""
    baseline = [r for r in results if r.system == "torch"]
    backends = list(dict.fromkeys(r.backend for r in results if r.system == "m2n"))
    if not backends:
        return table(baseline, [], [])
    return "\n\n".join(f"M2N over {b}:\n" + table([r for r in results if r.system == "m2n" and r.backend == b],
                                                    baseline, [r for r in results
                                                               if r.system == "floor" and r.backend == b])
                        for b in backends)


def save_json(path: str, backends: list[str], results) -> None:
    keys = ("backend", "pattern", "senders", "receivers", "bytes", "duplex", "iters", "p50_us", "p99_us", "p999_us",
            "gbps", "msg_rate")

    def shape(system):
        return [{k: asdict(r)[k] for k in keys} for r in results if r.system == system]

    write_json(path, {"backend": ",".join(backends), "machine": machine(), "results": shape("m2n"),
                      "baseline": shape("torch"), "floor": shape("floor")})


def plot(path: str, results) -> None:
    """One chart for every backend: latency (p50 solid, p99 faint) and throughput against
    size; each backend's floor dashed in its colour, torch.distributed dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lines = [(r.system, r.backend) for r in results]
    backends = list(dict.fromkeys(b for s, b in lines if s != "torch"))  # one colour each
    for system, backend in dict.fromkeys(lines):
        rs = [r for r in results if (r.system, r.backend) == (system, backend)]
        colour = "black" if system == "torch" else colours[backends.index(backend) % len(colours)]
        style, label = {"m2n": ("-o", f"M2N {backend}"), "floor": ("--", f"floor {backend}"),
                        "torch": (":^", f"torch.distributed ({backend})")}[system]
        xs = [r.bytes / 1024 for r in rs]
        lat.plot(xs, [r.p50_us for r in rs], style, color=colour, label=f"{label} p50")
        if system != "floor":
            lat.plot(xs, [r.p99_us for r in rs], style, color=colour, alpha=0.35, label=f"{label} p99")
        tput.plot(xs, [r.gbps for r in rs], style, color=colour, label=label)
    first = results[0]
    shape = f"{first.pattern}{' duplex' if first.duplex else ''} {first.senders}x{first.receivers}"
    for ax, ylabel in ((lat, "latency (us)"), (tput, "throughput (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (KiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    lat.set_title(f"latency, {shape}")
    tput.set_title(f"throughput, {shape}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
