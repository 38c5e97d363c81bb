"""Round-7 mutation contracts for ``routelab.routing.rules``.

Each test pins a behaviour a mutant of ``rules.py`` changed without any existing test noticing:
documented default loss weights, gradients that must (or must not) flow, and the "every slot
proposed" contract of dense softmax gating. Every expected value is computed independently here
(numpy / scipy / a hand-derived formula), never by calling the rule a second time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from routelab.routing.rules import (
    balanced_routes,
    batchwise_routes,
    noisy_topk_routes,
    sinkhorn_routes,
    softmax_routes,
    topk_routes,
)


def _np_softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _cv2(x: np.ndarray) -> float:
    """Population variance over squared mean (Shazeer et al.'s reference CV^2)."""
    return float(x.var() / (x.mean() ** 2))


def test_topk_default_balance_coef_is_switch_001_and_gradient_flows_through_probabilities():
    """Guards ``topk_routes``' documented Switch loss: default weight 0.01 (Fedus et al.) times
    ``E * sum_e f_e P_e``, hand-computed, and its gradient must reach the logits through ``P_e``
    (a detached probability would leave the Switch balance loss without any gradient)."""
    logits_np = np.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5], [3.0, 0.0, 0.0], [0.0, 0.0, 2.5]])
    n, E = logits_np.shape
    probs = _np_softmax(logits_np)
    f = np.bincount(logits_np.argmax(-1), minlength=E) / n  # [2/4, 1/4, 1/4]
    P = probs.mean(0)
    expected = 0.01 * E * float((f * P).sum())
    # d loss / d logits[x, j] = 0.01 * E / n * sum_e f_e p_e (delta_ej - p_j)
    fp = (f[None, :] * probs)
    expected_grad = 0.01 * E / n * (fp - probs * fp.sum(-1, keepdims=True))

    logits = torch.tensor(logits_np, dtype=torch.float32, requires_grad=True)
    routes = topk_routes(logits, 1)
    assert routes.aux["balance"].item() == pytest.approx(expected, rel=1e-5)
    routes.aux["balance"].backward()
    assert logits.grad is not None
    np.testing.assert_allclose(logits.grad.numpy(), expected_grad, rtol=1e-4, atol=1e-8)


def test_noisy_topk_default_coefs_and_eval_load_is_normal_cdf_estimate():
    """Guards ``noisy_topk_routes``' paper defaults (``importance_coef = load_coef = 0.1``) and
    the App. A load estimator: at inference (no noise) ``P(x, i) = Phi((x_i - kth_excluding_i) /
    sigma_i)``, computed here by brute force with scipy's normal CDF, and the importance is the sum
    of the renormalised top-k gates (eq. 6-7)."""
    logits_np = np.array([[1.0, 0.2, -0.5, 0.0], [0.1, 0.9, 0.3, -1.0], [-0.2, 0.0, 1.5, 0.4]])
    std_np = np.array([[0.5, 1.0, 0.7, 0.3], [0.8, 0.4, 1.2, 0.6], [0.9, 0.5, 0.3, 1.1]])
    n, E = logits_np.shape
    k = 2
    load = np.zeros(E)
    importance = np.zeros(E)
    for x in range(n):
        order = np.argsort(-logits_np[x])
        chosen = order[:k]
        g = _np_softmax(logits_np[x, chosen])
        importance[chosen] += g
        for i in range(E):
            others = np.sort(np.delete(logits_np[x], i))[::-1]
            kth = others[k - 1]
            load[i] += norm.cdf((logits_np[x, i] - kth) / std_np[x, i])

    routes = noisy_topk_routes(torch.tensor(logits_np, dtype=torch.float32),
                               torch.tensor(std_np, dtype=torch.float32), k, training=False)
    assert routes.aux["load"].item() == pytest.approx(0.1 * _cv2(load), rel=1e-4, abs=1e-7)
    assert routes.aux["importance"].item() == pytest.approx(0.1 * _cv2(importance), rel=1e-4, abs=1e-7)


