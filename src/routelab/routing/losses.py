"""Auxiliary load-balancing losses of routing rules (unweighted; rules multiply by coefficients):
the Switch-Transformer loss, defined once for every router and estimator, and the importance
and load losses of noisy top-k gating (Shazeer et al. 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cv_squared", "noisy_topk_load", "switch_balance"]


def switch_balance(probs: Tensor) -> Tensor:
    """Switch-Transformer load-balancing loss ``E * sum_e f_e P_e`` (Fedus et al. 2021, eq. 4).

    The one definition in routelab, used by every router's and estimator's ``aux["balance"]``:

    * ``f_e``: the fraction of the ``n`` tokens whose router argmax is ``e`` -- the argmax of the
      router's own probabilities, i.e. of its logits *before* noise, capacity, balancing or
      sampling (not differentiable; ties go to the lower index, as :func:`torch.argmax`);
    * ``P_e``: the mean router probability of ``e`` over the tokens (differentiable).

    Counting the router's argmax, not the experts a rule finally keeps, is what makes the loss
    act where routing is balanced by construction: a Gumbel-Matching or BASE assignment keeps
    exactly ``n / E`` tokens per expert, so a loss counting the kept tokens would be the
    constant 1 with zero gradient, while the router itself may still prefer one expert.
    The loss is 1 when both ``f`` and ``P`` are uniform, and at most ``E``.

    Args:
        probs: ``[..., n, E]`` router probabilities (differentiable), e.g. ``softmax(logits)``.

    Returns:
        ``[...]`` (``0`` for an empty batch, ``n = 0``).
    """
    n, E = probs.shape[-2], probs.shape[-1]
    batch = probs.shape[:-2]
    if n == 0:
        return probs.new_zeros(batch)
    top = probs.detach().argmax(-1)  # [..., n]
    counts = torch.zeros((*batch, E), dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(-1, top, torch.ones(top.shape, dtype=probs.dtype, device=probs.device))
    return (counts * probs.mean(-2)).sum(-1) * (E / n)  # E sum_e (counts_e / n) P_e


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
    # The standard normal CDF (torch.distributions.Normal.cdf validates its input: host syncs).
    prob_if_in = torch.special.ndtr(_z_score(clean - threshold_if_in, noise_std))
    prob_if_out = torch.special.ndtr(_z_score(clean - threshold_if_out, noise_std))
    return torch.where(is_in, prob_if_in, prob_if_out).sum(0)


#: Where the standard normal CDF is 0 or 1 in every float format (``Phi(-40) < 1e-300``).
_Z_SATURATED = 40.0


def _z_score(gap: Tensor, noise_std: Tensor) -> Tensor:
    """``gap / noise_std`` clamped to ``[-40, 40]``, with a finite gradient at any magnitude.

    The gap is clamped at ``40 noise_std`` *before* the division: clamping the quotient after it
    leaves the division's backward to form ``gap / noise_std^2``, which overflows for finite
    inputs (a logit gap of 3e35 at noise 0.01) and turns the zero gradient into NaN. A scale below
    the dtype's smallest normal number (exactly 0 where ``softplus`` underflows) counts as that
    number: the ``noise_std -> 0`` limit, ``+-40`` by the gap's sign (0/0 was NaN)."""
    noise_std = noise_std.clamp(min=torch.finfo(noise_std.dtype).tiny)
    bound = _Z_SATURATED * noise_std
    return torch.minimum(torch.maximum(gap, -bound), bound) / noise_std
