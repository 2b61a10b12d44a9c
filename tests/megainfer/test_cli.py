"""The command line as a user meets it: help is fast, errors are one line, benches write JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import pytest

from tests.helpers import ROOT, megainfer


def test_help_does_not_import_torch():
    code = ("import sys; from megainfer.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported by the CLI parser'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    out = megainfer("--help")
    assert out.returncode == 0 and "generate" in out.stdout and "bench" in out.stdout


def test_generate_streams_and_reports_throughput():
    out = megainfer("generate", "--model", "tiny-mixtral", "--prompt", "Hello", "--max-tokens", "12",
                    "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert "12 tokens in" in out.stderr and "tokens/s" in out.stderr and "finish reason length" in out.stderr


def test_generate_with_prompt_ids_on_a_checkpoint(qwen3_ref):
    out = megainfer("generate", "--model", str(qwen3_ref.path), "--prompt-ids",
                    ",".join(map(str, qwen3_ref.prompts[0])), "--max-tokens", "4", "--ignore-eos")
    assert out.returncode == 0, out.stderr


def test_max_model_len_caps_prompts_on_every_engine_command():
    out = megainfer("generate", "--prompt", "x" * 40, "--max-model-len", "32")
    assert out.returncode == 2 and "max length is 32" in out.stderr
    for command in (["serve"], ["bench", "engine"], ["generate"]):
        text = megainfer(*command, "--help").stdout
        assert "--max-model-len" in text and "--dtype" in text and "auto (default)" in text


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "no-such-model", "--prompt", "x"], "is neither a checkpoint directory"),
    (["generate", "--model", "no-org/no-such-model", "--prompt", "x"], "`hf download no-org/no-such-model`"),
    (["generate", "--prompt", "x", "--max-model-len", "5000"], "max_model_len 5000 exceeds the model's "
                                                                "max_position_embeddings (4096)"),
    (["generate", "--model", "mixtral-8x7b", "--prompt", "x"], "shape-only"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "must be positive"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "top_p must be a number in (0, 1]"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature must be a number >= 0"),
    (["generate", "--prompt-ids", "1,a"], "comma-separated integers"),
    (["generate", "--prompt", "x" * 5000], "max length is 4096"),
    (["bench", "engine", "--input-len", "9:3"], "need 1 <= A <= B"),
])
def test_bad_input_is_one_clear_line_without_traceback(args, message, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty hub cache: nothing is found, nothing fetched
    out = megainfer(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_engine_vs_transformers_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = megainfer("bench", "engine", "--model", "tiny-mixtral", "--num-prompts", "4", "--input-len", "8:24",
                    "--output-len", "4:8", "--vs-hf", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert "megainfer / transformers output throughput" in out.stdout
    data = json.loads(path.read_text())
    systems = [r["system"] for r in data["results"]]
    assert systems == ["megainfer", "transformers"]
    assert data["results"][0]["output_tokens"] == data["results"][1]["output_tokens"]
    assert data["ratio_output_tokens_per_s"] > 0


def test_layering_rules_hold():
    tool = ROOT.parent / "shared" / "tools" / "check_layers.py"
    if not tool.is_file():
        pytest.skip("../shared/tools/check_layers.py is not beside this checkout")
    out = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout


def test_plan_runs_without_torch_and_writes_plan_json_and_chart(tmp_path):
    plan, report, chart = tmp_path / "plan.yaml", tmp_path / "plan.json", tmp_path / "gantt.png"
    code = ("import sys; from megainfer.cli import main; "
            f"rc = main(['plan', '--model', 'dbrx', '--gpus', 'A800,H20,L40S', '--top', '3', '-o', {str(plan)!r}, "
            f"'--json', {str(report)!r}, '--explain', '--plot', {str(chart)!r}]); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules, 'plan imported torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "colocated baseline" in out.stdout and "disaggregation gains over it" in out.stdout
    assert "bound the pipeline" in out.stdout  # --explain
    from megainfer.plan import Plan
    loaded = Plan.load(plan)
    assert (loaded.attention.gpu, loaded.experts.gpu) == ("H20", "L40S")
    assert loaded.predicted.tbt_ms <= 150
    data = json.loads(report.read_text())
    assert data["candidates"][0]["attention_gpu"] == "H20" and data["ratios"]["per_cost"] > 1
    assert chart.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["plan", "--model", "dbrx", "--gpus", "H30"], "unknown GPU 'H30'; the catalog knows"),
    (["plan", "--model", "qwen3-235b-a22b", "--gpus", "H100", "--tbt-slo-ms", "1"],
     "no plan meets a TBT SLO of 1 ms"),
    (["plan", "--model", "dbrx", "--price", "H20"], "write GPU=PRICE"),
    (["plan", "--model", "dbrx", "--catalog", "/nonexistent.yaml"], "does not exist"),
    (["plan", "--model", "llama-70b"], "is neither a checkpoint directory"),
])
def test_plan_bad_input_is_one_line(args, message):
    out = megainfer(*args)
    assert out.returncode == 2, out.stdout
    assert message in out.stderr and "Traceback" not in out.stderr