def test_noisy_topk_gate_gradient_reaches_noise_scales():
    """Guards eq. 4 of Shazeer et al.: ``H = logits + eps * noise_std`` must be differentiable in
    ``noise_std`` through the gates (the noise network learns from the task loss, not only from the
    load loss). ``eps`` is redrawn here from the same seeded CPU generator, and the gate and its
    gradient are compared with a hand-written softmax over the top-k noisy logits."""
    torch.manual_seed(0)
    n, E, k = 5, 4, 2
    logits = torch.randn(n, E)
    std = (torch.rand(n, E) + 0.5).requires_grad_(True)
    weights = torch.randn(n, k)

    eps = torch.randn((n, E), dtype=torch.float32, generator=torch.Generator().manual_seed(123))
    std_ref = std.detach().clone().requires_grad_(True)
    noisy_ref = logits + eps * std_ref
    idx = noisy_ref.detach().topk(k, dim=-1).indices
    top = noisy_ref.gather(-1, idx)
    gate_ref = top.exp() / top.exp().sum(-1, keepdim=True)
    (gate_ref * weights).sum().backward()

    routes = noisy_topk_routes(logits, std, k, training=True, importance_coef=0.0, load_coef=0.0,
                               generator=torch.Generator().manual_seed(123))
    assert torch.equal(routes.expert, idx)
    torch.testing.assert_close(routes.gate, gate_ref.detach(), rtol=1e-5, atol=1e-6)
    (routes.gate * weights).sum().backward()
    assert std.grad is not None and std.grad.abs().sum() > 0
    torch.testing.assert_close(std.grad, std_ref.grad, rtol=1e-4, atol=1e-6)


def test_batchwise_threshold_loss_default_coef_and_trains_only_thresholds():
    """Guards App. F's threshold loss (eq. 20) in ``batchwise_routes``: default ``threshold_coef``
    1.0, divided by the tokens, hand-computed on a 2x2 batch; its gradient reaches the thresholds
    (``dL/dT_i = 1/n`` per batchwise-kept pair below T) and never the logits (scores detached)."""
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    thresholds = torch.tensor([0.9, 0.9], requires_grad=True)
    routes = batchwise_routes(logits, 1, thresholds)  # training=True by default
    # Batchwise mask (k n / E = 1 per expert) is the identity; no probability passes T = 0.9, so
    # L = sum over the 2 kept pairs of (0 - 1) (sigmoid(1) - 0.9) = 2 (0.9 - sigmoid(1)); / n = 2.
    s = 1.0 / (1.0 + math.exp(-1.0))
    assert torch.equal(routes.keep, torch.tensor([[True, False], [False, True]]))
    assert routes.aux["threshold"].item() == pytest.approx(0.9 - s, rel=1e-5)
    routes.aux["threshold"].backward()
    torch.testing.assert_close(thresholds.grad, torch.tensor([0.5, 0.5]))
    assert logits.grad is None or torch.count_nonzero(logits.grad) == 0


def test_softmax_routes_proposes_every_slot_even_when_a_probability_underflows():
    """Guards ``softmax_routes``' contract "every slot proposed": ``keep`` is all True even where a
    float32 probability underflows to exactly 0 (``exp(-200)``); dense gating drops no slot."""
    logits = torch.tensor([[0.0, -200.0, 1.0], [5.0, 0.0, 0.0]])
    routes = softmax_routes(logits)
    assert routes.gate[0, 1].item() == 0.0  # the underflow the contract is about
    assert routes.keep.dtype == torch.bool
    assert bool(routes.keep.all())
    np.testing.assert_allclose(routes.gate.numpy(), _np_softmax(logits.double().numpy()), atol=1e-7)


def _np_sinkhorn(logits: np.ndarray, iters: int = 2000) -> np.ndarray:
    """Sinkhorn run to convergence: columns to ``n / E``, rows to 1 (Kool et al. Sec. 2.3)."""
    p = _np_softmax(logits)
    n, E = p.shape
    for _ in range(iters):
        p = p * (n / E) / p.sum(0, keepdims=True)
        p = p / p.sum(1, keepdims=True)
    return p


