"""`python -m megainfer.gpucheck`: plan the checks, run each in its own process inside the
budget, keep gpucheck.jsonl and gpucheck.md current (see the package's docstring)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megainfer.tools.gpucheck.records import JSONL, SUMMARY, CheckRecord, RecordLog, Status, write_summary

DEFAULT_BUDGET_S = 420.0
SUMMARY_RESERVE_S = 3.0  # kept back from the budget to stop the last check and write the summary
LOG = "gpucheck.log"  # every check's own output, appended


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    gpu_s: float  # expected seconds on one H100 from a cold Triton cache (docs/benchmarks.md says what was seen)
    cap_s: float  # longer than this and the check is taken for hung and stopped
    min_s: float  # started only with at least this much budget left (else: not run)


# In order of value: what no CPU run can tell first.
CHECKS = (
    Check("environment", "GPU, SMs, memory, driver, torch/Triton/CUDA, the C compiler Triton needs, the M2N core "
          "(built in place if missing: ~15 s)", 25, 120, 5),
    Check("kernels", "every Triton kernel, forced, against its torch reference at real bf16 shapes", 150, 300, 20),
    Check("engine", "the colocated engine against transformers (float32 tokens equal, bf16 up to rounding)", 45,
          180, 15),
    Check("pair", "an attention and an expert node in two processes, bf16, m = 1 and 2, CUDA graphs and eager", 80,
          200, 20),
    Check("graphs", "decode's CUDA graphs captured, replayed against eager and timed (Qwen3-235B plan's halves)", 40,
          150, 15),
    Check("memory", "pinned host<->device copies, KV sizing, an NVML energy read, a dma-buf export, a stream held "
          "on a word (the rdma marks' wait)", 20, 90, 5),
    Check("kernel_bench", "POD vs the serial pair, grouped GEMM vs a cuBLAS loop, decode vs SDPA", 60, 180, 15),
)
NAMES = tuple(c.name for c in CHECKS)


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _child_env(device: str) -> dict[str, str]:
    """The checks' environment: compiled Triton kernels, forced, on CUDA (a kernel that fails is a
    failure, never a fallback to the reference); Triton's interpreter on the CPU."""
    env = dict(os.environ)
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)
        env["MEGAINFER_KERNELS"] = "triton"
    else:
        env["TRITON_INTERPRET"] = "1"
        env.pop("MEGAINFER_KERNELS", None)
    root = str(Path(__file__).resolve().parents[3])  # the checkout, for `PYTHONPATH=.` runs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), root) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


