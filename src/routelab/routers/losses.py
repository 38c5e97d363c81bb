"""Auxiliary load-balancing losses of routers (unweighted; routers multiply by coefficients)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cv_squared", "noisy_topk_load", "switch_balance"]


def cv_squared(x: Tensor, eps: float = 1e-10) -> Tensor:
    """Squared coefficient of variation ``Var(x) / mean(x)^2`` of a ``[E]`` vector.

    The population variance is used, as in Shazeer et al.'s reference implementation. ``0`` for
    a single expert or an empty batch.
    """
    if x.numel() <= 1:
        return x.new_zeros(())
    x = x.float()
    return x.var(unbiased=False) / (x.mean() ** 2 + eps)


def switch_balance(probs: Tensor, expert: Tensor, candidate: Tensor) -> Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e P_e`` for top-k routing.

    Args:
        probs: ``[tokens, E]`` router probabilities (differentiable).
        expert: ``[tokens, slots]`` chosen experts.
        candidate: ``[tokens, slots]`` bool, which slots count.

    Returns:
        Scalar; ``1`` when routing and probabilities are uniform. ``f_e`` is the fraction of the
        counted slots that chose ``e`` (not differentiable), ``P_e`` the mean probability.
    """
    n, E = probs.shape
    if n == 0:
        return probs.new_zeros(())
    counts = torch.zeros(E, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(0, expert.reshape(-1), candidate.reshape(-1).to(probs.dtype))
    f = counts / counts.sum().clamp(min=1)
    return E * (f.detach() * probs.mean(0)).sum()


def noisy_topk_load(clean: Tensor, noisy: Tensor, noise_std: Tensor, top_values: Tensor, k: int) -> Tensor:
    """Smooth load estimate of Shazeer et al. (2017), App. A: ``Load_i = sum_x P(x, i)``.

    ``P(x, i) = Phi((clean_i - kth_excluding(noisy, k, i)) / noise_std_i)`` is the probability
    that expert ``i`` stays in the top ``k`` when only its own noise is redrawn. The ``k``-th
    largest noisy logit among the *other* experts is the ``(k+1)``-th overall if ``i`` is in the
    top ``k``, else the ``k``-th.

    Args:
        clean: ``[tokens, E]`` logits without noise (differentiable).
        noisy: ``[tokens, E]`` logits with noise.
        noise_std: ``[tokens, E]`` noise standard deviation (differentiable, > 0).
        top_values: ``[tokens, min(k+1, E)]`` largest noisy logits, descending.
        k: experts per token.

    Returns:
        ``[E]`` load per expert.
    """
    n, E = clean.shape
    if k >= E:  # every expert is always chosen
        return torch.full((E,), float(n), device=clean.device, dtype=clean.dtype)
    threshold_if_in = top_values[:, k : k + 1]
    threshold_if_out = top_values[:, k - 1 : k]
    is_in = noisy > threshold_if_in
    normal = torch.distributions.Normal(clean.new_zeros(()), clean.new_ones(()))
    prob_if_in = normal.cdf((clean - threshold_if_in) / noise_std)
    prob_if_out = normal.cdf((clean - threshold_if_out) / noise_std)
    return torch.where(is_in, prob_if_in, prob_if_out).sum(0)
