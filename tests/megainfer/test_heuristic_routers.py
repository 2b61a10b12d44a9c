"""Routing policies over node loads (the deployment feeds them; see tests/deploy/test_deploy.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from megainfer.errors import ConfigError
from megainfer.messages import NodeLoad
from megainfer.routing.policies import ROUTERS, LeastLoaded, make_router


def loads(*specs):
    return [NodeLoad(capacity_tokens=1000, used_tokens=u, pending_prefill_tokens=p, running=r, waiting=w)
            for u, p, r, w in specs]


def test_round_robin_takes_turns_and_random_spreads():
    rr = make_router("round_robin")
    nodes = loads((0, 0, 0, 0), (900, 0, 9, 0), (0, 0, 0, 0))
    assert [rr.choose(nodes, 10) for _ in range(6)] == [0, 1, 2, 0, 1, 2]  # blind to load
    rnd = make_router("random", seed=1)
    picks = Counter(rnd.choose(nodes, 10) for _ in range(3000))
    assert set(picks) == {0, 1, 2} and min(picks.values()) > 850


def test_least_loaded_prefers_free_kv_per_request():
    ll = LeastLoaded()
    # Node 1 has the most KV free per request it carries.
    assert ll.choose(loads((600, 0, 4, 0), (200, 100, 2, 0), (100, 500, 1, 2)), 10) == 1
    # Pending prefill counts like cached tokens: a long queued prompt makes a node busy.
    assert ll.choose(loads((100, 800, 1, 1), (300, 0, 1, 0)), 10) == 1
    # Equal nodes: the lower index, and routing there shifts the next choice.
    nodes = loads((0, 0, 0, 0), (0, 0, 0, 0))
    first = ll.choose(nodes, 300)
    nodes[first].add(300)
    assert first == 0 and ll.choose(nodes, 300) == 1


def test_every_policy_has_a_name_and_unknown_ones_are_refused():
    for name in ROUTERS:
        assert make_router(name).name == name
    with pytest.raises(ConfigError, match="least_loaded"):
        make_router("predictive-ish")
