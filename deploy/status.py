"""What a deployment reports about itself, read from its node groups: the nodes for
ServerInfo, and the engine state and latency histograms for the metrics endpoint."""

from __future__ import annotations

from deploy.node_group import NodeGroup, health_of, stats_of
from megainfer.disagg import latency
from megainfer.expert_replicas import imbalance, placed_load
from megainfer.messages import ExpertLoadReport, NodeStats
from megainfer.server.backend import NodeInfo
from megainfer.server.metrics import MetricsSnapshot


def node_infos(groups: list[NodeGroup], prefix_replicas: bool = False) -> list[NodeInfo]:
    """Every rank of every group; `prefix_replicas` names them replica0.attention0, ..."""
    return [NodeInfo(f"replica{k}.{h.name}" if prefix_replicas else h.name, h.role, h.status, h.detail())
            for k, health in enumerate(health_of(groups)) for h in health]


def metrics_snapshot(groups: list[NodeGroup], router_error: latency.LatencyHistogram | None) -> MetricsSnapshot:
    """Attention nodes summed (KV usage over all their blocks), M2N latencies merged over every
    attention leader; `router_error` where a predictive router places requests."""
    stats: list[NodeStats] = stats_of(groups)
    engines = [s.engine for s in stats]
    blocks = sum(e.num_kv_blocks for e in engines) or 1
    node_pairs, layer_imbalance = expert_load(groups, engines)
    return MetricsSnapshot(
        running=sum(e.num_running for e in engines), waiting=sum(e.num_waiting for e in engines),
        kv_cache_usage=sum(e.kv_cache_usage * e.num_kv_blocks for e in engines) / blocks,
        expert_bytes_read=sum(e.expert_bytes_read for e in engines), kv_blocks=blocks,
        # Summed over the live groups: retiring a replica lowers it (Prometheus reads a counter reset).
        num_preemptions=sum(e.num_preemptions for e in engines),
        kernels=[e.kernels for e in engines if e.kernels is not None],
        kernel_builds_while_serving=sum(e.kernel_builds_while_serving for e in engines),
        prefix_cache_queries=sum(e.prefix_cache_queries for e in engines),
        prefix_cache_hits=sum(e.prefix_cache_hits for e in engines),
        m2n_send=latency.merge([s.m2n_send for s in stats]),
        m2n_receive_wait=latency.merge([s.m2n_receive_wait for s in stats]),
        router_ttft_error=router_error.snapshot() if router_error is not None else None,
        replicas=len(groups), expert_node_pairs=node_pairs, expert_layer_imbalance=layer_imbalance)


def expert_window(groups: list[NodeGroup], engines: list | None = None) -> ExpertLoadReport | None:
    """The first replica's window (with several replicas, each its own: the first stands for
    them) from its attention leaders' `engines` stats (read here when not given); None before
    any step was counted."""
    if engines is None:
        engines = [s.engine for s in stats_of(groups[:1])]
    windows = [e.expert_window for e in engines if e.expert_window is not None]
    if not groups or not windows:
        return None
    share = len(groups[0].attention)  # stats_of lists every group's attention leaders in order
    return ExpertLoadReport.deployment(windows[:share])


def expert_load(groups: list[NodeGroup], engines: list) -> tuple[list[float], list[float]]:
    """The first replica's expert nodes' load over its attention nodes' windows: as the expert
    nodes counted it, or where they did not, its gating counts under the placement it serves."""
    window = expert_window(groups, engines)
    if window is None or groups[0].expert_replicas is None:
        return [], []
    if window.node_pairs is not None:
        return window.node_pairs.sum(axis=0).tolist(), [imbalance(layer) for layer in window.node_pairs]
    units, per_layer = placed_load(groups[0].expert_replicas, window.of("all"))
    return units.tolist(), per_layer


def kernel_lines(groups: list[NodeGroup]) -> list[str]:
    """For the start-up log: which implementation each operator runs, once per distinct report,
    naming the ranks that have it (`KernelReport`, decided at each rank's start)."""
    ranks: dict[tuple[str, ...], list[str]] = {}
    for group in groups:
        for placement in group.placements():
            if placement.kernels is not None:
                ranks.setdefault(tuple(placement.kernels.lines(timing=False)), []).append(placement.name)
    out = []
    for lines, names in ranks.items():
        out.append(f"{', '.join(names)}: {lines[0]}")
        out += [f"  {line}" for line in lines[1:]]
    return out
