"""Newton's method on Sinkhorn's column dual: the balancing of sharp matrices, where the sweeps crawl.

Balancing ``p = exp(x)`` to rows summing to 1 and columns to ``t`` is the minimisation of the convex
dual (the columns' potentials ``g [k]``, the rows' eliminated in closed form)::

    F(g) = sum_i logsumexp_j(x_ij - g_j) + sum_j t_j g_j,
    grad F = t - c(g),     c_j(g) = sum_i q_ij,    q_ij = softmax_j(x_ij - g_j),
    hess F = sum_i (diag(q_i) - q_i q_i^T)   (positive semidefinite, null along 1).

Sinkhorn's sweeps are coordinate steps on it, slow when ``p`` is sharp (a column gains mass only
through its small entries); Newton's steps, damped (Levenberg-Marquardt, by the column error) and
with a backtracking line search on ``F``, converge from any start and quadratically near the
solution, at ``O(n k^2 + k^3)`` per step. The solution is
the sweeps' fixed point (the same ``q``), so :func:`~routelab.assignment.sinkhorn.sinkhorn` uses
this where its sweeps did not reach the tolerance (without autograd).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["newton_balance"]

#: What a run of steps returns once its error is within tolerance (``None``: go on).
Accept = Callable[[Tensor], object]

#: Newton steps at most; each halves its step at most :data:`MAX_HALVINGS` times.
MAX_STEPS = 100
MAX_HALVINGS = 60
#: Newton gives up when the best of its largest column errors has not fallen by a tenth over this many steps.
STALL_STEPS = 20
#: Newton runs for at most this many columns (its systems are ``k x k``, its Hessians ``O(n k^2)``).
MAX_K = 256
#: Armijo's sufficient-decrease constant.
ARMIJO = 1e-4
#: The Levenberg-Marquardt damping per unit of column error (measured on sharp 512 x 16 problems:
#: at logit scales 100-1000 it converges in 7-26 steps, against up to 48 undamped with hundreds of
#: step halvings).
DAMPING = 1e-2


def _state(x: Tensor, t: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(F [...], log_q [..., n, k], c [..., k])`` at the column potentials ``g [..., k]``."""
    z = x - g.unsqueeze(-2)
    lse = torch.logsumexp(z, dim=-1)  # [..., n]
    log_q = z - lse.unsqueeze(-1)
    return lse.sum(-1) + (t * g).sum(-1), log_q, log_q.exp().sum(-2)


def newton_balance(x: Tensor, target: Tensor, *, tol: float, max_steps: int = MAX_STEPS) -> tuple[Tensor, float] | None:
    """Balance ``exp(x)`` (rows to 1, columns to ``target``) by damped Newton steps on the column dual.

    Args:
        x: ``[..., n, k]`` log-probabilities, finite or ``-inf`` (impossible pairs), every row with a
            finite entry; typically the sweeps' last iterate (any row and column scaling of the
            problem balances to the same result).
        target: ``[..., k]`` (or ``[k]``) non-negative column targets adding up to ``n``; a column
            whose target is 0 is set to ``-inf`` (its balanced value), and every row needs a finite
            entry in a column with a positive target.
        tol: the largest column error accepted, judged in ``x``'s dtype.
        max_steps: most Newton steps in all (each run below takes at most :data:`MAX_STEPS`).

    Newton's steps run from ``x`` itself first. Where they fail and every entry of a kept column is
    finite (the marginals are then feasible), they run again by continuation in the temperature
    (:func:`_annealed`): a sharp ``p`` leaves every row one-hot to float64 far from the solution, so
    the column errors stay at whole numbers while the potentials must move by hundreds of nats.

    Returns:
        ``(log_q, err)``: the first iterate whose largest column error in ``x``'s dtype is within
        ``tol`` (rows sum to 1 to rounding), or ``None`` when none was within ``max_steps`` steps,
        when the error stalled (its best did not fall by a tenth over :data:`STALL_STEPS` steps: the
        marginals infeasible for the ``-inf`` pattern, or the problem beyond float64), or when a
        Newton system was singular. Computed in float64.
    """
    t = target.detach().to(torch.float64).expand(x.shape[:-2] + x.shape[-1:])
    empty = t == 0  # [..., k]: columns balanced to zero (-inf); F is flat along each of them
    xd = x.detach().to(torch.float64).masked_fill(empty.unsqueeze(-2), -torch.inf)
    out_target = target.detach().to(x.dtype)

    def accept(log_q: Tensor) -> tuple[Tensor, float] | None:  # judged where it counts: in x's dtype
        out = log_q.to(x.dtype)
        out = out - torch.logsumexp(out, dim=-1, keepdim=True)  # rows to 1 in x's dtype, as the sweeps end
        out_err = float((out.exp().sum(-2) - out_target).abs().amax())
        return (out, out_err) if out_err <= tol else None

    budget = [max_steps]
    found, _ = _steps(xd, t, empty, torch.zeros_like(t), tol, accept, budget)
    if found is None and bool((torch.isfinite(xd) | empty.unsqueeze(-2)).all()):
        found = _annealed(xd, t, empty, tol, accept, budget)
    return found


#: Continuation in the temperature starts where every row of ``x / T`` spans at most this many nats.
ANNEAL_RANGE = 16.0
#: ... and takes at most this many halvings of ``T`` (more than any float64 spread needs: its range
#: is 2^2048; the steps' budget bounds the work).
MAX_LEVELS = 2100