def test_sinkhorn_default_sweeps_reach_the_converged_balanced_choice():
    """Guards ``sinkhorn_routes``' default sweep budget: on batches skewed towards expert 0, the
    default-configured rule (k = 1) picks, for every token, the argmax of the *converged* Sinkhorn
    balanced probabilities (numpy reference, 2000 sweeps). A budget of a couple of sweeps leaves the
    batch unbalanced and routes some tokens to the popular expert instead."""
    for seed in range(40):
        rng = np.random.default_rng(seed)
        logits = rng.normal(size=(8, 4)) * 1.5
        logits[:, 0] += 2.0
        expected = _np_sinkhorn(logits).argmax(-1)
        got = sinkhorn_routes(torch.tensor(logits, dtype=torch.float32), 1).expert[:, 0].numpy()
        np.testing.assert_array_equal(got, expected, err_msg=f"seed {seed}")


def test_noisy_topk_importance_loss_gradient_flows_through_the_gates():
    """Guards eq. 6-7 of Shazeer et al.: ``Importance = sum_x G(x)`` is differentiable in the
    logits through the top-k gates (that is what the importance loss trains). The gradient of
    ``aux["importance"]`` (inference, no noise, load loss off) must equal that of a hand-written
    ``0.1 * Var(I) / mean(I)^2`` over renormalised top-2 gates."""
    logits_np = np.array([[1.0, 0.2, -0.5, 0.0], [0.1, 0.9, 0.3, -1.0], [-0.2, 0.0, 1.5, 0.4]])
    std = torch.full((3, 4), 0.5)
    k = 2
    ref = torch.tensor(logits_np, dtype=torch.float64, requires_grad=True)
    idx = ref.detach().topk(k, dim=-1).indices
    top = ref.gather(-1, idx)
    g = top.exp() / top.exp().sum(-1, keepdim=True)
    imp = torch.zeros(3, 4, dtype=torch.float64).scatter(-1, idx, g).sum(0)
    loss_ref = 0.1 * ((imp - imp.mean()) ** 2).mean() / imp.mean() ** 2
    loss_ref.backward()

    logits = torch.tensor(logits_np, dtype=torch.float32, requires_grad=True)
    routes = noisy_topk_routes(logits, std, k, training=False, importance_coef=0.1, load_coef=0.0)
    assert routes.aux["importance"].item() == pytest.approx(loss_ref.item(), rel=1e-5)
    routes.aux["importance"].backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    np.testing.assert_allclose(logits.grad.numpy(), ref.grad.numpy(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("balanced", [True, False])
def test_balanced_routes_log_prob_is_differentiable_log_softmax(balanced):
    """Guards ``balanced_routes``' ``log_prob``: the differentiable ``log softmax(logits)`` of the
    chosen expert (score-function estimators back-propagate through it). Hand-computed gradient
    of ``sum_x log p(x, e_x)``: ``onehot(e_x) - softmax(x)`` per token."""
    logits_np = np.array([[2.0, 0.0], [1.5, -1.0], [0.0, 0.5], [3.0, 0.2]])
    logits = torch.tensor(logits_np, dtype=torch.float32, requires_grad=True)
    routes = balanced_routes(logits, balanced=balanced)
    expert = routes.expert[:, 0].numpy()
    if balanced:  # quota n / E = 2: expert 1 takes the two tokens with the smallest l0 - l1 (rows 2, 0)
        np.testing.assert_array_equal(expert, [1, 0, 1, 0])
    else:
        np.testing.assert_array_equal(expert, [0, 0, 1, 0])
    probs = _np_softmax(logits_np)
    np.testing.assert_allclose(routes.log_prob[:, 0].detach().numpy(),
                               np.log(probs[np.arange(4), expert]), rtol=1e-6)
    routes.log_prob.sum().backward()
    expected_grad = np.eye(2)[expert] - probs
    assert logits.grad is not None
    np.testing.assert_allclose(logits.grad.numpy(), expected_grad, rtol=1e-5, atol=1e-7)
