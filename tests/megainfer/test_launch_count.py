"""Launches per (layer, micro-batch), counted by the torch dispatcher (`megainfer bench host`)."""

from __future__ import annotations

import pytest

from megainfer.model_resolution import resolve_model
from megainfer.tools.launch_count import OpLog, decode_launches


def test_views_launch_nothing_and_everything_else_counts():
    import torch

    x = torch.ones(4, 6)
    with OpLog() as log:
        y = x.view(2, 12).t()  # views
        (y * 2).sum()  # two kernels
    assert log.views == 2 and log.launches == 2


@pytest.mark.parametrize("model", ["qwen3-235b-a22b", "mixtral-8x22b"])
def test_a_decode_micro_batch_is_counted_by_half_and_does_not_grow_with_its_rows(model):
    config, _ = resolve_model(model)
    few, many = decode_launches(config, rows=4), decode_launches(config, rows=32)
    assert few.attention.launches == many.attention.launches and few.expert.launches == many.expert.launches
    assert "aten.scaled_dot_product_attention.default" in few.attention.ops
    assert "aten.silu.default" in few.expert.ops and "aten.linear.default" in few.expert.ops
    assert few.attention.launches > few.expert.launches > 10
    # Qwen3's per-head q and k norms run as one RMSNorm over q and k side by side, and both rotate
    # in one pass: one more norm than Mixtral's attention half, one rotation.
    assert few.attention.ops["aten.rsqrt.default"] == (3 if config.qk_norm else 2)
    assert few.attention.ops["aten.neg.default"] == 1
    # The records are packed once and gathered once, in send order.
    assert few.attention.ops["aten.index.Tensor"] == 4  # the rotary's cos and sin, the routing's nodes, the records