def _annealed(xd: Tensor, t: Tensor, empty: Tensor, tol: float, accept: Accept,
              budget: list[int]) -> tuple[Tensor, float] | None:
    """Newton's method by continuation: balance ``x / T`` for ``T = 2^m, ..., 2`` (each to a loose
    tolerance, from the previous level's potentials doubled, as the potentials scale like ``x / T``),
    then ``x`` itself from there. ``2^m`` brings every row within :data:`ANNEAL_RANGE` nats."""
    finite = torch.isfinite(xd)
    top = xd.amax(-1, keepdim=True)
    spread = float((top - torch.where(finite, xd, top)).amax())
    levels = min(MAX_LEVELS, math.ceil(math.log2(spread / ANNEAL_RANGE))) if spread > ANNEAL_RANGE else 0
    if levels == 0:
        return None  # x is as soft as the first level: the steps from x already failed on it
    loose = max(tol, 1e-3 * float(t.amax()))
    g = torch.zeros_like(t)
    for level in range(levels, 0, -1):
        temperature = 2.0**level
        done, g = _steps(xd / temperature, t, empty, g, loose, lambda log_q: True, budget)
        if done is None:
            return None
        g = 2 * g  # the next level's potentials, to first order
    return _steps(xd, t, empty, g, tol, accept, budget)[0]


def _steps(xd: Tensor, t: Tensor, empty: Tensor, g: Tensor, tol: float, accept: Accept,
           budget: list[int]) -> tuple[object, Tensor]:
    """Damped Newton steps on ``F`` from the potentials ``g [..., k]`` until the largest column error
    (float64) is within ``tol`` and ``accept(log_q)`` returns a result. ``budget``: a one-element
    list of the steps left, shared by the runs of one call. Returns ``(result or None, g)``."""
    k = xd.shape[-1]
    ones = torch.ones(k, k, dtype=torch.float64, device=xd.device)
    eye = torch.eye(k, dtype=torch.float64, device=xd.device)
    F, log_q, c = _state(xd, t, g)
    worst_seen: list[float] = []
    for _ in range(MAX_STEPS + 1):
        r = c - t  # [..., k]: minus the gradient
        err = r.abs().amax(-1)
        worst = float(err.max())  # one read per step
        if worst <= tol:
            found = accept(log_q)
            if found is not None:
                return found, g
        worst_seen.append(worst)
        # (the error need not fall at every step: the best of the last steps against the best before)
        recent, before = worst_seen[-STALL_STEPS:], worst_seen[:-STALL_STEPS]
        stalled = bool(before) and min(recent) > 0.9 * min(before)
        if budget[0] <= 0 or len(worst_seen) > MAX_STEPS or stalled:
            return None, g
        budget[0] -= 1
        active = err > tol / 4  # a margin for the rounding to x's dtype
        if not bool(active.any()):
            return None, g  # within tol in float64 but not after rounding to x's dtype
        q = log_q.exp()
        hess = torch.diag_embed(c) - q.transpose(-1, -2) @ q  # [..., k, k]
        scale = torch.diagonal(hess, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300)
        # Shift the null direction 1 (F is flat along it) to the diagonal's scale (r is orthogonal
        # to 1), and damp by the error (Levenberg-Marquardt: a sharp p leaves few fractional rows,
        # so hess is nearly singular far from the solution; the damping vanishes near it). A
        # balanced entry of the batch (perhaps with rows exactly one-hot: hess = 0) solves I. An
        # empty column's potential is free as well: its diagonal gets the scale (r = 0 there).
        damping = DAMPING * r.abs().sum(-1)
        diagonal = damping.unsqueeze(-1) + empty * scale.unsqueeze(-1)
        system = hess + ones * (scale / k)[..., None, None] + torch.diag_embed(diagonal)
        system = torch.where(active[..., None, None], system, eye)
        step, info = torch.linalg.solve_ex(system, r.unsqueeze(-1))
        if bool(((info != 0) & active).any()):
            return None, g
        step = torch.where(active.unsqueeze(-1), step.squeeze(-1), torch.zeros_like(r))
        slope = -(r * step).sum(-1)  # grad F . step (< 0 where active)
        alpha = torch.ones_like(F)
        accepted = ~active
        new = (F, log_q, c)
        norm = r.abs().sum(-1)
        for _ in range(MAX_HALVINGS):
            trial = _state(xd, t, g + alpha.unsqueeze(-1) * step)
            # Armijo's decrease of F; or, where that decrease is below F's rounding (a sharp p
            # makes F large), a smaller column error
            ok = (trial[0] <= F + ARMIJO * alpha * slope) | (
                ((trial[0] - F).abs() <= 64 * torch.finfo(F.dtype).eps * F.abs())
                & ((trial[2] - t).abs().sum(-1) < norm))
            take = ok & ~accepted
            new = tuple(torch.where(_expand(take, a), a, b) for a, b in zip(trial, new, strict=True))
            g = torch.where(take.unsqueeze(-1), g + alpha.unsqueeze(-1) * step, g)
            accepted = accepted | ok
            if bool(accepted.all()):
                break
            alpha = torch.where(accepted, alpha, alpha / 2)
        if not bool(accepted.all()):  # no decrease along a Newton direction: beyond float64
            return None, g
        F, log_q, c = new
    return None, g


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    """``mask [...]`` broadcast against ``like [..., *rest]``."""
    return mask.reshape(mask.shape + (1,) * (like.dim() - mask.dim()))
