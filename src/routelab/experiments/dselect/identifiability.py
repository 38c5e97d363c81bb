"""Can the training loss tell the true experts apart? The identifiability check of App. C.2.2.

For every set of k experts out of n, the equal-weight gate (1/k on each member) mixes the experts'
outputs; the mixture goes through one logistic unit, and the set is scored by its binary
cross-entropy on the training data:

* **frozen unit**: the unit is the data-generating one, fixed (the loss of that set, as is);
* **trainable unit**: the unit is fitted to the set (the loss after minimising over the unit's
  weights and bias). The labels are 1[generating logit > 0], so the true set's mixture is
  linearly separable and its loss has infimum 0; a ridge of ``RIDGE * |w|^2 / 2`` keeps every
  optimum finite (it is not part of the score, only of the fit).

The rank of the true set is 1 + the number of sets with a strictly lower loss: rank 1 means the
loss the gate is trained on prefers the true experts over every other equal-weight choice.
"""

from __future__ import annotations

from itertools import combinations

import torch
from torch.nn import functional as F

__all__ = ["RIDGE", "NEWTON_STEPS", "all_sets", "set_losses", "true_set_rank"]

RIDGE = 1e-4
"""L2 coefficient of the unit's weights during the trainable-unit fit (keeps the optimum finite)."""

NEWTON_STEPS = 30
"""Most damped Newton steps of the trainable-unit fit (it stops earlier once the gradient is ~0)."""

GRAD_TOL = 1e-7
"""The fit stops when every entry of every set's gradient is below this."""

_HALVINGS = 12
"""Most step halvings in one damped Newton step."""


def all_sets(n: int, k: int) -> torch.Tensor:
    """Every k-subset of ``range(n)`` in lexicographic order: ``[C(n, k), k]`` (int64)."""
    if not (isinstance(n, int) and isinstance(k, int) and 1 <= k <= n):
        raise ValueError(f"need integers 1 <= k <= n, got n={n!r}, k={k!r}.")
    return torch.tensor(list(combinations(range(n), k)), dtype=torch.long)


def _bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean BCE over the last dim: logits ``[S, N]``, y ``[N]`` -> ``[S]``."""
    return F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none").mean(-1)


def _fit_units(feats: torch.Tensor, y: torch.Tensor, w0: torch.Tensor, b0: torch.Tensor) -> torch.Tensor:
    """Ridge-logistic regression of ``y [N]`` on ``feats [S, N, u]`` for each of the S sets at once,
    by damped Newton from ``(w0 [u], b0 [])``; returns the unregularised training loss ``[S]``."""
    S, N, u = feats.shape
    Xt = torch.cat([feats.transpose(1, 2), torch.ones(S, 1, N, dtype=feats.dtype)], dim=1)  # [S, u+1, N]
    theta = torch.cat([w0, b0.reshape(1)]).to(feats.dtype).expand(S, u + 1).clone()      # [S, u+1]
    pen = torch.full((u + 1,), RIDGE, dtype=feats.dtype)
    pen[-1] = 0.0                                                                          # no ridge on the bias

    def logits(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (t.unsqueeze(-1) * x).sum(1)                                                # [S', N]

    def objective(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _bce(logits(t, x), y) + 0.5 * (pen * t * t).sum(-1)

    obj = objective(theta, Xt)
    for _ in range(NEWTON_STEPS):
        p = torch.sigmoid(logits(theta, Xt))                                               # [S, N]
        grad = (Xt * (p - y).unsqueeze(1)).sum(-1) / N + pen * theta                       # [S, u+1]
        if float(grad.abs().max()) < GRAD_TOL:
            break
        hess = torch.bmm(Xt * (p * (1 - p)).unsqueeze(1), Xt.transpose(1, 2)) / N + torch.diag(pen + 1e-12)
        step = torch.linalg.solve(hess, grad.unsqueeze(-1)).squeeze(-1)                    # [S, u+1]
        scale = torch.ones(S, 1, dtype=feats.dtype)
        cand = objective(theta - step, Xt)
        for _ in range(_HALVINGS):  # backtrack, on the sets where the step does not decrease the objective
            worse = torch.nonzero(~(cand <= obj)).flatten()
            if worse.numel() == 0:
                break
            scale[worse] /= 2
            cand[worse] = objective(theta[worse] - scale[worse] * step[worse], Xt[worse])
        better = (cand <= obj).unsqueeze(-1)
        theta = torch.where(better, theta - scale * step, theta)
        obj = torch.where(better.squeeze(-1), cand, obj)
    return _bce(logits(theta, Xt), y)


def set_losses(expert_out: torch.Tensor, y: torch.Tensor, unit_w: torch.Tensor, unit_b: torch.Tensor, k: int,
               *, fit_unit: bool, chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Training loss of the equal-weight gate on every k-set of experts.

    Args:
        expert_out: ``[N, n, u]`` the experts' outputs on the N training points.
        y: ``[N]`` labels in {0, 1}.
        unit_w, unit_b: ``[u]`` and ``[]``: the logistic unit (frozen), or the start of its fit.
        k: set size.
        fit_unit: fit the unit to each set (trainable unit) instead of keeping it fixed.
        chunk: sets processed at once (memory ``chunk * N * u`` numbers).

    Returns:
        ``(sets [C(n, k), k], loss [C(n, k)])``, computed in float64.

    Raises:
        ValueError: shapes that do not match.
    """
    if expert_out.dim() != 3 or y.shape != expert_out.shape[:1] or unit_w.shape != expert_out.shape[2:]:
        raise ValueError(f"expert_out must be [N, n, u] with y [N] and unit_w [u]; got {tuple(expert_out.shape)}, "
                         f"{tuple(y.shape)}, {tuple(unit_w.shape)}.")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}.")
    e = expert_out.double()
    yd = y.double()
    N, n, u = e.shape
    sets = all_sets(n, k)
    flat = e.permute(1, 0, 2).reshape(n, N * u)                                             # [n, N*u]
    out = []
    for lo in range(0, sets.shape[0], chunk):
        part = sets[lo:lo + chunk]
        mix = torch.zeros(part.shape[0], n, dtype=e.dtype).scatter_(1, part, 1.0 / k)     # [S, n] equal weights
        feats = (mix @ flat).view(part.shape[0], N, u)                                      # [S, N, u]
        if fit_unit:
            out.append(_fit_units(feats, yd, unit_w.double(), unit_b.double()))
        else:
            out.append(_bce(feats @ unit_w.double() + unit_b.double(), yd))
    return sets, torch.cat(out)


def true_set_rank(sets: torch.Tensor, losses: torch.Tensor, true: list[int]) -> int:
    """1 + the number of sets whose loss is strictly below the true set's."""
    match = (sets == torch.tensor(sorted(true))).all(-1)
    if int(match.sum()) != 1:
        raise ValueError(f"true = {true} is not one of the sets (each sorted, size {sets.shape[1]}).")
    return 1 + int((losses < losses[match]).sum())
