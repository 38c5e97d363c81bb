"""Batchwise gating (Shazeer et al. 2017, App. F): findings of a review, each a regression test.

A capacity below the batchwise quota is refused (it silently dropped half the picks), the
threshold loss is never NaN for infinite scores or thresholds (0 * inf), inference compares half
precision probabilities with the thresholds as the loss trained them (not rounded to bfloat16),
and the functional rule checks its coefficient and thresholds.
"""

from __future__ import annotations

import pytest
import torch

from routelab.gates import batchwise_threshold_loss, threshold_mask
from routelab.layers import MoE
from routelab.routing.rules import batchwise_routes


def test_a_capacity_below_the_batchwise_quota_is_an_error_naming_capacity_factor() -> None:
    with pytest.raises(ValueError, match="capacity_factor=0.5 is below 1, but the BatchwiseRouter gives every expert"):
        MoE(8, 16, 4, router="batchwise", k=2, capacity_factor=0.5)
    layer = MoE(8, 16, 4, router="batchwise", k=2, capacity_factor=1.0).train()
    layer(torch.randn(16, 8))
    assert layer.last_stats["tokens_per_expert"].tolist() == [8, 8, 8, 8]  # every pick kept: k n / E each
    router = layer.router
    with pytest.raises(ValueError, match="below the batchwise quota ceil"):
        router.route(torch.randn(16, 4), capacity=7)
    router.eval()  # threshold inference: no quota, any capacity
    router.route(torch.randn(16, 4), capacity=1)


def test_the_threshold_loss_is_not_nan_for_infinite_scores_or_thresholds() -> None:
    scores = torch.tensor([[float("-inf"), 0.6], [0.3, 0.2], [0.5, 0.1], [0.1, 0.9]])
    t = torch.tensor([0.2, 0.5], requires_grad=True)
    mask = torch.tensor([[False, True], [True, False], [True, False], [False, True]])
    loss = batchwise_threshold_loss(scores, t, mask)  # the masks agree on the -inf score
    finite = batchwise_threshold_loss(scores.clamp(min=-1.0), t, mask)
    assert float(loss.detach()) == float(finite.detach())
    loss.backward()
    assert torch.isfinite(t.grad).all()
    off = torch.tensor([float("inf"), 0.5], requires_grad=True)  # expert 0 switched off
    scores = torch.rand(4, 2)
    assert float(batchwise_threshold_loss(scores, off, threshold_mask(scores, off))) == 0.0  # the masks agree
    assert float(batchwise_threshold_loss(scores, off, torch.ones(4, 2, dtype=torch.bool))) == float("inf")


def test_threshold_inference_on_half_precision_logits_keeps_what_the_loss_trained() -> None:
    logits = torch.zeros(8, 4, dtype=torch.bfloat16)  # every probability exactly 0.25
    t = torch.full((4,), 0.2498)  # below 0.25 in float32, 0.25 once rounded to bfloat16
    probs = torch.softmax(logits.float(), -1).bfloat16()
    assert int(threshold_mask(probs, t).sum()) == 32
    assert int(batchwise_routes(logits, 1, t, training=False).keep.sum()) == 32


@pytest.mark.parametrize("coef", [-1.0, float("nan"), float("inf")])
def test_the_functional_rule_checks_its_coefficient_and_thresholds(coef: float) -> None:
    logits = torch.randn(8, 4)
    with pytest.raises(ValueError, match="threshold_coef"):
        batchwise_routes(logits, 1, torch.zeros(4), threshold_coef=coef)
    for bad in (torch.zeros(5), torch.zeros(2, 4)):
        with pytest.raises(ValueError, match=r"thresholds must be a tensor \[E\] = \[4\]"):
            batchwise_routes(logits, 1, bad, threshold_coef=0.0)


def test_an_eval_capacity_below_the_quota_is_refused_at_construction_when_inference_is_batchwise() -> None:
    with pytest.raises(ValueError, match="eval_capacity_factor=0.5 is below 1, but the Batchwise.* at inference"):
        MoE(8, 16, 4, router="batchwise", router_kwargs={"inference": "batchwise"}, eval_capacity_factor=0.5)
    # threshold inference keeps no quota: any eval capacity is fine
    MoE(8, 16, 4, router="batchwise", eval_capacity_factor=0.5)


@pytest.mark.parametrize("dtype, gap", [(torch.float32, 90.0), (torch.float32, 100.0), (torch.float16, 12.0)])
@pytest.mark.parametrize("training", [True, False])
def test_eq16_gives_a_tokens_single_kept_expert_weight_one_however_small_its_probability(
        dtype: torch.dtype, gap: float, training: bool) -> None:
    # Token 1's only kept expert has probability exp(-gap): below the dtype's smallest normal.
    logits = torch.tensor([[0.0, -gap - 10], [0.0, -gap]], dtype=dtype)
    thresholds = torch.tensor([2.0, 0.0])  # inference: expert 0 never passes, expert 1 always
    routes = batchwise_routes(logits, 1, thresholds, training=training)
    p = torch.softmax(logits.double(), -1) * routes.keep
    oracle = p / p.sum(-1, keepdim=True).clamp_min(1e-300)  # eq. 16 in float64
    assert routes.keep[1].tolist() == [False, True]
    torch.testing.assert_close(routes.gate.double(), oracle, rtol=1e-3, atol=0)


def test_eq16_gate_is_zero_not_nan_for_a_token_whose_kept_experts_all_have_probability_zero() -> None:
    logits = torch.tensor([[0.0, float("-inf")], [0.0, float("-inf")]], requires_grad=True)
    routes = batchwise_routes(logits, 1, torch.full((2,), 0.5), training=True)  # expert 1 must take a token
    assert routes.keep[:, 1].any()
    assert torch.isfinite(routes.gate).all()
    assert routes.gate[routes.keep[:, 1], 1].tolist() == [0.0]
    routes.gate.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_eq19_is_strict_a_probability_equal_to_its_threshold_is_not_kept():
    """Eq. 19 of Shazeer et al. App. F: ``m_i = 1`` iff ``x_i > T_i`` (a mutation review: ``>=`` survived)."""
    p = torch.softmax(torch.zeros(3, 2), -1)  # exactly 0.5 each
    assert not threshold_mask(p, torch.full((2,), 0.5)).any()
    assert threshold_mask(p, torch.full((2,), 0.5 - 1e-6)).all()


@pytest.mark.parametrize(("n", "E", "k"), [(3, 2, 1), (5, 3, 1), (7, 4, 2), (10, 4, 1)])
def test_batchwise_quota_ties_go_to_the_lower_expert_index(n, E, k):
    """With every score equal, the ``r = k n mod E`` ceiling quotas go to the lowest expert indices, as
    documented (a mutation review: the higher-index tie-break survived)."""
    from routelab.gates import batchwise_mask

    loads = batchwise_mask(torch.full((n, E), 0.5), k).sum(0).tolist()
    floor, r = divmod(k * n, E)
    assert loads == [floor + 1] * r + [floor] * (E - r)
