"""The `graphs` check: decode's CUDA graphs (megainfer/disagg/decode_graphs.py) captured,
replayed against the eager computation (equal outputs), and timed against it, on one attention
rank's and one expert node's halves of a decode (layer, micro-batch) at the Qwen3-235B plan's
shapes (an attention rank of tensor-parallel 4: 16 query heads, 1 KV head, head dim 128,
hidden 4096; an expert node's 4 of 128 experts, intermediate 1536; 32 expert nodes), with random
weights and two layers. Timed per (layer, micro-batch): device microseconds (CUDA events) and
the host's microseconds to launch it, graph and eager. On the CPU (no graphs) the same regions
are checked with a replay that runs them again, without timing."""

from __future__ import annotations

import dataclasses
import time

import torch

from megainfer.tools.gpucheck.context import CheckContext

LAYERS = 2
BLOCK = 16
REPS = 50


def _attention_setup(device: torch.device, dtype: torch.dtype, on_gpu: bool):
    from megainfer.disagg.expert_link import record_bytes
    from megainfer.model.moe_model import MoEModel
    from megainfer.model.weights import RandomWeights
    from megainfer.model_resolution import resolve_model

    full, _ = resolve_model("qwen3-235b-a22b")
    cfg = dataclasses.replace(full, num_layers=LAYERS, vocab_size=1024, num_heads=16, num_kv_heads=1) if on_gpu else \
        dataclasses.replace(full, num_layers=LAYERS, vocab_size=256, num_heads=4, num_kv_heads=1, hidden_size=64,
                            head_dim=32, num_experts=8, top_k=2)
    model = MoEModel(cfg, dtype, device, 8192, with_experts=False)
    with torch.inference_mode():
        model.load_weights(RandomWeights(0))
    nodes = 32 if on_gpu else 2
    node_of = (torch.arange(cfg.num_experts) // (cfg.num_experts // nodes)).to(device)
    for layer in model.attention_layers:
        layer.set_expert_nodes(node_of, nodes)
    blocks = 1024
    shape = (blocks + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype))
              for _ in range(LAYERS)]
    return cfg, model, caches, blocks, nodes, record_bytes(cfg.hidden_size, cfg.top_k, dtype)


