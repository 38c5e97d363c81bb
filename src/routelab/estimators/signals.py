"""Training signals for routers (Kool et al. 2021, eq. 2, App. B and Sec. 3.1).

Both objectives take the per-token loss ``f_i = f(x_i, z_i)`` ``[..., n]`` of the routed expert
and single-choice :class:`~routelab.routes.Routes`: one slot per token, ``[..., n, 1]`` (from
:func:`~routelab.estimators.sample_routes` or any router with ``k = 1``). They average over the
``n`` tokens with the routes' importance weights (dropped tokens count 0):

* REINFORCE (eq. 2, with a baseline): the gradient of
  ``(1/n) sum_i keep_i w_i [f_i + (f_i - b) log p(z_i | x_i)]`` (the second term's factor is
  detached) is the off-policy estimate of ``grad E_p[(1/n) sum_i f(x_i, z_i)]`` for the experts
  and the router. ``b`` is an exponential moving average of the loss (decay 0.99).
* Differentiable gating (Sec. 3.1): the expert's output is multiplied by the router probability
  ``gate = p(z_i | x_i)`` before the loss, so the router gets a gradient through the loss itself;
  exploration comes from sampling ``z`` at temperature ``tau`` (equivalently Gumbel noise of
  scale ``tau`` on the log-probabilities). ``(1/n) sum_i keep_i w_i f_i``, with the importance
  weights or, as in most MoE code, without them (``use_weights=False``).
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .. import _autograd
from .._checks import check_finite, device_scalar
from ..routes import Routes

__all__ = ["EMABaseline", "reinforce_objective", "gating_objective"]


class EMABaseline:
    """Exponential moving average of a loss, the REINFORCE baseline ``b``.

    Args:
        decay: weight of the old value, 0.99 in Kool et al. (2021).

    The baseline of a step never depends on that step's value: the first call returns 0 (no
    value seen yet; returning the value itself made the first REINFORCE step's gradient exactly
    0, biased) and sets the average to the observed value. Works elementwise on batched values
    (one baseline per independent run). The average (``value``) is kept in float32 at least, and the
    baseline returned in the dtype of the values observed.
    """

    def __init__(self, decay: float = 0.99) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")
        self.decay = decay
        self.value: Tensor | None = None

    def __call__(self, observed: Tensor) -> Tensor:
        """Return the baseline to use now (before seeing ``observed``), then update it."""
        observed = observed.detach()
        if self.value is not None and observed.shape != self.value.shape:
            raise ValueError(f"EMABaseline averages values of one shape: got {tuple(observed.shape)} after "
                             f"{tuple(self.value.shape)} (use one baseline per shape, or reset it: "
                             f"baseline.value = None)")
        # The average is kept in float32 at least: in half precision the update decay * value +
        # (1 - decay) * observed rounds back to value well short of the mean (a constant 2.0 after a 1.0
        # stalled at 1.90 in float16), and the baseline's variance reduction with it.
        acc = observed.to(torch.promote_types(observed.dtype, torch.float32))
        current = torch.zeros_like(observed) if self.value is None else self.value.to(observed.dtype)
        self.value = acc if self.value is None else self.decay * self.value + (1 - self.decay) * acc
        return current


class _ScoreFunction(torch.autograd.Function):
    """Zero in value, the identity in gradient: ``log_prob - log_prob.detach()`` without its
    ``-inf - (-inf) = NaN`` where a sampled route has ``p = 0`` (a balanced sample can force a token
    onto an expert whose probability underflows, and in half precision ``log p < -65504`` is
    ``-inf``). The gradient ``d log p`` of such a route stays the finite one autograd computes."""

    generate_vmap_rule = True

    @staticmethod
    def forward(log_prob: Tensor) -> Tensor:  # type: ignore[override]
        return torch.zeros_like(log_prob)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad

    @staticmethod
    def jvp(ctx, tangent: Tensor) -> Tensor:  # type: ignore[override]
        return tangent  # forward mode (torch.func.jvp, jacfwd, hessian): the same identity


def _score_function(log_prob: Tensor) -> Tensor:
    """``[...]`` zeros whose derivative (reverse and forward mode) is ``log_prob``'s: the
    score-function term of eq. 2."""
    return _autograd.apply(_ScoreFunction, log_prob)


def reinforce_objective(routes: Routes, loss: Tensor, baseline: Tensor | float = 0.0) -> Tensor:
    """The off-policy REINFORCE surrogate of eq. 2, importance weighted.

    Args:
        routes: single-choice routing, ``[..., n, 1]`` fields.
        loss: ``[..., n]`` per-token loss ``f(x_i, z_i)`` of the routed expert (differentiable in
            the experts' parameters).
        baseline: ``b``: a number, a tensor of the batch shape ``[...]`` (one per run), or a
            tensor with the loss's rank broadcastable to ``[..., n]`` (``[..., 1]`` per run,
            ``[..., n]`` per token).

    Returns:
        ``[...]`` surrogate whose gradient estimates ``grad E_p[(1/n) sum_i f_i]``; its value is
        the weighted mean loss.
    """
    weight, keep, log_prob = _per_token(routes, loss)
    w = weight * keep.to(weight.dtype)
    # In a floating dtype: an integer loss (a 0/1 reward) would truncate a baseline of 0.7 to 0.
    dtype = loss.dtype if loss.is_floating_point() else weight.dtype
    loss = loss.to(dtype)
    # A number is checked on the host and filled in on the device: no copy from the host (a sync on
    # CUDA) and no device check; a tensor or an array is converted and checked (one sync).
    number = isinstance(baseline, numbers.Real)
    b = torch.tensor(baseline, dtype=dtype) if number else torch.as_tensor(baseline, device=loss.device).to(dtype)
    check_finite(b, "baseline values", "pass a finite baseline (a number, or a tensor without NaN/inf)")
    if number:
        b = device_scalar(b.item(), loss, dtype)
    if 0 < b.ndim < loss.ndim:
        if b.shape != loss.shape[:-1]:
            raise ValueError(
                f"baseline of shape {tuple(b.shape)} is neither one per run (the batch shape "
                f"{tuple(loss.shape[:-1])}) nor of the loss's rank; for one baseline per token pass a "
                f"tensor of shape {tuple(loss.shape)} (e.g. b.expand_as(loss))"
            )
        b = b.unsqueeze(-1)  # one baseline per run, [...] -> [..., 1]
    elif b.ndim > 0 and (b.ndim > loss.ndim or any(d not in (1, n) for d, n in zip(b.shape, loss.shape))):
        raise ValueError(
            f"baseline of shape {tuple(b.shape)} does not broadcast to the loss's shape {tuple(loss.shape)}; pass "
            f"a number, one per run {tuple(loss.shape[:-1])}, or a tensor broadcastable to {tuple(loss.shape)}"
        )
    advantage = (loss - b).detach()
    return (w * (loss + advantage * _score_function(log_prob))).mean(-1)


def gating_objective(routes: Routes, loss: Tensor, *, use_weights: bool = True) -> Tensor:
    """Weighted mean of per-token losses computed from gated outputs (Sec. 3.1).

    Args:
        routes: single-choice routing, ``[..., n, 1]`` fields;
            compute ``loss`` from ``routes.gate * output``.
        loss: ``[..., n]`` per-token loss of the gated output.
        use_weights: multiply by the importance weights (False: plain mean over kept tokens
            times ``n_kept / n``, as MoE code without importance weights does).

    Returns:
        ``[...]`` objective to minimise.
    """
    weight, keep, _ = _per_token(routes, loss)
    keep = keep.to(loss.dtype)
    w = weight * keep if use_weights else keep
    return (w * loss).mean(-1)


def _per_token(routes: Routes, loss: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(weight, keep, log_prob)`` of single-choice ``routes`` as ``[..., n]`` tensors, checked
    against the per-token ``loss [..., n]``."""
    if not isinstance(routes, Routes):
        raise TypeError(f"routes must be a Routes from sample_routes, got {type(routes).__name__}")
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss must be a tensor [..., n], got {type(loss).__name__}")
    if routes.num_slots != 1:
        raise ValueError(
            f"these objectives take single-choice routes (one slot per token, [..., n, 1], as sample_routes and "
            f"routers with k = 1 return), got {routes.num_slots} slots per token"
        )
    per_token = routes.expert.shape[:-1]
    if loss.shape != per_token:
        raise ValueError(
            f"loss must have the routes' per-token shape {tuple(per_token)} (one loss per token of the "
            f"single-choice routes), got {tuple(loss.shape)}"
        )
    return routes.weight.squeeze(-1), routes.keep.squeeze(-1), routes.log_prob.squeeze(-1)
