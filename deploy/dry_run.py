"""`megainfer deploy PLAN --dry-run`: what every node would run with, where it would be placed
and which groups it would form, without starting anything; and whether the runtime reaches
the batch the plan's `predicted:` section assumed."""

from __future__ import annotations

from deploy.placement import bundle_of
from deploy.runtime_config import BatchCheck, DeploymentRuntime, check_batch
from megainfer.tools.bench.report import format_table


def gpu_memory_bytes(runtime: DeploymentRuntime) -> float | None:
    """The attention GPU's memory from the planner's catalog (None on CPUs)."""
    if runtime.plan.is_cpu:
        return None
    from planner.catalog import Catalog

    return Catalog.load()[runtime.plan.attention.gpu].memory_bytes


def describe(runtime: DeploymentRuntime, check: BatchCheck) -> str:
    plan = runtime.plan
    lines = [f"plan: {plan.model} ({plan.dtype}) on {runtime.device}"
             + (" (rehearsal: the plan's GPU placement with CPU tensors)" if runtime.is_rehearsal else ""),
             f"micro-batches m = {plan.pipeline.micro_batches}; one micro-batch carries up to "
             f"{runtime.micro_batch_tokens} tokens"]
    if not plan.is_cpu:
        lines += staging_lines(runtime) + [graph_line(runtime)]
    lines.append("")
    data_backend = "nccl" if runtime.device == "cuda" else "gloo"
    rows = []
    for node in runtime.attention:
        e = node.engine
        rows.append([node.name, "attention", len(node.ranks), _bundle(bundle_of(plan.attention)),
                     _group(node.ranks, data_backend), e.max_num_batched_tokens, e.max_num_seqs,
                     e.prefill_policy + (f" (chunk {e.layered_chunk_tokens})" if e.prefill_policy == "layered" else ""),
                     f"{node.kv_heads_per_rank}/rank", _kv_blocks(check), _mib(node.receive_slot_bytes)])
    for node in runtime.experts:
        ids = node.expert_ids
        rows.append([node.name, f"experts {ids[0]}..{ids[-1]}", len(node.ranks), _bundle(bundle_of(plan.experts)),
                     _group(node.ranks, data_backend), "-", "-", "-", "-", "-", _mib(node.receive_slot_bytes)])
    lines.append(format_table(["node", "role", "ranks", "bundle", "tp group", "token budget", "max seqs", "prefill",
                               "kv heads", "kv blocks/rank", "recv slot"], rows))
    lines += ["", _batch_line(check, runtime)]
    return "\n".join(lines)


def graph_line(runtime: DeploymentRuntime) -> str:
    """What decode's CUDA graphs will be (megainfer/disagg/decode_graphs.py), or that it runs eager."""
    from megainfer.disagg.graph_sizes import capture_sizes

    # MoE layers only, on both sides: DeepSeek's dense first layers run eager on the attention ranks.
    plan, layers, dense = runtime.plan, runtime.model.num_moe_layers, runtime.model.first_k_dense
    if plan.serve.enforce_eager:
        return "decode: eager (serve.enforce_eager / --enforce-eager)"
    m = plan.pipeline.micro_batches
    engine = runtime.attention[0].engine
    a_sizes = capture_sizes(-(-engine.max_num_seqs // m), engine.cuda_graph_sizes)
    e_sizes = capture_sizes(runtime.experts[0].decode_graph_tokens)
    return (f"decode: CUDA graphs captured at start-up, per attention rank {layers * m * len(a_sizes):,} (layers x "
            f"micro-batches x sizes {a_sizes[0]}..{a_sizes[-1]}), per expert rank {layers * len(e_sizes):,} (layers x "
            f"sizes {e_sizes[0]}..{e_sizes[-1]}); prompts and larger batches eager"
            + (f", and the {dense} dense layer(s)" if dense else ""))


def _bundle(bundle: dict) -> str:
    return ", ".join(f"{key}: {value:g}" for key, value in bundle.items())


def _group(ranks: tuple[str, ...], data_backend: str) -> str:
    return "-" if len(ranks) == 1 else f"{len(ranks)} ranks: control gloo, activations {data_backend}"


def _kv_blocks(check: BatchCheck) -> str:
    return "from free memory" if check.kv_blocks_per_rank is None else f"~{check.kv_blocks_per_rank:,} (estimate)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def staging_lines(runtime: DeploymentRuntime) -> list[str]:
    """What each rank of a GPU plan pins at start (staging_sizes.py): per rank and per full host."""
    from planner.catalog import Catalog

    plan, catalog, m = runtime.plan, Catalog.load(), runtime.plan.pipeline.micro_batches
    lines = [f"pinned host staging reserved at start, per micro-batch slot (to host + to device) x {m} slots"
             + (" (this rehearsal pins none)" if runtime.is_rehearsal else "") + ":"]
    for what, side, staging in (("attention rank", plan.attention, runtime.attention[0].staging_bytes),
                                ("expert node (its leader)", plan.experts, runtime.experts[0].staging_bytes)):
        gpus = catalog[side.gpu].gpus_per_node
        per_host = gpus // side.tp * (side.tp if side is plan.attention else 1)  # expert followers pin none
        lines.append(f"  {what}: {_mib(staging.to_host)} + {_mib(staging.to_device)} = {_mib(m * staging.per_slot)}; "
                     f"{per_host} per {gpus}-GPU {side.gpu} host: {m * staging.per_slot * per_host / 2**30:.2f} GiB")
    return lines


def _batch_line(check: BatchCheck, runtime: DeploymentRuntime) -> str:
    limits = [f"max_num_seqs {check.sequence_limit}", f"decodes per step {check.decode_budget}"]
    if check.kv_sequences is not None:
        limits.append(f"KV for {check.kv_sequences} sequences")
    held = f"runtime batch per attention node: {check.runtime_batch} ({', '.join(limits)})"
    if check.predicted is None:
        return held + "; the plan has no predicted: section to compare with"
    if check.reaches_prediction:
        return held + f" >= predicted {check.predicted}: the runtime reaches the plan"
    fixes = []
    if check.sequence_limit < check.predicted:
        fixes.append(f"scheduler.max_num_seqs >= {check.predicted}")
    if check.decode_budget < check.predicted:
        fixes.append(f"scheduler.max_num_batched_tokens >= {check.predicted + runtime.plan.scheduler.group_tokens} "
                     "(every decode plus a prefill chunk)")
    if check.kv_sequences is not None and check.kv_sequences < check.predicted:
        fixes.append("more attention nodes or GPUs with more memory (the KV cache is short)")
    return held + f" < predicted {check.predicted}: the runtime caps the plan; set " + "; ".join(fixes)


def run(runtime: DeploymentRuntime) -> int:
    check = check_batch(runtime, gpu_memory_bytes(runtime))
    print(describe(runtime, check))
    return 0 if check.reaches_prediction else 1

