"""Auxiliary load-balancing losses of routing rules (unweighted; rules multiply by coefficients):
the Switch-Transformer loss, defined once for every router and estimator, and the importance
and load losses of noisy top-k gating (Shazeer et al. 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FRACTIONS", "cv_squared", "noisy_topk_load", "switch_balance", "switch_balance_from"]

#: What the routed fraction ``f_e`` of :func:`switch_balance` is a fraction of.
FRACTIONS: tuple[str, ...] = ("slots", "tokens")


def switch_balance(probs: Tensor, expert: Tensor, keep: Tensor | None = None, *, fraction_of: str = "slots") -> Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e P_e`` (Fedus et al. 2021).

    ``P_e`` is the mean router probability of expert ``e`` over the ``n`` tokens, ``f_e`` the
    routed fraction of ``e`` (not differentiable). It is 1 when both are uniform and grows as the
    routing concentrates. The two normalisations of ``f`` in use:

    * ``fraction_of="slots"``: ``f_e`` = counted slots on ``e`` / all counted slots (``f`` sums
      to 1): the routers' ``aux["balance"]`` (:func:`routelab.routers.losses.switch_balance`);
    * ``fraction_of="tokens"``: ``f_e`` = counted slots on ``e`` / ``n`` tokens (a dropped token
      lowers the sum): the record of :func:`routelab.estimators.sample_routes`
      (:func:`routelab.estimators.switch_balance_loss`).

    Args:
        probs: ``[..., n, E]`` router probabilities (differentiable).
        expert: ``[..., n, slots]`` chosen experts, in ``[0, E)`` (not checked here).
        keep: optional ``[..., n, slots]`` bool, the slots that count (default: all).
        fraction_of: ``"slots"`` or ``"tokens"``, see above.

    Returns:
        ``[...]`` (``0`` for an empty batch, ``n = 0``).
    """
    if fraction_of not in FRACTIONS:
        raise ValueError(f"fraction_of must be one of {', '.join(FRACTIONS)}, got {fraction_of!r}")
    n, E = probs.shape[-2], probs.shape[-1]
    batch = probs.shape[:-2]
    if n == 0:
        return probs.new_zeros(batch)
    flat = expert.reshape(*batch, expert.shape[-2] * expert.shape[-1])
    counted = torch.ones(flat.shape, dtype=probs.dtype, device=probs.device) if keep is None else \
        keep.reshape(flat.shape).to(probs.dtype)
    counts = torch.zeros((*batch, E), dtype=probs.dtype, device=probs.device).scatter_add_(-1, flat, counted)
    total = counts.sum(-1, keepdim=True).clamp(min=1) if fraction_of == "slots" else n
    return switch_balance_from(counts / total, probs.mean(-2))


def switch_balance_from(fraction: Tensor, mean_prob: Tensor) -> Tensor:
    """``E * sum_e f_e P_e`` from its two halves, ``fraction`` ``f [..., E]`` (detached here) and
    ``mean_prob`` ``P [..., E]``: for callers that have them in closed form (two experts)."""
    return fraction.shape[-1] * (fraction.detach() * mean_prob).sum(-1)


def cv_squared(x: Tensor, eps: float = 1e-10) -> Tensor:
    """Squared coefficient of variation ``Var(x) / mean(x)^2`` of a ``[E]`` vector.

    The population variance is used, as in Shazeer et al.'s reference implementation. ``0`` for
    a single expert or an empty batch.
    """
    if x.numel() <= 1:
        return x.new_zeros(())
    x = x.float()
    return x.var(unbiased=False) / (x.mean() ** 2 + eps)


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
