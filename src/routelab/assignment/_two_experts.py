"""Two experts (and one) in closed form: routelab's k <= 2 special cases, in one place.

With ``k <= 2`` experts the balanced assignment is a selection (no graph search), its expert
graph has two nodes, and Sinkhorn's fixed point is one dual variable found by Newton. The
samplers of :mod:`routelab.estimators` have closed forms for two experts too
(``estimators/two_experts.py``). :func:`closed_form` is the one switch all of them consult
(public as :func:`routelab.assignment.uses_closed_form`); tests set :data:`ENABLED` to ``False``
to compare every special case with the general path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._graph import release_arcs

__all__ = ["ENABLED", "closed_form", "two_expert_assignment", "two_expert_graph", "two_expert_sinkhorn"]

#: The one switch of the closed forms (``False``: every caller takes its general path).
ENABLED = True


def closed_form(k: int) -> bool:
    """Whether ``k`` experts take a closed-form path (``k <= 2`` while :data:`ENABLED`)."""
    return ENABLED and k <= 2


def two_expert_assignment(S: Tensor, c: int) -> Tensor:
    """Exact solution for ``k <= 2`` by selection (no graph needed).

    With two experts, putting ``m`` tokens on expert 0 is best done with the ``m`` largest
    differences ``d_i = s[i, 0] - s[i, 1]``, and the capacities allow ``n - c <= m <= c``: take
    every positive difference, clamped to that range. (``k = 1``: everything on expert 0.)

    Args:
        S: ``[B, n, k]`` finite scores, ``k <= 2``.
        c: capacity.

    Returns:
        ``[B, n]`` long expert per token.
    """
    B, n, k = S.shape
    if k == 1:
        return torch.zeros((B, n), dtype=torch.long, device=S.device)
    d = S[..., 0] - S[..., 1]
    positive = d > 0
    m = positive.sum(-1).clamp(min=n - c, max=c)  # tokens on expert 0
    on_zero = positive.clone()
    for bound in sorted({n - c, c}):
        rows = ((m == bound) & (positive.sum(-1) != bound)).nonzero().flatten()
        if rows.numel() == 0:
            continue
        dr = d[rows]
        # The bound-th largest value; ties at it are taken in token order up to the bound.
        t = torch.kthvalue(dr, n - bound + 1, dim=-1, keepdim=True).values
        above = dr > t
        tie = dr == t
        room = bound - above.sum(-1, keepdim=True)
        on_zero[rows] = above | (tie & (torch.cumsum(tie, -1) <= room))
    return (~on_zero).long()


def two_expert_graph(S: Tensor, z: Tensor, c: int, big: Tensor) -> Tensor:
    """The expert graph ``[B, 2, 2]`` (float64) of a two-expert assignment, without slot tables."""
    d = (S[..., 0] - S[..., 1]).to(torch.float64)
    inf = float("inf")
    move_01 = d.masked_fill(z != 0, inf).amin(-1)  # cheapest move of a token from 0 to 1
    move_10 = (-d).masked_fill(z != 1, inf).amin(-1)
    move = torch.full((z.shape[0], 2, 2), inf, dtype=torch.float64, device=S.device)
    move[:, 0, 1], move[:, 1, 0] = move_01, move_10
    counts = torch.stack([(z == 0).sum(-1), (z == 1).sum(-1)], dim=-1)
    return torch.minimum(move, release_arcs(counts, c, big))


def two_expert_sinkhorn(log_p: Tensor, target: Tensor, *, tol: float, max_iter: int) -> tuple[Tensor, float] | None:
    """Sinkhorn's fixed point for two experts, by safeguarded Newton on one dual variable.

    With two columns the balanced matrix is ``q_i1 = sigmoid(d_i + beta)``, ``q_i0 = 1 - q_i1``
    with ``d_i = log p_i1 - log p_i0`` and one ``beta`` per instance: the same KL projection the
    alternating iteration converges to (its row and column scalings only ever change
    ``beta``). ``F(beta) = sum_i sigmoid(d_i + beta) - target_1`` is increasing, so Newton steps
    kept inside a shrinking bracket (bisection when a step leaves it) converge in a handful of
    iterations where the alternating sweeps may need thousands (peaked ``p``). ``max_iter``
    bounds the Newton steps. Returns ``None`` (use the sweeps) for non-finite input or a target
    of 0 or ``n`` on one side.

    ``beta`` is searched in float64 whatever the dtype (a shift of 1000 nats in float32 leaves
    the column sums 1e-4 off) and without autograd: its gradient is that of the fixed point,
    by the implicit function theorem on ``F(beta; d, t) = 0``, ``dbeta/dd_i = -w_i / W`` and
    ``dbeta/dt_1 = 1 / W`` with ``w_i = q_i1 q_i0`` and ``W = sum_i w_i``, not that of the
    search's stopped iterate (which is far off where ``W`` is tiny, i.e. ``p`` is sharp).

    Returns:
        ``(log_q [..., n, 2], err)``: ``err`` is the largest error of either column sum.
    """
    n = log_p.shape[-2]
    if log_p.numel() == 0:  # an empty batch: nothing to balance
        return log_p.clone(), 0.0
    d = log_p[..., 1].double() - log_p[..., 0].double()  # [..., n]
    t = target.double().expand(*d.shape[:-1], 2)  # [..., 2]
    t1 = t[..., 1:]  # [..., 1]
    if bool(torch.stack([~torch.isfinite(d).all(), ((t1 <= 0) | (t1 >= n)).any()]).any()):  # one read
        return None
    beta, err = _two_expert_dual(d.detach(), t.detach(), tol=tol, max_iter=max_iter)
    if torch.is_grad_enabled() and (d.requires_grad or t.requires_grad):
        # The fixed point's derivative (above): beta's value, the implicit gradient.
        q1 = torch.sigmoid(d + beta)
        slope = (q1 * (1 - q1)).sum(-1, keepdim=True).detach().clamp(min=torch.finfo(torch.float64).tiny)
        implicit = -(q1.sum(-1, keepdim=True) - t1) / slope
        beta = beta + (implicit - implicit.detach())
    z = d + beta
    out = torch.stack([torch.nn.functional.logsigmoid(-z), torch.nn.functional.logsigmoid(z)], dim=-1)
    return out.to(log_p.dtype), err


def _two_expert_dual(d: Tensor, t: Tensor, *, tol: float, max_iter: int) -> tuple[Tensor, float]:
    """``beta [..., 1]`` with ``sum_i sigmoid(d_i + beta) = t_1`` (``d [..., n]``, ``t [..., 2]``,
    float64, no autograd): at most ``max_iter`` safeguarded Newton steps, stopping once both column
    sums are within float64's resolution of their targets (a few more steps than ``tol`` needs, on
    ``n`` numbers: the gradient is that of the fixed point only at the fixed point, and where ``p``
    is sharp a column error of ``tol`` leaves ``beta`` nats away from it); returns ``beta`` and the
    largest column error.

    (``tol`` still bounds the work where float64 cannot resolve the sums any better: the search
    stops at ``max_iter`` or once a step no longer changes ``beta``.)"""
    n = d.shape[-1]
    tight = min(tol, 4 * torch.finfo(torch.float64).eps * n**0.5 * max(1.0, float(t.amax())))
    t0, t1 = t[..., :1], t[..., 1:]
    base = torch.log(t1 / (n - t1))  # logit of the mean target
    lo = base - d.amax(-1, keepdim=True)  # F(lo) <= 0: every entry at most t1/n
    hi = base - d.amin(-1, keepdim=True)  # F(hi) >= 0
    beta = base - d.mean(-1, keepdim=True)
    err, settled = float("inf"), False
    for step in range(max_iter + 1):
        q1 = torch.sigmoid(d + beta)
        s1 = q1.sum(-1, keepdim=True)
        f = s1 - t1
        # (column 0's sum is n - s1: its target may differ from n - t1 by the rounding of the targets)
        err = float(torch.maximum(f.abs(), (n - s1 - t0).abs()).amax())
        if err <= tight or step == max_iter or (err <= tol and settled):
            break
        lo = torch.where(f < 0, beta, lo)
        hi = torch.where(f > 0, beta, hi)
        slope = (q1 * (1 - q1)).sum(-1, keepdim=True)
        newton = beta - f / slope.clamp(min=torch.finfo(torch.float64).tiny)
        inside = (newton > lo) & (newton < hi) & torch.isfinite(newton)
        stepped = torch.where(inside, newton, 0.5 * (lo + hi))
        settled = bool((stepped == beta).all()) if err <= tol else False
        beta = stepped
    return beta, err
