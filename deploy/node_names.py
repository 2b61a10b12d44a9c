"""The names of a deployment's nodes and ranks, as the plan lays them out (M2N peers, Ray
actors and the status all use these)."""

from __future__ import annotations

from deploy.runtime_config import rank_name
from megainfer.plan import Plan


def node_names(plan: Plan) -> tuple[list[str], list[str]]:
    """(attention nodes, i.e. their leader ranks; expert nodes)."""
    return ([f"attention{i}" for i in range(plan.attention.nodes)],
            [f"expert{k}" for k in range(plan.experts.nodes)])


def attention_rank_name(node: int, rank: int) -> str:
    return rank_name(f"attention{node}", rank)


def attention_rank_names(plan: Plan) -> list[str]:
    """Every rank of every attention node: each is an M2N peer of every expert node."""
    return [attention_rank_name(i, r) for i in range(plan.attention.nodes) for r in range(plan.attention.tp)]
