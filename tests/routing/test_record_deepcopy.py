"""A routelab layer can be deep-copied (an EMA or best-model snapshot) after a training forward."""

from __future__ import annotations

import copy

import torch

import routelab
from routelab.layers import MoE


def test_a_layer_deep_copies_after_a_training_forward_and_backward():
    moe = MoE(8, 16, 4, router="topk", k=2)
    y, _ = moe(torch.randn(12, 8))
    snapshot = copy.deepcopy(moe)  # raised: the record's aux losses carry a graph
    assert torch.equal(routelab.aux_loss(snapshot), routelab.aux_loss(moe).detach())
    assert routelab.aux_loss(moe).requires_grad  # the original keeps its differentiable record
    (y.sum() + routelab.aux_loss(moe)).backward()
    copy.deepcopy(moe)
