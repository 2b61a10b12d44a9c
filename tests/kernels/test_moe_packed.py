"""The CPU expert GEMM over weights prepacked for oneDNN (kernels/moe_packed.py): equal to the
torch reference, zeros past the last count, where it applies, and how the expert layer and
the dispatcher use it (packed at load; ignored when MEGAINFER_KERNELS names a backend); on a
CPU where oneDNN cannot pack bfloat16 (forced here with ONEDNN_MAX_CPU_ISA=AVX2), the experts
stay unpacked and say why; gpt-oss's experts (biases, clamped SwiGLU) packed, against
transformers' computation."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import dispatch, moe_packed, moe_ref
from kernels.moe_packed import PackedExperts
from megainfer.model.expert_layer import ExpertLayer
from megainfer.model.weights import RandomWeights
from megainfer.presets import PRESETS
from tests.kernels.gpt_oss_experts import ALPHA, LIMIT, HFExperts, assert_clamp_binds

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN (mkldnn) is not built in")

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def experts(dtype: torch.dtype, n: int = 4, hidden: int = 64, inter: int = 48):
    g = torch.Generator().manual_seed(0)
    w_gate_up = (torch.randn(n, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w_down = (torch.randn(n, hidden, inter, generator=g) * 0.1).to(dtype)
    return w_gate_up, w_down


def offsets_of(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spare_rows", [0, 3])
def test_packed_gemm_equals_the_reference_and_rows_past_the_counts_are_zero(dtype, spare_rows):
    if not moe_packed.onednn_packs(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU (its ISA lacks avx512bw/vl/dq and avx_ne_convert)")
    w_gate_up, w_down = experts(dtype)
    counts = [3, 0, 5, 2]  # expert 1 gets no rows
    rows = sum(counts) + spare_rows
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, w_gate_up.shape[2], generator=g).to(dtype)
    row_weights = torch.rand(rows, generator=g)
    packed = PackedExperts.pack(w_gate_up, w_down)
    out = moe_packed.grouped_expert_gemm(x, counts, packed, row_weights)
    ref = moe_ref.grouped_expert_gemm(x, offsets_of(counts), w_gate_up, w_down, row_weights)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    assert torch.all(out[sum(counts):] == 0)
    assert out[:sum(counts)].abs().sum() > 0


def test_packing_leaves_the_weights_untouched():
    w_gate_up, w_down = experts(torch.float32)
    before = (w_gate_up.clone(), w_down.clone())
    PackedExperts.pack(w_gate_up, w_down)
    assert torch.equal(w_gate_up, before[0]) and torch.equal(w_down, before[1])


def test_available_only_for_cpu_float32_and_bfloat16_where_onednn_packs_them():
    cpu = torch.device("cpu")
    assert moe_packed.available(cpu, torch.float32)
    # bfloat16 as the CPU allows: torch's own check agrees with the probe.
    assert moe_packed.available(cpu, torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not moe_packed.available(cpu, torch.float16)
    assert not moe_packed.available(torch.device("meta"), torch.float32)
    assert not moe_packed.available(torch.device("cuda"), torch.float32)  # a type check: nothing is allocated


@pytest.mark.parametrize("expert_ids", [None, [1, 3, 6]], ids=["all", "subset"])
def test_the_expert_layer_packs_at_load_and_its_forward_is_unchanged(monkeypatch, expert_ids):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    cfg = PRESETS["tiny-mixtral"]
    layer = ExpertLayer(cfg, 1, torch.float32, "cpu", expert_ids=expert_ids)
    assert layer.packed is None
    layer.load_weights(RandomWeights(0))
    assert layer.packed is not None and len(layer.packed.gate_up) == len(layer.expert_ids)

    calls = []
    packed_gemm = moe_packed.grouped_expert_gemm
    monkeypatch.setattr(moe_packed, "grouped_expert_gemm", lambda *a, **k: calls.append(1) or packed_gemm(*a, **k))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(21, cfg.hidden_size, generator=g)
    gating = moe_ref.fused_gating(torch.randn(21, cfg.num_experts, generator=g), cfg.top_k, renormalize=True)
    with torch.no_grad():
        with_packed = layer(x, gating.topk_ids, gating.topk_weights)
        assert calls, "the packed GEMM was not used"
        layer.packed = None
        without = layer(x, gating.topk_ids, gating.topk_weights)
    assert len(calls) == 1
    torch.testing.assert_close(with_packed, without, rtol=1e-5, atol=1e-5)


def test_the_dispatcher_ignores_packed_weights_when_the_environment_names_a_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "reference")

    def refuse(*args):
        raise AssertionError("the packed GEMM ran although MEGAINFER_KERNELS=reference")

    monkeypatch.setattr(moe_packed, "grouped_expert_gemm", refuse)
    w_gate_up, w_down = experts(torch.float32)
    counts = [2, 4, 0, 1]
    x = torch.randn(sum(counts), w_gate_up.shape[2])
    row_weights = torch.rand(sum(counts))
    offsets = torch.tensor(offsets_of(counts))
    out = kernels.grouped_expert_gemm(x, offsets, w_gate_up, w_down, row_weights,
                                      packed=PackedExperts.pack(w_gate_up, w_down))
    ref = moe_ref.grouped_expert_gemm(x, offsets_of(counts), w_gate_up, w_down, row_weights)
    torch.testing.assert_close(out, ref)


GPT_OSS = moe_ref.ExpertActivation(alpha=ALPHA, limit=LIMIT)


@pytest.mark.parametrize("clamped", [True, False], ids=["clamped", "silu"])
@pytest.mark.parametrize("biases", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_gpt_oss_experts_match_transformers_loop_and_the_reference(dtype, biases, clamped):
    """gpt-oss's experts over packed weights, the biases taken per call: transformers' float32
    loop over its interleaved layout, the reference's numbers, zeros past the last count."""
    if not moe_packed.onednn_packs(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU (its ISA lacks avx512bw/vl/dq and avx_ne_convert)")
    hf = HFExperts.random(4, 40, 24, seed=21, dtype=dtype)
    w_gate_up, w_down, gate_up_bias, down_bias = hf.megainfer()
    counts = [5, 0, 16, 9]
    total = sum(counts)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(total + 3, 40, generator=g).to(dtype)
    row_weights = torch.rand(total + 3, generator=g)
    assert_clamp_binds(hf, x, offsets_of(counts))
    variant = dict(activation=GPT_OSS if clamped else moe_ref.SWIGLU, gate_up_bias=gate_up_bias if biases else None,
                   down_bias=down_bias if biases else None)
    out = moe_packed.grouped_expert_gemm(x, counts, PackedExperts.pack(w_gate_up, w_down), row_weights, **variant)
    want = hf.forward(x, offsets_of(counts), row_weights, clamped=clamped, biases=biases)
    assert out.dtype == dtype and torch.all(out[total:] == 0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(out.float(), want, **tol)
    ref = moe_ref.grouped_expert_gemm(x, offsets_of(counts), w_gate_up, w_down, row_weights, **variant)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_the_dispatcher_runs_gpt_oss_experts_packed(monkeypatch):
    """On the CPU with packed experts the dispatcher hands the activation and the biases to the
    packed GEMM (none of them is dropped on the way)."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    hf = HFExperts.random(4, 40, 24, seed=23)
    w_gate_up, w_down, gate_up_bias, down_bias = hf.megainfer()
    counts = [2, 4, 0, 1]
    x = torch.randn(sum(counts), 40, generator=torch.Generator().manual_seed(24))
    row_weights = torch.rand(sum(counts))
    calls = []
    packed_gemm = moe_packed.grouped_expert_gemm
    monkeypatch.setattr(moe_packed, "grouped_expert_gemm", lambda *a, **k: calls.append(1) or packed_gemm(*a, **k))
    out = kernels.grouped_expert_gemm(x, torch.tensor(offsets_of(counts)), w_gate_up, w_down, row_weights,
                                      packed=PackedExperts.pack(w_gate_up, w_down), activation=GPT_OSS,
                                      gate_up_bias=gate_up_bias, down_bias=down_bias)
    assert calls
    torch.testing.assert_close(out, hf.forward(x, offsets_of(counts), row_weights), atol=1e-4, rtol=1e-4)


def test_packed_gemm_names_a_bias_it_cannot_add():
    w_gate_up, w_down = experts(torch.float32)
    packed = PackedExperts.pack(w_gate_up, w_down)
    x, row_weights = torch.randn(3, 64), torch.rand(3)
    with pytest.raises(ValueError, match=r"gate_up_bias: want a contiguous \[4, 96\]"):
        moe_packed.grouped_expert_gemm(x, [3, 0, 0, 0], packed, row_weights, gate_up_bias=torch.zeros(4, 48))
    with pytest.raises(ValueError, match="down_bias: dtype torch.bfloat16"):
        moe_packed.grouped_expert_gemm(x, [3, 0, 0, 0], packed, row_weights,
                                       down_bias=torch.zeros(4, 64, dtype=torch.bfloat16))


# Under ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2-only EPYC has): a bfloat16 and a float32 expert
# layer, loaded and run; prints whether each packed and how far bf16 is from float32.
AVX2_RUN = """
import json, logging, torch
from kernels import moe_ref
from megainfer.model.expert_layer import ExpertLayer
from megainfer.model.weights import RandomWeights
from megainfer.presets import PRESETS
logging.basicConfig(level=logging.INFO)
cfg = PRESETS["tiny-mixtral"]
g = torch.Generator().manual_seed(2)
x = torch.randn(21, cfg.hidden_size, generator=g)
gating = moe_ref.fused_gating(torch.randn(21, cfg.num_experts, generator=g), cfg.top_k, renormalize=True)
result = {}
for dtype in (torch.float32, torch.bfloat16):
    layer = ExpertLayer(cfg, 1, dtype, "cpu")
    layer.load_weights(RandomWeights(0))
    with torch.no_grad():
        result[str(dtype)] = (layer.packed is not None, layer(x.to(dtype), gating.topk_ids, gating.topk_weights).float())
(f32_packed, f32), (bf16_packed, bf16) = result.values()
print(json.dumps(dict(f32_packed=f32_packed, bf16_packed=bf16_packed,
                      error=((bf16 - f32).norm() / f32.norm()).item())))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 ISA")
def test_bfloat16_experts_stay_unpacked_and_say_why_where_onednn_cannot_pack_them():
    """oneDNN capped at AVX2 refuses the bfloat16 reorder (mkldnn_reorder_linear_weight: bf16
    path needs avx_ne_convert or avx512bw/vl/dq): the layer keeps its bf16 experts unpacked,
    runs them through the torch GEMM, logs the reason once, and still packs float32."""
    env = {k: v for k, v in os.environ.items() if k != dispatch.ENV} | {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", AVX2_RUN], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["f32_packed"] and not result["bf16_packed"]
    assert result["error"] < 0.02  # bf16 against float32, the same weights
    assert out.stderr.count("CPU experts in torch.bfloat16: unpacked weights") == 1
    assert "avx512bw" in out.stderr  # oneDNN's own reason, in the log
