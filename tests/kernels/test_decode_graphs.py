"""Decode's CUDA graphs (megainfer/disagg/decode_graphs.py) on the CPU: the captured regions are
capture-safe (every op they dispatch, audited against what capture forbids, with the Triton
kernels as the GPU runs them, here under Triton's interpreter); and the graphs' static buffers
and padding give exactly the eager computation, checked by "replaying" a region by running it
again on those buffers, layer by layer and through a whole deployment.

What only a GPU shows (the capture itself, replay speed) is the GPU check's
(`megainfer.gpucheck`, `graphs` in its pair check) and `-m gpu`'s."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import attention_triton  # noqa: E402
from megainfer.disagg import decode_graphs  # noqa: E402
from megainfer.disagg.attention_dispatch import attend_and_pack  # noqa: E402
from megainfer.disagg.capture_audit import CaptureAudit  # noqa: E402
from megainfer.disagg.decode_graphs import (AttentionGraphs, ExpertGraphs, RerunCapture, capture_sizes,  # noqa: E402
                                            size_for)
from megainfer.disagg.expert_link import pack_records, record_bytes, unpack_dispatch  # noqa: E402
from megainfer.model.expert_layer import ExpertLayer  # noqa: E402
from megainfer.model.moe_model import MoEModel  # noqa: E402
from megainfer.model.weights import RandomWeights  # noqa: E402
from megainfer.presets import PRESETS  # noqa: E402
from megainfer.sampling_params import SamplingParams  # noqa: E402
from megainfer.runner.model_runner import prepare_batch  # noqa: E402
from megainfer.tools.launch_count import DecodingSequence  # noqa: E402

if not attention_triton.INTERPRETED:
    pytest.skip("runs the Triton kernels under the interpreter (a session without -m gpu)", allow_module_level=True)

BLOCK = 8
NODES = 2


# Triton's interpreter is not thread-safe: the nodes of a deployment in threads take turns.
INTERPRETER = threading.Lock()


PAD_BLOCK = 28  # the cache's spare block, past the 28 sequences use


def attention_setup(num_blocks: int = PAD_BLOCK):
    cfg = PRESETS["tiny-qwen3-moe"]
    model = MoEModel(cfg, torch.float32, "cpu", 256, with_experts=False)
    with torch.inference_mode():
        model.load_weights(RandomWeights(0))
    node_of = torch.arange(cfg.num_experts) // (cfg.num_experts // NODES)
    for layer in model.attention_layers:
        layer.set_expert_nodes(node_of, NODES)
    g = torch.Generator().manual_seed(1)
    shape = (num_blocks + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)  # one spare: the padding block
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.num_layers)]
    return cfg, model, caches


def decode_inputs(rows: int, first_token: int = 3):
    seqs = [DecodingSequence(f"r{i}", 5 + 2 * i, [3 * i, 3 * i + 1, 3 * i + 2], first_token + i)
            for i in range(rows)]
    return prepare_batch(seqs, [1] * rows, rows, BLOCK, torch.device("cpu"))


def eager_parts(cfg, model, caches, layer, hidden, inputs):
    counts = torch.zeros(cfg.num_experts, dtype=torch.int64)
    with kernels.graph_region():  # the same Triton kernels the graph runs
        parts = attend_and_pack(model.attention_layers[layer], model.rotary, caches[layer], hidden, inputs[1],
                                inputs[2], counts)
    return parts, counts


def node_records(parts, hidden: int, top_k: int) -> list[list[tuple]]:
    """Each expert node's records, unpacked to (ids, weights, x) and sorted by ids and x (the
    gating kernel orders a segment by its atomics)."""
    bounds = parts.node_offsets.tolist()
    out = []
    for n in range(NODES):
        flat = parts.records[bounds[n]:bounds[n + 1]].reshape(-1)
        x, ids, weights = unpack_dispatch(flat, bounds[n + 1] - bounds[n], hidden, top_k, torch.float32)
        rows = [(tuple(ids[i].tolist()), weights[i], x[i]) for i in range(len(x))]
        out.append(sorted(rows, key=lambda r: (r[0], round(float(r[2].sum()), 3))))
    return out


def assert_same_records(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    """The same tokens to the same nodes with the same expert ids; hidden states and gate weights
    equal to float rounding. (A graph runs the padded batch, whose GEMMs the CPU's BLAS may
    block differently from the live rows' alone: bitwise equality holds on some CPUs only.)"""
    assert [[r[0] for r in node] for node in got] == [[r[0] for r in node] for node in want]
    for node_got, node_want in zip(got, want):
        for (_, w_got, x_got), (_, w_want, x_want) in zip(node_got, node_want):
            torch.testing.assert_close(w_got, w_want)
            torch.testing.assert_close(x_got, x_want)


# -- capture safety ----------------------------------------------------------------------------
class AuditingCapture(RerunCapture):
    """Audits every region as a capture would record it (after the warm-ups, in capture order)."""

    def __init__(self, lock=None) -> None:
        super().__init__(lock)
        self.violations, self.ops = [], set()

    def __call__(self, region):
        audit = CaptureAudit()
        with self.lock, audit:
            region()
        self.violations += audit.violations
        self.ops |= set(audit.ops)
        return super().__call__(region)


@torch.inference_mode()
def test_the_attention_regions_dispatch_nothing_capture_forbids():
    """Every (layer, micro-batch, size) region of a 2-micro-batch node, as captured."""
    cfg, model, caches = attention_setup()
    counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64)
    graphs = AttentionGraphs(model, caches, counts, (4, 8), 2, 32, BLOCK, PAD_BLOCK, NODES,
                             record_bytes(cfg.hidden_size, cfg.top_k, torch.float32))
    capture = AuditingCapture()
    graphs.capture(capture)
    assert capture.violations == []
    assert {"triton:_gating_kernel", "triton:_scatter_kernel", "triton:pod_kernel"} <= capture.ops, capture.ops
    # The audit sees what it must refuse: a region whose launch plan was not built beforehand,
    # and the torch reference gating (it reads counts back).
    eager = CaptureAudit()
    fresh = AttentionGraphs(model, caches, counts, (8,), 1, 32, BLOCK, PAD_BLOCK, NODES,
                            record_bytes(cfg.hidden_size, cfg.top_k, torch.float32))
    with kernels.graph_region(), eager:
        fresh.region(0, fresh.slots[0][8])()
    with eager:
        model.attention_layers[1].route(torch.randn(5, cfg.hidden_size))
    assert {v.op for v in eager.violations} == {"aten.lift_fresh.default", "aten.nonzero.default",
                                                 "aten.bincount.default"}, eager.ops