class Runner:
    def __init__(self, out: Path, budget_s: float, device: str, checks: tuple[Check, ...]) -> None:
        self.out, self.budget_s, self.device, self.checks = out, budget_s, device, checks
        self.log = RecordLog(out)
        self.start = time.time()
        self.deadline = self.start + budget_s
        self.header = [f"- command: `{shlex.join(['python', '-m', 'megainfer.gpucheck', *sys.argv[1:]])}`",
                       f"- device: {device}; budget {budget_s:g} s; commit "
                       f"{_git_commit(Path(__file__).resolve().parents[3])}",
                       f"- started {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(self.start))}"]
        self._shown = 0

    def plan(self) -> str:
        lines = [f"megainfer GPU check on {self.device}: budget {self.budget_s:g} s, results in {self.out}/{JSONL} "
                 f"and {self.out}/{SUMMARY}", "checks, in this order (seconds expected on one H100, cold caches):"]
        lines += [f"  {i}. {c.name:13s} ~{c.gpu_s:>4.0f} s  {c.what}" for i, c in enumerate(self.checks, 1)]
        total = sum(c.gpu_s for c in self.checks)
        lines.append(f"  expected in all ~{total:.0f} s; a check still running at the budget is stopped and "
                     "everything finished so far is kept")
        return "\n".join(lines)

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (JSONL, SUMMARY, LOG):
            (self.out / name).unlink(missing_ok=True)
        print(self.plan(), flush=True)
        for check in self.checks:
            self._run_one(check)
            self._summarise()
        records = self.log.read()
        failed = [r for r in records if r.status is Status.FAILED]
        not_run = [r for r in records if r.status is Status.NOT_RUN]
        print(f"\n{len(records)} results in {time.time() - self.start:.0f} s: "
              + ", ".join(f"{sum(1 for r in records if r.status is s)} {s.value}" for s in Status)
              + f"\nsummary: {self.out / SUMMARY}", flush=True)
        for r in failed:
            print(f"FAILED {r.check} {r.case}: {r.detail}", flush=True)
        if not_run:
            print(f"{len(not_run)} check(s) not run or cut off: the budget ({self.budget_s:g} s) ran out; "
                  "raise --budget-s or pick checks with --checks", flush=True)
        return 1 if failed else 2 if not_run else 0

    def _left(self) -> float:
        return self.deadline - SUMMARY_RESERVE_S - time.time()

    def _run_one(self, check: Check) -> None:
        left = self._left()
        if left < check.min_s:
            self.log.append(CheckRecord(check.name, "", Status.NOT_RUN, 0.0, {},
                                        f"the budget had {max(left, 0):.0f} s left; the check needs at least "
                                        f"{check.min_s:g} s"))
            return
        limit = min(left, check.cap_s)
        command = [sys.executable, "-m", "megainfer.tools.gpucheck.child", check.name, "--device", self.device,
                   "--out", str(self.out), "--deadline", f"{time.time() + limit:.3f}"]
        started = time.time()
        with (self.out / LOG).open("a") as log_file:
            log_file.write(f"\n===== {check.name}: {shlex.join(command)}\n")
            log_file.flush()
            # A session of its own: the budget stops the check and every process it started.
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=_child_env(self.device),
                                       start_new_session=True)
            code = self._wait(process, started + limit)
        seconds = round(time.time() - started, 1)
        if code is None:
            cut_by_budget = limit < check.cap_s
            self.log.append(CheckRecord(
                check.name, "", Status.NOT_RUN if cut_by_budget else Status.FAILED, seconds, {},
                (f"cut off by the budget after {seconds:g} s: the results above are what it finished" if cut_by_budget
                 else f"ran past its {check.cap_s:g} s cap and was stopped (hung?); see {LOG}")))
        elif code != 0:
            self.log.append(CheckRecord(check.name, "", Status.FAILED, seconds, {},
                                        f"the check's process exited with {code}: {self._log_tail()}"))
        self._show_new()

    def _wait(self, process: subprocess.Popen, until: float) -> int | None:
        """The exit code, or None when `until` came first (the process group is then killed)."""
        while True:
            code = process.poll()
            self._show_new()
            if code is not None:
                return code
            if time.time() >= until:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
                return None
            time.sleep(0.2)

    def _show_new(self) -> None:
        records = self.log.read()
        for r in records[self._shown:]:
            figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.figures.items())
            print(f"  {r.status.value.upper():8s} {r.check} {r.case} ({r.seconds:.1f} s)"
                  + (f"  {figures}" if figures else "") + (f"  -- {r.detail}" if r.detail else ""), flush=True)
        self._shown = len(records)

    def _log_tail(self, lines: int = 15) -> str:
        text = (self.out / LOG).read_text(errors="replace").splitlines()
        return " / ".join(text[-lines:])

    def _summarise(self) -> None:
        write_summary(self.out, self.header, self.log.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megainfer.gpucheck",
                                     description="Everything a GPU machine should tell megainfer, in one command. "
                                                 "Exit status: 0 all ran and none failed, 1 a check failed, 2 none "
                                                 "failed but the budget cut some off.")
    parser.add_argument("--out", required=True, type=Path, help="folder for gpucheck.jsonl, gpucheck.md, gpucheck.log")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"stop by then, keeping what finished (default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: real shapes, compiled kernels; cpu: small shapes, Triton's interpreter")
    parser.add_argument("--checks", default=",".join(NAMES),
                        help=f"comma-separated, run in the order of value whatever the order given ({','.join(NAMES)})")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(NAMES))
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    if args.budget_s <= SUMMARY_RESERVE_S:
        parser.error(f"--budget-s {args.budget_s:g}: must exceed {SUMMARY_RESERVE_S:g} s")
    device = _device(args.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    checks = tuple(c for c in CHECKS if c.name in wanted)
    return Runner(args.out, args.budget_s, device, checks).run()
