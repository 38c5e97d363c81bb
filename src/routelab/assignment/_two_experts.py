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
    """
    n = log_p.shape[-2]
    if log_p.numel() == 0:  # an empty batch: nothing to balance
        return log_p.clone(), 0.0
    d = log_p[..., 1] - log_p[..., 0]  # [..., n]
    t1 = target[..., 1].expand(d.shape[:-1]) if target.ndim > 1 else target[1].expand(d.shape[:-1])
    if bool(torch.stack([~torch.isfinite(d).all(), ((t1 <= 0) | (t1 >= n)).any()]).any()):  # one read
        return None
    work = torch.float64 if d.dtype == torch.float64 else torch.float32
    d = d.to(work)
    t1 = t1.to(work).unsqueeze(-1)  # [..., 1]
    base = torch.log(t1 / (n - t1))  # logit of the mean target
    lo = base - d.amax(-1, keepdim=True)  # F(lo) <= 0: every entry at most t1/n
    hi = base - d.amin(-1, keepdim=True)  # F(hi) >= 0
    beta = base - d.mean(-1, keepdim=True)
    err = float("inf")
    for step in range(max_iter + 1):
        q1 = torch.sigmoid(d + beta)
        f = q1.sum(-1, keepdim=True) - t1
        err = float(f.detach().abs().amax())
        if err <= tol or step == max_iter:
            break
        lo = torch.where(f < 0, beta, lo)
        hi = torch.where(f > 0, beta, hi)
        slope = (q1 * (1 - q1)).sum(-1, keepdim=True)
        newton = beta - f / slope.clamp(min=torch.finfo(work).tiny)
        inside = (newton > lo) & (newton < hi) & torch.isfinite(newton)
        beta = torch.where(inside, newton, 0.5 * (lo + hi))
    z = (d + beta).to(log_p.dtype)
    out = torch.stack([torch.nn.functional.logsigmoid(-z), torch.nn.functional.logsigmoid(z)], dim=-1)
    return out, err