def expert_setup():
    """Two layers of half the experts, as one of two expert nodes holds them, and their graphs."""
    cfg = PRESETS["tiny-qwen3-moe"]
    layers = [ExpertLayer(cfg, i, torch.float32, "cpu", expert_ids=list(range(cfg.num_experts // 2)))
              for i in range(2)]
    for layer in layers:
        layer.load_weights(RandomWeights(0))
    graphs = ExpertGraphs(layers, (4, 8), record_bytes(cfg.hidden_size, cfg.top_k, torch.float32), torch.float32,
                          torch.device("cpu"))
    return cfg, layers, graphs


@torch.inference_mode()
def test_the_expert_regions_dispatch_nothing_capture_forbids():
    _, _, graphs = expert_setup()
    capture = AuditingCapture()
    graphs.capture(capture)
    assert capture.violations == []
    assert {"triton:_gate_up_kernel", "triton:_down_kernel"} <= capture.ops, capture.ops


# -- static buffers and padding ----------------------------------------------------------------
def test_capture_sizes_ladder_and_choice():
    assert capture_sizes(471) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert capture_sizes(5, [16, 4, 4]) == (4, 16)
    sizes = capture_sizes(100)
    assert (size_for(sizes, 1), size_for(sizes, 9), size_for(sizes, 128), size_for(sizes, 129)) == (1, 12, 128, None)
    with pytest.raises(ValueError, match="positive integers"):
        capture_sizes(8, [0, 4])


@torch.inference_mode()
def test_attention_graphs_give_the_eager_dispatch_and_touch_only_the_padding_block():
    """Micro-batches of 5 and 3 decodes through graphs of sizes 8 and 4: the live rows' residual,
    records, node offsets and expert counts are the eager ones; the padding rows write only the
    spare block; a batch larger than every size, or one with a prompt, runs eager."""
    cfg, model, caches = attention_setup()
    counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64)
    graphs = AttentionGraphs(model, caches, counts, (4, 8), 2, 32, BLOCK, PAD_BLOCK, NODES,
                             record_bytes(cfg.hidden_size, cfg.top_k, torch.float32))
    capture = RerunCapture()
    assert graphs.capture(capture) == cfg.num_layers * 2 * 2 == capture.regions
    for rows in (5, 3):  # three padding rows, then one
        inputs = decode_inputs(rows, first_token=rows)
        hidden = model.embed(inputs[0])
        eager_caches = [(k.clone(), v.clone()) for k, v in caches]
        before = [(k.clone(), v.clone()) for k, v in caches]
        counts.zero_()
        assert graphs.load(1, inputs, rows) and graphs.active[1].size == (4 if rows <= 4 else 8)
        for layer in range(cfg.num_layers):
            parts = graphs.run(layer, 1, hidden)
            want, want_counts = eager_parts(cfg, model, eager_caches, layer, hidden, inputs)
            torch.testing.assert_close(parts.residual, want.residual)
            assert torch.equal(parts.node_offsets, want.node_offsets)
            assert_same_records(node_records(parts, cfg.hidden_size, cfg.top_k),
                                node_records(want, cfg.hidden_size, cfg.top_k))
            assert torch.equal(counts[layer], want_counts)
            hidden = want.residual  # the next layer's input (its combine skipped)
        written = {int(s) // BLOCK for s in inputs[2].slot_mapping}
        for (k, _), (k0, _), (ke, _) in zip(caches, before, eager_caches):
            changed = {b for b in range(k.shape[0]) if not torch.equal(k[b], k0[b])}
            assert changed <= written | {PAD_BLOCK}  # the live rows' slots and the padding block
            for b in written:  # the live rows' keys, equal to float rounding (the padded batch's GEMMs)
                torch.testing.assert_close(k[b], ke[b])
    assert not graphs.load(0, decode_inputs(9), 9)  # past the largest size
    prompt = prepare_batch([DecodingSequence("p", 4, [0])] * 2, [2, 1], 1, BLOCK, torch.device("cpu"))
    assert not graphs.load(0, prompt, 3)  # not a decode batch


@torch.inference_mode()
def test_expert_graphs_answer_the_live_tokens_as_eager():
    cfg, layers, graphs = expert_setup()
    graphs.capture(RerunCapture())
    g = torch.Generator().manual_seed(2)
    for tokens, layer in ((7, 0), (3, 1)):
        x = torch.randn(tokens, cfg.hidden_size, generator=g)
        ids = torch.randint(0, cfg.num_experts, (tokens, cfg.top_k), generator=g)
        weights = torch.rand(tokens, cfg.top_k, generator=g)
        records = pack_records(x, ids, weights).view(-1)
        got = graphs.run(layer, records, tokens)
        with kernels.graph_region():
            want = layers[layer](x, ids, weights)
        torch.testing.assert_close(got, want)
    assert graphs.run(0, records, 9) is None  # past the largest size: eager


def captured_on_cpu(monkeypatch, capture_type) -> list:
    """Every node of a deployment captures its decode graphs with `capture_type` (a RerunCapture
    holding the interpreter's lock) where it would take a GPU's; returns the list they land in."""
    captures = []

    def capture_on_cpu(device, enforce_eager, node):
        captures.append(capture_type(INTERPRETER))
        return captures[-1]

    monkeypatch.setattr(decode_graphs, "decode_capture", capture_on_cpu)
    return captures


def test_a_deployment_with_decode_graphs_matches_colocated(qwen3_ref, monkeypatch):
    """Two attention nodes, two expert nodes, m = 2, every decode micro-batch through the graphs
    (replayed by running their regions) and prompts eager: the colocated engine's greedy tokens."""
    from tests.megainfer.test_disagg import colocated, run_local_deployment

    captures = captured_on_cpu(monkeypatch, RerunCapture)
    prompts = qwen3_ref.prompts[:2]
    # Six tokens each (every decode step replays interpreted Triton kernels, ~0.2 s a launch), in
    # 40 lockstep steps: the prompts' prefills and five decode steps take under ten.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = colocated(qwen3_ref.path, prompts, params=params)
    got, stats = run_local_deployment(qwen3_ref.path, 2, 2, 2, prompts, cuda_graph_sizes=(2, 4), steps=40,
                                      params=params,
                                      worker_options={"decode_graph_tokens": 8, "cuda_graph_sizes": (2, 4, 8)})
    assert got == expected
    assert len(captures) == 4  # both attention nodes and both expert nodes captured, and replayed
    assert all(c.replays > 0 for c in captures), [c.replays for c in captures]
    assert all(s.kv_cache_usage == 0.0 for s in stats)


@pytest.mark.parametrize("deepseek_ref", ["deepseek_v3"], indirect=True)
def test_a_deepseek_deployment_captures_its_latent_attention(deepseek_ref, monkeypatch):
    """MLA's decode through the graphs (they captured nothing for it before its kernels): every
    region audited as a capture records it (the latent kernels launch, nothing capture forbids
    runs), then replayed; the dense first layer eager; the colocated engine's greedy tokens."""
    from tests.megainfer.test_disagg import colocated, run_local_deployment

    captures = captured_on_cpu(monkeypatch, AuditingCapture)
    prompts = deepseek_ref.prompts[:2]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = colocated(deepseek_ref.path, prompts, params=params)
    got, _ = run_local_deployment(deepseek_ref.path, 1, 2, 2, prompts, cuda_graph_sizes=(2, 4), steps=30,
                                  params=params, worker_options={"decode_graph_tokens": 8, "cuda_graph_sizes": (2, 4)})
    assert got == expected
    attention = [c for c in captures if "triton:latent_decode_kernel" in c.ops]
    assert len(attention) == 1 and attention[0].replays > 0
    assert all(c.violations == [] for c in captures), [c.violations for c in captures]
