"""Approximate expert prices (dual variables) to warm-start the exact balanced assignment.

The dual of the balanced assignment has one price ``u_j`` per expert: at the optimum every token
sits at an expert maximising ``s[i, j] - u_j`` and prices are 0 on experts with free capacity.
Smoothing the dual with a temperature ``T``,

    F_T(u) = sum_i T * logsumexp_j((s[i, j] - u_j) / T) + c * sum_j u_j,

gives a convex function whose minimiser makes the soft column sums equal ``c`` (a Sinkhorn
scaling). Its Hessian is only ``k x k``, so a few damped Newton steps along a decreasing
temperature schedule get prices that place almost every token correctly. They only speed up the
start: exactness comes from the cycle cancelling that follows.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Temperatures relative to the spread (standard deviation) of the scores, one Newton step each.
DEFAULT_SCHEDULE = (0.3, 0.05, 0.01, 0.002, 0.0004)
# At most this many Newton steps in all (the schedule plus repeats after clipped steps).
MAX_STEPS = 12
# A Newton step moves no price by more than STEP_LIMIT temperatures; a clipped step is repeated
# at the same temperature, up to LEVEL_STEPS steps per temperature.
STEP_LIMIT = 4.0
LEVEL_STEPS = 3


def approximate_prices(
    S: Tensor,
    c: int,
    schedule: tuple[float, ...] = DEFAULT_SCHEDULE,
    center: bool = True,
    max_steps: int = MAX_STEPS,
) -> Tensor:
    """Damped Newton on the smoothed dual along a temperature schedule.

    Args:
        S: ``[B, n, k]`` finite scores.
        c: capacity per expert.
        schedule: temperatures as fractions of each instance's score spread (standard deviation).
        center: start from the centred column means (removes additive expert biases at once).
        max_steps: total Newton steps allowed; a step clipped by the damping is repeated at the
            same temperature.

    Returns:
        ``[B, k]`` prices (``>= 0`` when there is slack capacity, ``c * k > n``).
    """
    B, n, k = S.shape
    slack = c * k > n
    # The score spread sets the temperature scale; a few hundred tokens estimate it well.
    sample = S[:, :: max(1, n // 512)]
    spread = sample.std(dim=(-2, -1), correction=0).clamp(min=torch.finfo(S.dtype).eps).view(B, 1, 1)
    u = torch.zeros(B, 1, k, dtype=S.dtype, device=S.device)
    if center:
        u = S.mean(dim=1, keepdim=True)
        u = u - (u.amin(dim=-1, keepdim=True) if slack else u.mean(dim=-1, keepdim=True))
    eye = torch.eye(k, dtype=S.dtype, device=S.device)
    # Two buffers reused by every step: fresh large temporaries cost page faults on CPU.
    X = torch.empty_like(S)
    P = torch.empty_like(S)
    level, steps, at_level = 0, 0, 0
    while level < len(schedule) and steps < max_steps:
        T = spread * schedule[level]
        steps += 1
        at_level += 1
        torch.sub(S, u, out=X).div_(T)
        # Entries below exp(-40) of their row's maximum change nothing, but as denormal numbers
        # (and products of them in the Hessian) they slow the CPU down several-fold: clamp them.
        X.sub_(X.amax(dim=-1, keepdim=True)).clamp_(min=-40.0)
        torch.softmax(X, dim=-1, out=P)  # [B, n, k]
        col = P.sum(dim=1)  # [B, k]
        grad = c - col
        H = _hessian(P, col) / T
        # A ridge keeps H invertible when the softmax saturates (every token has a clear
        # favourite): H -> 0 there, and the damped step below then bounds the move.
        ridge = H.diagonal(dim1=-2, dim2=-1).mean(-1).view(B, 1, 1) + 1e-3 * c / T
        if slack:
            # Projected Newton: experts at price 0 that are under-full stay at 0.
            fixed = (u.view(B, k) <= 0) & (grad > 0)
            grad = grad.masked_fill(fixed, 0.0)
            keep = (~fixed).to(S.dtype)
            H = H * keep.unsqueeze(-1) * keep.unsqueeze(-2) + torch.diag_embed(1.0 - keep) * ridge
        else:
            H = H + ridge / k  # the prices are defined up to a common shift
        H = H + 1e-6 * ridge * eye
        # Solved in float64 (k x k is cheap); should it still be singular, a diagonal step.
        sol, info = torch.linalg.solve_ex(H.double(), grad.double().unsqueeze(-1))
        diagonal = grad / H.diagonal(dim1=-2, dim2=-1).clamp(min=torch.finfo(S.dtype).tiny)
        ok = (info == 0).unsqueeze(-1) & torch.isfinite(sol.squeeze(-1))
        step = torch.where(ok, sol.squeeze(-1).to(S.dtype), diagonal).view(B, 1, k)
        # Damping: a Newton step beyond a few temperatures leaves the region where it is accurate.
        # A clipped step means the prices are still far from this temperature's optimum: stay at
        # this temperature for another step (within the step budget) instead of cooling.
        limit = STEP_LIMIT * T
        factor = limit / step.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
        step = step * factor.clamp(max=1.0)
        u = u - step
        if at_level >= LEVEL_STEPS or not bool((factor < 1.0).any()):
            level, at_level = level + 1, 0
        if slack:
            u = u.clamp(min=0.0)
    return u.view(B, k)


def _hessian(P: Tensor, col: Tensor) -> Tensor:
    """``[B, k, k]`` ``sum_i diag(p_i) - p_i p_i^T`` (the smoothed dual's Hessian times ``T``).

    A row whose softmax has saturated (one entry within ``1e-6`` of 1) contributes almost
    nothing; at low temperatures most rows have, so only the others enter the product.

    Args:
        P: ``[B, n, k]`` row-stochastic matrix.
        col: ``[B, k]`` its column sums.
    """
    B, n, k = P.shape
    live = P.amax(dim=-1) < 1.0 - 1e-6  # [B, n]
    m = int(live.sum(-1).max())
    if m > n // 2:
        return torch.diag_embed(col) - P.transpose(1, 2) @ P
    order = torch.argsort(live.to(torch.int8), dim=-1, descending=True, stable=True)[:, :m]
    Q = P.gather(1, order.unsqueeze(-1).expand(B, m, k))
    Q = Q * live.gather(1, order).unsqueeze(-1).to(P.dtype)  # instances with fewer live rows
    return torch.diag_embed(Q.sum(dim=1)) - Q.transpose(1, 2) @ Q
