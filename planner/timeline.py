"""The ping-pong pipeline of a plan, step by step: an event schedule of micro-batches moving
attention -> network -> experts -> network, the words `megainfer plan --explain` prints, and
the Gantt chart `--plot` draws.

The schedule is independent of `PerfModel.iteration_time` (it places every phase one by
one), so the two check each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.search import Candidate

LANES = ("attention", "A->E network", "experts", "E->A network")


@dataclass
class Phase:
    lane: str
    micro_batch: int
    layer: int
    start: float  # seconds
    end: float


def schedule(t_a: float, t_e: float, t_c: float, m: int, layers: int) -> list[Phase]:
    """Attention takes micro-batches in order, each as soon as it is free and the batch's
    previous-layer result is back; experts likewise once the batch has arrived. Transfers
    overlap freely (full-duplex NICs)."""
    phases = []
    attention_free = experts_free = 0.0
    back = [0.0] * m  # when each micro-batch's previous-layer output is back on the attention node
    for layer in range(layers):
        for j in range(m):
            a0 = max(attention_free, back[j])
            attention_free = a0 + t_a
            arrive = attention_free + t_c
            e0 = max(experts_free, arrive)
            experts_free = e0 + t_e
            back[j] = experts_free + t_c
            phases += [Phase("attention", j, layer, a0, a0 + t_a), Phase("A->E network", j, layer, a0 + t_a, arrive),
                       Phase("experts", j, layer, e0, e0 + t_e), Phase("E->A network", j, layer, e0 + t_e, back[j])]
    return phases


def makespan(phases: list[Phase]) -> float:
    return max(p.end for p in phases)


def explain(c: Candidate, num_layers: int, host_source: str | None = None, dense_layers: int = 0) -> str:
    """The chosen plan's timeline in words: `num_layers` MoE layers pipelined, and before them
    `dense_layers` dense ones (DeepSeek's first) that stay on the attention node."""
    t_f = c.t_f
    trip = c.t_a + c.t_e + 2 * c.t_c
    period = max(c.m * t_f, trip)
    bound = "attention" if c.t_a > c.t_e else "experts"
    lines = [
        f"Per layer, each of the {c.m} micro-batches of {c.batch / c.m:.0f} sequences spends "
        f"{c.t_a * 1e3:.3f} ms in attention on each of {c.n_a} attention node(s) ({c.batch / c.m / c.n_a:.0f} tokens "
        f"per node), {c.t_c * 1e3:.3f} ms on the wire each way, and {c.t_e * 1e3:.3f} ms in the experts "
        f"({c.experts_per_node} per expert node, {c.expert_nodes} nodes).",
        f"The {bound} bound the pipeline: T_f = max(T_a, T_e) = {t_f * 1e3:.3f} ms; T_a/T_e = {c.balance:.2f} "
        f"(constraint 1 wants about 1). Attention is busy {c.m * c.t_a / period:.0%} of each layer's "
        f"{period * 1e3:.3f} ms period, the experts {c.m * c.t_e / period:.0%}.",
    ]
    if c.network_hidden:
        lines.append(f"The network hides behind compute: T_c = {c.t_c * 1e3:.3f} ms < T_f (constraint 2); "
                     f"while one micro-batch is on the wire the other side computes another.")
    else:
        lines.append(f"The network does not hide: T_c = {c.t_c * 1e3:.3f} ms >= T_f = {t_f * 1e3:.3f} ms "
                     "(constraint 2 broken); faster NICs or larger micro-batches would help.")
    if c.pipeline_full:
        lines.append(f"{c.m} micro-batches keep both sides busy: m*T_f = {c.m * t_f * 1e3:.3f} ms >= "
                     f"2*(T_f + T_c) = {2 * (t_f + c.t_c) * 1e3:.3f} ms (constraint 3).")
    elif trip > c.m * t_f:
        lines.append(f"{c.m} micro-batch(es) cannot cover a round trip of {trip * 1e3:.3f} ms: each layer waits "
                     f"{(trip - c.m * t_f) * 1e3:.3f} ms for results to come back (constraint 3 broken).")
    else:
        lines.append(f"Constraint 3 (m*T_f >= 2*(T_f + T_c)) is not met, but T_a and T_e differ enough that "
                     f"the round trip ({trip * 1e3:.3f} ms) still fits in m*T_f = {c.m * t_f * 1e3:.3f} ms.")
    if dense_layers:
        lines.append(f"Before them, {dense_layers} dense layer(s) run whole on the attention nodes, FFN included, "
                     f"with no exchange: {c.t_dense * 1e3:.3f} ms per micro-batch each, "
                     f"{dense_layers * c.m * c.t_dense * 1e3:.2f} ms per iteration.")
    lines.append(f"An iteration is {num_layers} such {'MoE ' if dense_layers else ''}layers: TBT = {c.tbt * 1e3:.1f} ms "
                 f"for {c.batch} sequences, {c.tokens_per_s:,.0f} tokens/s on {c.gpus} GPUs.")
    lines.append(host_line(c, host_source))
    return "\n".join(lines)


def host_line(c: Candidate, host_source: str | None) -> str:
    """What the host spends per M2N round against the micro-batch's compute (issue 31)."""
    if host_source is None:
        return ("The host's CPU time per M2N round is not charged (give `--host-profile` a `megainfer bench host "
                "--json` result to charge it).")
    verdict = "the host sets the pace" if c.host_bound else "both fit inside the compute"
    return (f"Host CPU per M2N round ({host_source}): an attention rank {c.host_a * 1e6:,.0f} us against T_a "
            f"{c.t_a * 1e6:,.0f} us ({c.host_a / c.t_a:.0%}), an expert node {c.host_e * 1e6:,.0f} us against T_e "
            f"{c.t_e * 1e6:,.0f} us ({c.host_e / c.t_e:.0%}): {verdict}.")


def plot_predicted_gantt(c: Candidate, path: str, layers: int = 2) -> None:
    """Gantt chart of the attention, network and expert lanes for `layers` layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = schedule(c.t_a, c.t_e, c.t_c, c.m, layers)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for p in phases:
        y = len(LANES) - 1 - LANES.index(p.lane)
        ax.barh(y, (p.end - p.start) * 1e3, left=p.start * 1e3, height=0.6, color=colors(p.micro_batch % 10),
                alpha=0.55 if p.layer % 2 else 0.95, edgecolor="black", linewidth=0.4)
        if (p.end - p.start) * 1e3 > 0.04 * makespan(phases) * 1e3:
            ax.text((p.start + p.end) / 2 * 1e3, y, f"mb{p.micro_batch}/L{p.layer}", ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(len(LANES)), list(reversed(LANES)))
    ax.set_xlabel("ms")
    ax.set_title(f"{c.attention_gpu}x{c.tp_a} x{c.n_a} attention | {c.expert_gpu}x{c.tp_e} x{c.expert_nodes} experts"
                 f" | m={c.m}, B={c.batch}: first {layers} layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
