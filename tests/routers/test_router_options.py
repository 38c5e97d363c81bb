"""Every option of a router class reaches its routing rule, in training and at inference.

The router classes (:mod:`routelab.routers`) are thin: each scores the tokens and calls a pure rule
of :mod:`routelab.routing.rules` or :mod:`routelab.estimators.rule` with its options. The rules
have tests of their own; these check that a router passes each option through (``eval_balanced``,
``renormalize``, ``sweeps``, ``sinkhorn``, the loss coefficients, ``noise_epsilon``, the eval
mode), and the class-level defaults and safeguards.

Truths, the strongest that is cheap:

* a balanced assignment at inference (BASE, Gumbel-Matching with ``eval_balanced=True``): the
  optimum of ``scipy.optimize.linear_sum_assignment`` over the logits, each expert's column
  repeated ``quota`` times;
* combine weights and losses by hand: the softmax renormalised over the chosen experts, the Switch
  balance ``coef * E * sum_e f_e P_e``, the importance ``coef * CV(sum_x G(x))^2``, batchwise
  gating's threshold mask ``softmax > T`` (eq. 19), the noise scale ``softplus(x W_noise) + eps``;
* otherwise (Sinkhorn's balanced choice, the random draws of Gumbel-Matching and noisy top-k, the
  smooth load loss, the threshold loss) the pure rule called with the same options and a generator
  of the same seed.

Logits are tilted (expert 0 scores highest for every token) so that the greedy and the balanced
choices differ: an option that is dropped changes the routes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from routelab.estimators.rule import gumbel_matching_routes
from routelab.routers import (
    BASERouter,
    BatchwiseRouter,
    GumbelMatchingRouter,
    NoisyTopKRouter,
    SinkhornRouter,
    SoftmaxRouter,
    TopKRouter,
)
from routelab.routing.rules import balanced_routes, batchwise_routes, noisy_topk_routes, sinkhorn_routes

D, E = 8, 3


def assert_same_routes(got, want) -> None:
    assert torch.equal(got.expert, want.expert) and torch.equal(got.keep, want.keep)
    for name in ("gate", "weight", "log_prob"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name))
    assert sorted(got.aux) == sorted(want.aux)
    for key in got.aux:
        torch.testing.assert_close(got.aux[key], want.aux[key])


def tokens(n: int = 13) -> torch.Tensor:
    """``[n, D]`` with a positive offset, so that a router :func:`tilted` prefers expert 0 for every token."""
    return torch.randn(n, D, generator=torch.Generator().manual_seed(0)) * 2 + 1.0


def seeded(router, seed: int = 1):
    """Router weights from a generator of their own (never torch's global one: the data must not depend
    on the tests that ran before)."""
    with torch.no_grad():
        weight = torch.randn(router.proj.weight.shape, generator=torch.Generator().manual_seed(seed))
        router.proj.weight.copy_(0.2 * weight)
    return router


def tilted(router):
    """:func:`seeded`, with expert 0 scoring highest for every token of :func:`tokens` (their offset)."""
    seeded(router)
    with torch.no_grad():
        router.proj.weight[0] += 1.0
    return router


def optimal_assignment(logits: torch.Tensor, quota: int) -> torch.Tensor:
    """One expert per token maximising the total logit with at most ``quota`` tokens per expert (scipy)."""
    scores = np.repeat(logits.detach().double().numpy(), quota, axis=1)  # column j is expert j // quota
    rows, cols = linear_sum_assignment(scores, maximize=True)
    expert = torch.empty(logits.shape[0], dtype=torch.long)
    expert[torch.from_numpy(rows)] = torch.from_numpy(cols // quota)
    return expert


def switch_balance_by_hand(logits: torch.Tensor) -> torch.Tensor:
    """Fedus et al. eq. 4: ``E * sum_e f_e P_e``, ``f_e`` the fraction of tokens whose argmax is ``e``."""
    probs = torch.softmax(logits, -1)
    f = torch.bincount(logits.argmax(-1), minlength=logits.shape[-1]).float() / logits.shape[0]
    return logits.shape[-1] * (f * probs.mean(0)).sum()


def cv_squared_by_hand(v: torch.Tensor) -> torch.Tensor:
    return v.var(unbiased=False) / v.mean() ** 2


# ---------------------------------------------------------------- balanced routers


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_base_router_with_eval_balanced_solves_the_optimal_balanced_assignment_in_training_and_eval(training):
    router = tilted(BASERouter(D, E, eval_balanced=True)).train(training)
    x = tokens(12)  # E divides n: every expert takes exactly 4 tokens
    logits = router.logits(x)
    routes = router(x, capacity=6)
    want = optimal_assignment(logits, 4)
    assert torch.equal(routes.expert[:, 0], want)
    assert torch.bincount(routes.expert[:, 0], minlength=E).tolist() == [4, 4, 4]
    torch.testing.assert_close(routes.gate[:, 0], torch.sigmoid(logits.gather(-1, want[:, None]))[:, 0])


def test_base_router_without_eval_balanced_routes_each_token_to_its_argmax_at_inference():
    router = tilted(BASERouter(D, E)).eval()
    x = tokens(12)
    assert torch.equal(router(x).expert[:, 0], router.logits(x).argmax(-1))


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_base_router_with_two_experts_per_token_routes_as_the_balanced_rule(training):
    router = tilted(BASERouter(D, E, k=2, eval_balanced=True)).train(training)
    x = tokens()
    assert_same_routes(router(x, capacity=9), balanced_routes(router.logits(x), 9, balanced=True, k=2))


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_sinkhorn_router_passes_sweeps_renormalize_eval_balanced_and_balance_coef(training):
    router = tilted(SinkhornRouter(D, E, k=2, sweeps=50, renormalize=True, eval_balanced=True,
                                   balance_coef=0.1)).train(training)
    x = tokens()
    logits = router.logits(x)
    routes = router(x)
    # the balanced choice (50 sweeps, also at inference): the rule with the same options
    assert_same_routes(routes, sinkhorn_routes(logits, 2, sweeps=50, balanced=True, renormalize=True,
                                               balance_coef=0.1))
    # by hand: the chosen softmax probabilities renormalised to sum to 1, and the Switch balance loss
    chosen = torch.softmax(logits, -1).gather(-1, routes.expert)
    torch.testing.assert_close(routes.gate, chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(routes.aux["balance"], 0.1 * switch_balance_by_hand(logits))


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_gumbel_matching_router_passes_tau_sinkhorn_balance_coef_eval_mode_and_its_generator(training):
    router = tilted(GumbelMatchingRouter(D, E, tau=0.7, sinkhorn=True, eval_balanced=True,
                                         balance_coef=0.1)).train(training)
    router.generator = torch.Generator().manual_seed(5)
    x = tokens()
    logits = router.logits(x)
    want = gumbel_matching_routes(logits, 5, tau=0.7, sinkhorn=True, training=training, eval_balanced=True,
                                  balance_coef=0.1, generator=torch.Generator().manual_seed(5))
    routes = router(x, capacity=5)
    assert_same_routes(routes, want)
    if training:
        torch.testing.assert_close(routes.aux["balance"], 0.1 * switch_balance_by_hand(logits))


def test_gumbel_matching_router_with_eval_balanced_solves_the_optimal_assignment_at_inference_without_drawing():
    router = tilted(GumbelMatchingRouter(D, E, tau=0.7, sinkhorn=True, eval_balanced=True)).eval()
    router.generator = torch.Generator().manual_seed(5)
    x = tokens()  # 13 tokens on 3 experts: at most ceil(13 / 3) = 5 per expert
    logits = router.logits(x)
    routes = router(x, capacity=5)
    want = optimal_assignment(logits, 5)
    assert torch.equal(routes.expert[:, 0], want)
    assert (logits.argmax(-1) == 0).all() and not torch.equal(want, logits.argmax(-1))  # not the argmax
    torch.testing.assert_close(routes.gate[:, 0], torch.softmax(logits, -1).gather(-1, want[:, None])[:, 0])
    assert routes.aux == {}
    assert torch.equal(router(x, capacity=5).expert, routes.expert)  # no draw: the same routes again


# ---------------------------------------------------------------- batchwise gating


@pytest.mark.parametrize(("training", "inference"), [(True, "threshold"), (False, "threshold"), (False, "batchwise")])
def test_batchwise_router_passes_threshold_coef_and_inference_and_its_mask_helper_agrees(training, inference):
    router = seeded(BatchwiseRouter(D, E, k=2, threshold_coef=0.5, inference=inference)).train(training)
    with torch.no_grad():
        router.thresholds.copy_(torch.tensor([0.2, 0.3, 0.4]))
    x = tokens()
    logits = router.logits(x)
    routes = router(x)
    assert_same_routes(routes, batchwise_routes(logits, 2, router.thresholds, training=training,
                                                inference=inference, threshold_coef=0.5))
    probs = torch.softmax(logits, -1)
    if not training and inference == "threshold":  # eq. 19 by hand
        assert torch.equal(routes.keep, probs > router.thresholds)
    assert torch.equal(router.mask(probs), routes.keep)  # the public helper: the mask in use


def test_batchwise_router_checks_the_capacity_against_the_ceiling_quota_in_training_and_batchwise_inference():
    x = tokens(10)
    for training, inference in ((True, "threshold"), (False, "batchwise")):
        router = seeded(BatchwiseRouter(D, 3, k=1, inference=inference)).train(training)
        with pytest.raises(ValueError, match="capacity_factor"):
            router(x, capacity=3)  # ceil(10 / 3) = 4 > 3 (the floor would be 3)
        router(x, capacity=4)


def test_batchwise_router_refuses_a_nan_threshold_by_default():
    router = seeded(BatchwiseRouter(D, 4)).eval()
    with torch.no_grad():
        router.thresholds[0] = float("nan")
    with pytest.raises(ValueError, match="thresholds"):
        router(tokens(16))


# ---------------------------------------------------------------- top-k, softmax, noisy top-k


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_topk_router_passes_renormalize_and_balance_coef(training):
    router = seeded(TopKRouter(D, E, k=2, renormalize=True, balance_coef=0.05)).train(training)
    x = tokens()
    logits = router.logits(x)
    routes = router(x)
    top, expert = logits.topk(2, -1)
    assert torch.equal(routes.expert, expert)
    torch.testing.assert_close(routes.gate, torch.softmax(top, -1))
    assert sorted(routes.aux) == ["balance"]
    torch.testing.assert_close(routes.aux["balance"], 0.05 * switch_balance_by_hand(logits))


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_softmax_router_passes_importance_coef(training):
    router = seeded(SoftmaxRouter(D, E, importance_coef=0.2)).train(training)
    x = tokens()
    probs = torch.softmax(router.logits(x), -1)
    routes = router(x)
    torch.testing.assert_close(routes.gate, probs)
    assert sorted(routes.aux) == ["importance"]
    torch.testing.assert_close(routes.aux["importance"], 0.2 * cv_squared_by_hand(probs.sum(0)))


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_noisy_topk_router_passes_noise_epsilon_and_both_loss_coefficients(training):
    router = NoisyTopKRouter(D, E, k=2, importance_coef=0.2, load_coef=0.3, noise_epsilon=0.05).train(training)
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(1))
    torch.nn.init.normal_(router.noise.weight, generator=torch.Generator().manual_seed(2))
    router.generator = torch.Generator().manual_seed(3)
    x = tokens()
    features = router.features(x)
    logits = x @ router.proj.weight.t()
    torch.testing.assert_close(features[:, :E], logits)
    torch.testing.assert_close(features[:, E:], F.softplus(x @ router.noise.weight.t()) + 0.05)  # eq. 4
    routes = router(x)
    assert_same_routes(routes, noisy_topk_routes(features[:, :E], features[:, E:], 2, training=training,
                                                 importance_coef=0.2, load_coef=0.3,
                                                 generator=torch.Generator().manual_seed(3)))
    if not training:  # no noise: the importance loss by hand (eq. 6-7)
        top, expert = logits.topk(2, -1)
        full = torch.zeros_like(logits).scatter(-1, expert, torch.softmax(top, -1))
        torch.testing.assert_close(routes.aux["importance"], 0.2 * cv_squared_by_hand(full.sum(0)))


def test_noisy_topk_noise_weights_learn_through_the_load_loss():
    """App. A: the smooth load estimator is differentiable in ``W_noise`` (eq. 8-11)."""
    router = NoisyTopKRouter(D, 4, k=1, importance_coef=0.0, load_coef=1.0)
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(0))
    torch.nn.init.normal_(router.noise.weight, generator=torch.Generator().manual_seed(1))
    router.generator = torch.Generator().manual_seed(0)
    router(torch.randn(32, D, generator=torch.Generator().manual_seed(2))).aux["load"].backward()
    assert router.noise.weight.grad is not None and router.noise.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- defaults


def test_router_defaults_are_the_documented_ones():
    assert TopKRouter(D, E).balance_coef == 0.01  # Fedus et al.
    assert NoisyTopKRouter(D, E).k == 2
    assert SoftmaxRouter(D, E).slots == E  # dense: the layer sizes its capacity for E slots per token
    router = BatchwiseRouter(D, 4)
    assert "thresholds" in dict(router.named_parameters()) and "thresholds" in router.state_dict()


def test_a_batchwise_router_with_one_expert_keeps_every_token_at_inference():
    """The only score is 1 and eq. 19 is strict (``G > T``): the threshold starts below 1."""
    assert seeded(BatchwiseRouter(D, 1)).eval()(tokens(5)).keep.all()
