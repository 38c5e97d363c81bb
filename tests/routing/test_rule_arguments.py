"""The public routing rules check the arguments they document (a review: only the routers did).

Found by review: ``noisy_topk_routes`` at ``noise_std = 0`` (``softplus`` of a large negative number is
exactly 0 in float32) gave a NaN load loss and NaN gradients, a negative scale a load loss of 0; a NaN or
negative loss weight gave a NaN loss or one that rewards imbalance; ``random_skip`` took an out-of-range
expert (torch's bare error) and a negative capacity (kept nothing) silently.
"""

from __future__ import annotations

import pytest
import torch

from routelab.estimators import EMABaseline
from routelab.estimators.rule import gumbel_matching_routes
from routelab.routing import random_skip, skip_correction
from routelab.routing.losses import cv_squared
from routelab.routing.rules import noisy_topk_routes, sinkhorn_routes, softmax_routes, topk_routes


def test_zero_noise_is_the_noiseless_limit_of_the_load_estimator():
    """At ``noise_std -> 0`` the smooth load of App. A (eq. 8-11) is the count of top-k choices per expert:
    ``P(x, i)`` is 1 for a chosen expert and 0 for another."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 6, generator=g, requires_grad=True)
    k = 2
    r = noisy_topk_routes(logits, torch.zeros(64, 6), k, load_coef=1.0, importance_coef=0.0, generator=g)
    counts = torch.bincount(logits.detach().topk(k, -1).indices.reshape(-1), minlength=6).float()
    assert torch.allclose(r.aux["load"], cv_squared(counts))
    r.aux["load"].backward()
    assert torch.isfinite(logits.grad).all()
    # and the limit is continuous: a vanishing scale gives the same loss
    tiny = noisy_topk_routes(logits.detach(), torch.full((64, 6), 1e-30), k, training=False, load_coef=1.0)
    assert torch.allclose(tiny.aux["load"], cv_squared(counts))


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_or_nan_noise_scale_is_refused(bad):
    std = torch.ones(8, 4)
    std[3, 1] = bad
    with pytest.raises(ValueError, match="noise_std must hold noise scales >= 0"):
        noisy_topk_routes(torch.randn(8, 4), std, 1)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
@pytest.mark.parametrize(("rule", "name"), [
    (lambda x, c: softmax_routes(x, importance_coef=c), "importance_coef"),
    (lambda x, c: topk_routes(x, 1, balance_coef=c), "balance_coef"),
    (lambda x, c: noisy_topk_routes(x, torch.ones_like(x), 1, importance_coef=c), "importance_coef"),
    (lambda x, c: noisy_topk_routes(x, torch.ones_like(x), 1, load_coef=c), "load_coef"),
    (lambda x, c: sinkhorn_routes(x, 1, balance_coef=c), "balance_coef"),
    (lambda x, c: gumbel_matching_routes(x, balance_coef=c, generator=torch.Generator()), "balance_coef"),
])
def test_a_loss_weight_must_be_finite_and_non_negative(rule, name, bad):
    with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
        rule(torch.randn(8, 4), bad)


def test_random_skip_refuses_what_it_cannot_do():
    expert = torch.tensor([0, 1, 3, 1])
    with pytest.raises(ValueError, match=r"expert must hold expert indices in \[0, num_experts=3\)"):
        random_skip(expert, 3, 2)
    with pytest.raises(ValueError, match="capacity"):
        random_skip(expert, 4, -1)
    with pytest.raises(ValueError, match="num_experts"):
        random_skip(expert, 0, 2)
    with pytest.raises(ValueError, match="capacity"):
        skip_correction(torch.tensor([3.0, 1.0]), -1)
    keep, load = random_skip(expert, 4, 1, torch.Generator().manual_seed(0))
    assert load.tolist() == [1, 2, 1, 2] and keep.sum() == 3  # expert 1 keeps one of its two tokens


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_ema_baseline_reaches_the_mean_in_half_precision(dtype):
    """A review: the average was kept in the loss's dtype; after a 1.0, a constant 2.0 stalled at 1.904 in
    float16 and 1.961 in bfloat16 (rounding ate the (1 - decay) steps). It is kept in float32 at least."""
    b = EMABaseline(0.99)
    b(torch.tensor(1.0, dtype=dtype))
    for _ in range(3000):
        out = b(torch.tensor(2.0, dtype=dtype))
    assert out.dtype == dtype and abs(b.value.item() - 2.0) < 1e-4  # float32 rounding: ~eps / (1 - decay)


@pytest.mark.parametrize("rule", [
    lambda x: topk_routes(x, 1),
    lambda x: noisy_topk_routes(x, torch.ones_like(x), 2),
    lambda x: sinkhorn_routes(x, 1, balance_coef=0.1),
    lambda x: gumbel_matching_routes(x, balance_coef=0.1, generator=torch.Generator().manual_seed(0)),
    lambda x: softmax_routes(x, importance_coef=0.1),
])
def test_a_batch_without_tokens_keeps_the_loss_and_stats_keys_at_zero(rule):
    """A review: with an all-padding batch some rules dropped their aux keys (others gave 0), so logs keyed by
    name lost them for a step. The keys are the non-empty batch's, every value 0."""
    full, empty = rule(torch.randn(8, 4)), rule(torch.zeros(0, 4))
    assert set(empty.aux) == set(full.aux) and set(empty.stats) == set(full.stats)
    assert all(float(v) == 0.0 for v in [*empty.aux.values(), *empty.stats.values()])


def test_batchwise_keeps_its_threshold_loss_key_for_a_batch_without_tokens():
    from routelab.routing.rules import batchwise_routes

    full = batchwise_routes(torch.randn(8, 4), 2, torch.zeros(4))
    empty = batchwise_routes(torch.zeros(0, 4), 2, torch.zeros(4))
    assert set(full.aux) == set(empty.aux) == {"threshold"} and float(empty.aux["threshold"]) == 0.0


def test_gumbel_matching_inference_is_the_argmax_or_the_optimal_balanced_assignment():
    """A mutation review: argmin in place of argmax at inference, and the balanced solve on -logits (still
    balanced, so the quota checks passed), both survived. Oracles: argmax, and scipy's optimum of the
    capacity-tiled problem."""
    from scipy.optimize import linear_sum_assignment

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 3, generator=g, dtype=torch.float64)
    r = gumbel_matching_routes(logits, training=False)
    assert r.expert.squeeze(-1).tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(r.gate.squeeze(-1), torch.softmax(logits, -1).amax(-1))
    b = gumbel_matching_routes(logits, training=False, eval_balanced=True).expert.squeeze(-1)
    assert torch.bincount(b, minlength=3).tolist() == [4, 4, 4]
    rows, cols = linear_sum_assignment(-logits.repeat_interleave(4, dim=1).numpy())
    assert float(logits.gather(1, b[:, None]).sum()) == pytest.approx(float(logits.numpy()[rows, cols // 4].sum()))