def _time(fn) -> tuple[float, float]:
    """(device µs, host µs) per call of `fn`, over REPS calls, on CUDA."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    host = (time.perf_counter() - t0) / REPS * 1e6
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS * 1e3, host


def _capture(ctx: CheckContext):
    from megainfer.disagg.decode_graphs import CudaCapture, RerunCapture

    return CudaCapture(ctx.device) if ctx.on_gpu else RerunCapture()


@torch.inference_mode()
def check_attention(ctx: CheckContext, rows: int, context: int) -> None:
    import kernels
    from megainfer.disagg.decode_graphs import AttentionGraphs, capture_sizes, size_for
    from megainfer.runner.model_runner import prepare_batch
    from megainfer.tools.launch_count import DecodingSequence

    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    cfg, model, caches, blocks, nodes, record = _attention_setup(ctx.device, dtype, ctx.on_gpu)
    with ctx.case(f"attention half, {rows} decodes at {context} tokens: graph against eager") as case:
        counts = torch.zeros(LAYERS, cfg.num_experts, dtype=torch.int64, device=ctx.device)
        size = size_for(capture_sizes(rows), rows)  # the size serving replays for `rows`
        graphs = AttentionGraphs(model, caches, counts, (size,), 1, 8192 // BLOCK, BLOCK, blocks, nodes, record)
        case.figures["graph_rows"] = size
        start = time.perf_counter()
        case.figures["graphs"] = graphs.capture(_capture(ctx))
        case.figures["capture_s"] = round(time.perf_counter() - start, 2)
        per_seq = -(-(context + 1) // BLOCK)
        seqs = [DecodingSequence(f"r{i}", context, [(i * per_seq + b) % blocks for b in range(per_seq)])
                for i in range(rows)]
        inputs = prepare_batch(seqs, [1] * rows, rows, BLOCK, ctx.device)
        hidden = torch.randn(rows, cfg.hidden_size, device=ctx.device).to(dtype)
        if not graphs.load(0, inputs, rows):
            raise AssertionError(f"{rows} decodes did not load into the size-{size} graphs")
        got = graphs.run(1, 0, hidden)
        got = (got.residual.clone(), got.node_offsets.clone(), counts[1].clone(), node_tokens(got))
        # The same region launched op by op on the same static buffers: what the graph recorded.
        region = graphs.region(1, graphs.active[0])

        def eager():
            with kernels.graph_region():
                region()

        counts.zero_()
        eager()
        want = graphs.active[0].outputs()
        torch.testing.assert_close(got[0], want.residual, atol=1e-3, rtol=1e-3)
        if not torch.equal(got[1], want.node_offsets) or not torch.equal(got[2], counts[1]):
            raise AssertionError("the graph routed the tokens otherwise than the region run op by op")
        if got[3] != node_tokens(want):
            raise AssertionError("the graph sent other tokens to some expert node than the region run op by op")
        _figures(case, lambda: graphs.run(1, 0, hidden), eager, ctx.on_gpu)


@torch.inference_mode()
def check_experts(ctx: CheckContext, tokens: int) -> None:
    import kernels
    from megainfer.disagg.decode_graphs import ExpertGraphs, capture_sizes, size_for
    from megainfer.disagg.expert_link import pack_records, record_bytes
    from megainfer.model.expert_layer import ExpertLayer
    from megainfer.model.weights import RandomWeights
    from megainfer.model_resolution import resolve_model

    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    full, _ = resolve_model("qwen3-235b-a22b")
    cfg = dataclasses.replace(full, num_layers=LAYERS) if ctx.on_gpu else dataclasses.replace(
        full, num_layers=LAYERS, hidden_size=64, expert_intermediate_size=48, num_experts=8, top_k=2)
    held = 4 if ctx.on_gpu else 2
    with ctx.case(f"expert half, {tokens} tokens over {held} of {cfg.num_experts} experts: graph against eager") as case:
        layers = [ExpertLayer(cfg, i, dtype, ctx.device, expert_ids=list(range(held))) for i in range(LAYERS)]
        for layer in layers:
            layer.load_weights(RandomWeights(0))
        size = size_for(capture_sizes(tokens), tokens)  # the size serving replays for `tokens`
        case.figures["graph_rows"] = size
        graphs = ExpertGraphs(layers, (size,), record_bytes(cfg.hidden_size, cfg.top_k, dtype), dtype,
                              ctx.device)
        case.figures["graphs"] = graphs.capture(_capture(ctx))
        x = torch.randn(tokens, cfg.hidden_size, device=ctx.device).to(dtype)
        ids = torch.randint(0, cfg.num_experts, (tokens, cfg.top_k), device=ctx.device)
        ids[:, 0] = torch.arange(tokens, device=ctx.device) % held  # every token has one choice here
        weights = torch.rand(tokens, cfg.top_k, device=ctx.device)
        records = pack_records(x, ids, weights).view(-1)
        got = graphs.run(1, records, tokens)
        with kernels.graph_region():
            want = layers[1](x, ids, weights)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

        def eager():
            with kernels.graph_region():
                layers[1](x, ids, weights)

        _figures(case, lambda: graphs.run(1, records, tokens), eager, ctx.on_gpu)


def node_tokens(parts) -> list[list[int]]:
    """Each expert node's tokens, sorted (the gating kernel's atomics order a segment)."""
    bounds = parts.node_offsets.tolist()
    return [sorted(parts.token_ids[bounds[n]:bounds[n + 1]].tolist()) for n in range(len(bounds) - 1)]


def _figures(case, replay, eager, on_gpu: bool) -> None:
    """The graph's replay and the eager calls timed, on a GPU."""
    if not on_gpu:
        case.detail = "the CPU has no CUDA graphs: outputs checked, nothing timed"
        return
    graph, eager = _time(replay), _time(eager)
    case.figures |= {"graph_device_us": round(graph[0], 1), "eager_device_us": round(eager[0], 1),
                     "graph_host_us": round(graph[1], 1), "eager_host_us": round(eager[1], 1),
                     "eager_over_graph_device": round(eager[0] / graph[0], 2),
                     "eager_over_graph_host": round(eager[1] / graph[1], 2)}


def run(ctx: CheckContext) -> None:
    if ctx.on_gpu:
        check_attention(ctx, 48, 1000)
        check_attention(ctx, 471, 1000)  # the plan's decodes per micro-batch (1,884 / m = 4)
        check_experts(ctx, 128)
        check_experts(ctx, 400)  # replays the 512-row graph: a padded batch's cost
        check_experts(ctx, 512)
    else:
        check_attention(ctx, 5, 40)
        check_experts(ctx, 6)
