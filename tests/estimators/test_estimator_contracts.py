"""Documented contracts of routelab.estimators that a mutation review (s41) found untested.

* ``gumbel_matching_routes``: ``balance_coef`` scales ``aux["balance"]``; ``sinkhorn=True`` samples
  what ``sample_routes(..., sinkhorn=True)`` samples.
* ``EMABaseline``: the average is kept in float32 for half-precision losses.
* ``reinforce_objective`` / ``gating_objective``: dropped tokens (``keep = False``) count 0, even
  where the routes' ``weight`` is not 0.

Independent truths: the Switch balance formula ``E * sum_e f_e P_e`` computed here by hand,
``sample_routes`` with the same options and generator, the EMA recursion in float64, and the
objectives' formula ``(1/n) sum_i keep_i w_i f_i`` (and its gradient) by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from routelab import Routes
from routelab.estimators import (
    EMABaseline,
    gating_objective,
    gumbel_matching_routes,
    reinforce_objective,
    sample_routes,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("coef", [0.1, 2.5])
def test_balance_coef_scales_the_switch_balance_loss(coef: float) -> None:
    n, E = 8, 4
    logits = torch.randn(n, E, generator=_gen(1)).requires_grad_(True)
    r = gumbel_matching_routes(logits, balance_coef=coef, generator=_gen(0))
    # Switch (Fedus et al. 2021, eq. 4): E * sum_e f_e P_e, f_e the fraction of tokens whose
    # router argmax is e, P_e the mean router probability of e.
    probs = logits.softmax(-1)
    f = torch.bincount(probs.detach().argmax(-1), minlength=E).float() / n
    want = coef * E * (f * probs.mean(0)).sum()
    torch.testing.assert_close(r.aux["balance"], want)
    (g_got,) = torch.autograd.grad(r.aux["balance"], logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want)


@pytest.mark.parametrize("method", ["gumbel_matching_iw", "sample_skip_iw"])
def test_sinkhorn_routes_are_those_of_sample_routes_with_sinkhorn(method: str) -> None:
    """13 tokens on 3 experts (quota 5, slack capacity): with ``E | n`` a Sinkhorn shift of the
    columns leaves a balanced sample unchanged, so only ``E`` not dividing ``n`` tells it apart."""
    n, E = 13, 3
    logits = torch.randn(n, E, generator=_gen(0)) * 2 + torch.tensor([3.0, 0.0, 0.0])
    r = gumbel_matching_routes(logits, method=method, tau=0.7, sinkhorn=True, generator=_gen(5))
    ref = sample_routes(logits, method, tau=0.7, capacity=math.ceil(n / E), sinkhorn=True, generator=_gen(5))
    assert torch.equal(r.expert, ref.expert) and torch.equal(r.keep, ref.keep)
    torch.testing.assert_close(r.weight, ref.weight)
    torch.testing.assert_close(r.log_prob, ref.log_prob)
    # The comparison can see the option: without Sinkhorn the same draw gives other weights.
    plain = sample_routes(logits, method, tau=0.7, capacity=math.ceil(n / E), generator=_gen(5))
    assert not torch.allclose(plain.weight, ref.weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_ema_baseline_of_half_precision_losses_follows_the_exact_average(dtype: torch.dtype) -> None:
    """1.0, then 1000 times 2.0: in half precision the update would stall short of 2 (1.90 in
    float16); kept in float32, every returned baseline is the float64 recursion's, rounded."""
    decay = 0.99
    b = EMABaseline(decay)
    ref = None  # the float64 recursion
    eps = torch.finfo(dtype).eps
    for step, value in enumerate([1.0] + [2.0] * 1000):
        out = b(torch.tensor(value, dtype=dtype))
        want = 0.0 if ref is None else ref
        assert out.dtype == dtype
        assert abs(float(out) - want) <= eps, (step, float(out), want)
        ref = value if ref is None else decay * ref + (1 - decay) * value
    assert b.value.dtype == torch.float32
    assert abs(float(out) - 2.0) <= eps


def _routes_dropping_weighted_tokens() -> tuple[Routes, torch.Tensor]:
    """Four tokens, the last two dropped but with non-zero weights (a router with k = 1 may give
    any weight to a dropped slot)."""
    n = 4
    log_prob = torch.log(torch.tensor([[0.5], [0.25], [0.5], [0.8]])).requires_grad_(True)
    routes = Routes(expert=torch.zeros(n, 1, dtype=torch.long), gate=log_prob.exp(),
                    keep=torch.tensor([[True], [True], [False], [False]]),
                    weight=torch.tensor([[0.5], [2.0], [3.0], [4.0]]), log_prob=log_prob)
    return routes, log_prob


def test_dropped_tokens_count_zero_in_the_objectives_whatever_their_weight() -> None:
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    keep = torch.tensor([1.0, 1.0, 0.0, 0.0])
    w = torch.tensor([0.5, 2.0, 3.0, 4.0])
    baseline = 0.5
    routes, log_prob = _routes_dropping_weighted_tokens()
    value = reinforce_objective(routes, loss, baseline)
    torch.testing.assert_close(value, (keep * w * loss).detach().mean())  # (0.5 * 1 + 2 * 2) / 4
    g_loss, g_log_prob = torch.autograd.grad(value, (loss, log_prob))
    torch.testing.assert_close(g_loss, keep * w / 4)
    torch.testing.assert_close(g_log_prob[:, 0], keep * w * (loss.detach() - baseline) / 4)
    torch.testing.assert_close(gating_objective(routes, loss), (keep * w * loss).detach().mean())
    torch.testing.assert_close(gating_objective(routes, loss, use_weights=False), (keep * loss).detach().mean())
