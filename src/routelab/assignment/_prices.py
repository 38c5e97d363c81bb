"""Approximate expert prices (dual variables) to warm-start the exact balanced assignment.

The dual of the balanced assignment has one price ``u_j`` per expert: at the optimum every token
sits at an expert maximising ``s[i, j] - u_j`` and prices are 0 on experts with free capacity.
Smoothing the dual with a temperature ``T``,

    F_T(u) = sum_i T * logsumexp_j((s[i, j] - u_j) / T) + c * sum_j u_j,

gives a convex function whose minimiser makes the soft column sums equal ``c`` (a Sinkhorn
scaling). Its Hessian is only ``k x k``, so a few damped Newton steps along a decreasing
temperature schedule get prices that place almost every token correctly. They only speed up the
start: exactness comes from the cycle cancelling that follows.

**Active set.** At low temperatures most tokens are *saturated*: one expert beats every other by
many temperatures, so the token adds exactly one to that expert's column sum and nothing to the
Hessian. A full step marks the tokens whose best expert leads by more than ``freeze_gap``
temperatures as frozen; the following steps softmax only the other rows and add the frozen
tokens' fixed counts. Each colder level freezes more of the remaining rows (by ``shrink_gap``
of its temperature), so the steps run on fewer and fewer rows. A frozen token stays saturated
while the prices move by less than half its lead minus ``saturated_gap`` temperatures; when
they have moved further, the step falls back to the last generation of the chain whose tokens
are all still saturated, or to a full step (which freezes afresh). The result is the same as
full steps up to ``exp(-saturated_gap)`` per frozen token.

**Host arithmetic.** Each step also does ``k x k`` work (the Newton system, the damping, the
validity checks); the prices and temperatures therefore live in float64 numpy arrays between
steps, and on CPU the Newton system is solved by LAPACK directly: for tensors this small the
per-operation cost of PyTorch's dispatch, not the arithmetic, is what a step costs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .._checks import to_device
from ._tuning import TUNING, SolverTuning
from ._workspace import SCORES_A, SCORES_B, scratch

LOG2E = 1.0 / math.log(2.0)
# Entries further than TUNING.clamp_nats below their row's maximum are clamped (in log2 units).
CLAMP_LOG2 = -TUNING.clamp_nats * LOG2E
_TINY32 = float(np.finfo(np.float32).tiny)


class _ActiveSet:
    """The rows that are not frozen, and what the frozen ones add to the column sums.

    Active sets form a chain: a full step freezes the saturated rows (generation 0), and every
    new (lower) temperature freezes more of the remaining rows (:meth:`shrink`). Generation ``j``
    remembers the prices at its freeze and the lead of the rows it froze; it stays usable while
    the rows of generations ``0..j`` are all still saturated (:meth:`usable`).

    Attributes:
        scores: ``[B, m, k]`` the scores of the active rows (padded rows repeat another row).
        weight: ``[B, m, 1]`` 1 for a real active row, 0 for padding.
        frozen_col: ``[B, k]`` frozen tokens per expert (all generations so far).
        level: the schedule level of this generation's freeze.
        prices: ``[D, B, k]`` float64 numpy, the prices at the freezes of generations ``0..j``
            (``D = j + 1``), kept on the host: the checks in :meth:`usable` are a few tiny
            operations, cheaper there than as tensor operations.
        leads: ``[D, B]`` float64 numpy, a lower bound on the lead (in score units) of the rows
            each generation froze, at its prices.
        parent: generation ``j - 1`` (``None`` for generation 0).
    """

    def __init__(
        self,
        scores: Tensor,
        weight: Tensor,
        frozen_col: Tensor,
        level: int,
        prices: np.ndarray,
        leads: np.ndarray,
        parent: _ActiveSet | None,
        tuning: SolverTuning,
    ) -> None:
        self.scores, self.weight, self.frozen_col = scores, weight, frozen_col
        self.level, self.prices, self.leads, self.parent = level, prices, leads, parent
        self.tuning = tuning
        self._buffers: tuple[Tensor, Tensor] | None = None

    def buffers(self) -> tuple[Tensor, Tensor]:
        """Two scratch tensors of the shape of ``scores`` (logits and softmax of a step); every
        generation's are views of the same two slots (one generation steps at a time)."""
        if self._buffers is None:
            shape, S = self.scores.shape, self.scores
            self._buffers = (
                scratch("prices.active_logits", shape, S.dtype, S.device),
                scratch("prices.active_softmax", shape, S.dtype, S.device),
            )
        return self._buffers

    @classmethod
    def freeze(
        cls, S: Tensor, X: Tensor, u: np.ndarray, T: np.ndarray, level: int, work: Tensor, tuning: SolverTuning
    ) -> _ActiveSet | None:
        """Generation 0: freeze the saturated rows of a full step; ``None`` if more than
        ``tuning.max_active`` of the rows would stay active.

        Args:
            S: ``[B, n, k]`` scores.
            X: ``[B, n, k]`` the step's shifted log2 logits (see :func:`_logits`).
            u: ``[B, k]`` float64 numpy, the step's prices.
            T: ``[B]`` float64 numpy, its temperature.
            level: its schedule level.
            work: ``[B, n, k]`` scratch space.
            tuning: the solver's tuning.
        """
        B, n, k = S.shape
        zero = torch.zeros((B, k), dtype=S.dtype, device=S.device)
        gap = tuning.freeze_gap
        kept = _split_saturated(S, X, None, zero, int(tuning.max_active * n), work, 0, gap)
        if kept is None:
            return None
        scores, weight, frozen_col = kept
        return cls(scores, weight, frozen_col, level, u[None].copy(), gap * T[None], None, tuning)

    def shrink(self, X: Tensor, u: np.ndarray, T: np.ndarray, level: int, work: Tensor) -> _ActiveSet:
        """The next generation: freeze the active rows saturated at the (lower) temperature ``T``.

        Args:
            X: ``[B, m, k]`` the active rows' shifted log2 logits at prices ``u``, temperature ``T``.
            work: ``[B, m, k]`` scratch space.
        """
        depth = self.prices.shape[0]
        m = self.scores.shape[1]
        scores, weight, frozen_col = _split_saturated(
            self.scores, X, self.weight, self.frozen_col, m, work, depth, self.tuning.shrink_gap
        )
        prices = np.concatenate([self.prices, u[None]])
        leads = np.concatenate([self.leads, self.tuning.shrink_gap * T[None]])
        return _ActiveSet(scores, weight, frozen_col, level, prices, leads, self, self.tuning)

    def usable(self, u: np.ndarray, T: np.ndarray) -> _ActiveSet | None:
        """The deepest generation (this one or an ancestor) whose frozen rows are all still
        saturated at prices ``u`` and temperature ``T``; ``None`` if not even generation 0's are.

        A row frozen with lead ``L`` at prices ``p`` leads by at least ``L - 2 max|u - p|`` at
        ``u``; it counts as saturated while that is ``saturated_gap`` temperatures or more.
        """
        moved = np.abs(u[None] - self.prices).max(-1)  # [D, B]
        ok = (self.leads - 2.0 * moved >= self.tuning.saturated_gap * T[None]).all(-1)  # [D]
        good = int(np.cumprod(ok).sum())  # generations 0..good-1 are usable
        generation: _ActiveSet | None = self
        for _ in range(self.prices.shape[0] - good):
            generation = generation.parent
        return generation


def _split_saturated(
    S: Tensor,
    X: Tensor,
    weight: Tensor | None,
    frozen_col: Tensor,
    max_active: int,
    work: Tensor,
    slot: int,
    gap: float,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Split rows into saturated ones (counted into the column sums) and active ones (kept).

    A row is saturated when its maximum leads every other entry by more than ``gap``
    temperatures.

    Args:
        S: ``[B, m, k]`` scores of the rows.
        X: ``[B, m, k]`` their shifted log2 logits.
        weight: ``[B, m, 1]`` 1 for real rows, 0 for padding (``None``: all real).
        frozen_col: ``[B, k]`` column counts of rows frozen before.
        max_active: ``None`` is returned when more rows than this would stay active.
        work: ``[B, m, k]`` scratch space.
        slot: which scratch slot receives the kept scores.
        gap: the lead, in temperatures.

    Returns:
        ``(scores, weight, frozen_col)`` of the kept rows (padded to the largest count of the
        batch), or ``None``.
    """
    B, m, k = S.shape
    # sign(X + gap) is +1 for entries within gap temperatures of the row's
    # maximum (X <= 0 after the shift) and -1 below: a row sums to 2 - k exactly when its
    # maximum is alone there. (Comparison kernels producing bool tensors are slow on CPU.)
    sign = torch.add(X, gap * LOG2E, out=work).sign_()
    frozen = sign.sum(-1) < 2.5 - k  # [B, m]
    real = None if weight is None else weight.view(B, m) > 0.5
    if real is not None:
        frozen &= real
    active = ~frozen if real is None else real & ~frozen
    size = int(active.sum(-1).max())
    if size > max_active:
        return None
    # A frozen row's only +1 entry is its best expert: sum (sign + 1) / 2 over those rows.
    f = frozen.to(S.dtype).unsqueeze(1)  # [B, 1, m]
    frozen_col = frozen_col + 0.5 * ((f @ sign).squeeze(1) + f.sum(-1))
    out = scratch(f"prices.active{slot}", (B, size, k), S.dtype, S.device)
    return out, _pack_rows(S, active, out), frozen_col


def _pack_rows(X: Tensor, keep: Tensor, out: Tensor) -> Tensor:
    """The rows of ``X`` where ``keep``, in order, into ``out``; returns their weights.

    Args:
        X: ``[B, n, k]``.
        keep: ``[B, n]`` bool.
        out: ``[B, m, k]`` with ``m`` the largest number of kept rows of an instance; instances
            with fewer are padded with other rows of ``X``.

    Returns:
        ``[B, m, 1]``: 1 for a kept row, 0 for padding.
    """
    B, m, k = out.shape
    if B == 1:
        torch.index_select(X[0], 0, keep.view(-1).nonzero().view(-1), out=out[0])
        return torch.ones((1, m, 1), dtype=X.dtype, device=X.device)
    index = torch.argsort(keep.to(torch.int8), dim=-1, descending=True, stable=True)[:, :m]
    torch.gather(X, 1, index.unsqueeze(-1).expand(B, m, k), out=out)
    return keep.gather(1, index).unsqueeze(-1).to(X.dtype)


def default_schedule(n: int, tuning: SolverTuning = TUNING) -> tuple[float, ...]:
    """Temperatures (fractions of the score spread) for ``n`` tokens: ``0.3, 0.06, 0.012, ...``
    down to the first one below ``final_temperature_n / n``, without the first from ``large_n``
    tokens on (:class:`~._tuning.SolverTuning`)."""
    levels = [tuning.first_temperature]
    while levels[-1] >= tuning.final_temperature_n / max(n, 1):
        levels.append(levels[-1] / tuning.cooling)
    return tuple(levels[1:] if n >= tuning.large_n else levels)


def approximate_prices(
    S: Tensor,
    c: int,
    schedule: tuple[float, ...] | None = None,
    center: bool = True,
    max_steps: int | None = None,
    tuning: SolverTuning = TUNING,
) -> Tensor:
    """Damped Newton on the smoothed dual along a temperature schedule.

    Args:
        S: ``[B, n, k]`` finite scores.
        c: capacity per expert.
        schedule: temperatures as fractions of each instance's score spread (standard deviation);
            default :func:`default_schedule` of ``n``.
        center: start from the centred column means (removes additive expert biases at once).
        max_steps: total Newton steps allowed (default ``steps_per_level`` per level); a step
            clipped by the damping is repeated at the same temperature.
        tuning: the solver's tuning; ``active_set=False`` there makes every step a full one.

    Returns:
        ``[B, k]`` prices (``>= 0`` when there is slack capacity, ``c * k > n``).
    """
    B, n, k = S.shape
    if schedule is None:
        schedule = default_schedule(n, tuning)
    if max_steps is None:
        max_steps = tuning.steps_per_level * len(schedule)
    slack = c * k > n
    # The score spread sets the temperature scale; a few hundred tokens estimate it well.
    sample = S[:, :: max(1, n // 512)]
    spread = sample.std(dim=(-2, -1), correction=0).clamp(min=torch.finfo(S.dtype).eps).view(B, 1, 1)
    u = torch.zeros(B, 1, k, dtype=S.dtype, device=S.device)
    if center:
        u = S.mean(dim=1, keepdim=True)
        u = u - (u.amin(dim=-1, keepdim=True) if slack else u.mean(dim=-1, keepdim=True))
    # Buffers reused by the full steps: fresh large temporaries cost page faults on CPU.
    X = scratch(SCORES_A, S.shape, S.dtype, S.device)
    P_full = scratch(SCORES_B, S.shape, S.dtype, S.device)
    # The prices and temperatures live on the host in float64 (k numbers per instance); the
    # tensors the big operations need are made from them once per step.
    host = torch.cat([spread.view(B, 1), u.view(B, k)], dim=1).double().cpu().numpy()  # one copy
    spread_host, u_host = host[:, 0].copy(), host[:, 1:].copy()
    active: _ActiveSet | None = None
    level, steps, at_level = 0, 0, 0
    while level < len(schedule) and steps < max_steps:
        T_host = spread_host * schedule[level]
        scale = _logit_scale(T_host, S)
        u = to_device(torch.from_numpy(u_host), S.device, S.dtype).view(B, 1, k)
        steps += 1
        at_level += 1
        if active is not None:
            active = active.usable(u_host, T_host)
        if active is not None:
            X_active, P = active.buffers()
            P = _softmax(active.scores, u, scale, X_active, P)
            if B > 1:
                P.mul_(active.weight)  # padding rows
            grad = (c - active.frozen_col) - P.sum(dim=1)
            col, G = _gram(P, tuning.small_gram)
            if level > active.level and X_active.shape[1] > tuning.shrink_min:  # colder: fewer live rows
                active = active.shrink(X_active, u_host, T_host, level, P)
        else:
            P = _softmax(S, u, scale, X, P_full)  # also leaves the shifted log2 logits in X
            grad = c - P.sum(dim=1)  # [B, k]
            col, G = _gram(P, tuning.small_gram)
            if tuning.active_set and level > 0:  # P is no longer needed: its buffer is the scratch
                active = _ActiveSet.freeze(S, X, u_host, T_host, level, P_full, tuning)
        step, clipped = _damped_newton_step(col, G, grad, T_host, c, u_host if slack else None, tuning.step_limit)
        u_host = u_host - step
        if slack:
            np.maximum(u_host, 0.0, out=u_host)
        # A clipped step means the prices are still far from this temperature's optimum: stay at
        # this temperature for another step (within the step budget) instead of cooling.
        if at_level >= tuning.level_steps or not clipped:
            level, at_level = level + 1, 0
    # The prices only warm-start the exact phase: an instance whose steps went non-finite (no
    # input known to do this once the scores are normalised) starts from zero prices instead.
    bad = ~np.isfinite(u_host).all(-1)
    if bad.any():
        u_host[bad] = 0.0
    return to_device(torch.from_numpy(u_host), S.device, S.dtype)


def _logit_scale(T: np.ndarray, S: Tensor) -> float | Tensor:
    """``log2(e) / T``: a number for one instance (no tensor operation), else ``[B, 1, 1]``."""
    if T.shape[0] == 1:
        return float(LOG2E / T[0])
    return to_device(torch.from_numpy(LOG2E / T), S.device, S.dtype).view(-1, 1, 1)


def _damped_newton_step(
    col: Tensor, G: Tensor, grad: Tensor, T: np.ndarray, c: int, prices: np.ndarray | None, step_limit: float
) -> tuple[np.ndarray, bool]:
    """The damped Newton step ``[B, k]`` on the smoothed dual, and whether it was clipped.

    ``T H = diag(col) - G`` is singular (its rows sum to 0: a common shift of the prices changes
    nothing) and nearly 0 once the softmax saturates, so a ridge ``rho = mean(diag(T H)) +
    1e-3 c`` is added. Without slack the ridge acts on the common shift only (``rho / k`` times
    the all-ones matrix) plus ``1e-6 rho``; with slack (projected Newton) the experts at price 0
    that are under-full (positive gradient) keep price 0. The ``k x k`` system is solved in
    float64 by Cholesky (LAPACK ``dposv``); should it not be numerically positive definite, the
    diagonal step is taken instead. Damping: a step beyond ``step_limit`` temperatures leaves the
    region where the quadratic model is accurate, so longer steps are scaled down to that length
    (*clipped*).

    The ``k x k`` work runs on the host in numpy (a few microseconds per operation instead of the
    tens that PyTorch's dispatch costs for tensors this small); the prices live there anyway.

    Args:
        col: ``[B, k]`` column sums of the rows in ``G``.
        G: ``[B, k, k]`` their Gram matrix ``P^T P``.
        grad: ``[B, k]`` the dual gradient ``c - (all column sums)``.
        T: ``[B]`` float64 temperatures.
        c: capacity.
        prices: ``[B, k]`` float64 current prices when there is slack capacity (projected
            Newton), else ``None``.
        step_limit: the longest step, in temperatures.

    Returns:
        ``(step, clipped)``: the ``[B, k]`` float64 step; ``clipped`` is True when any
        instance's step was shortened.
    """
    B, k = col.shape
    # One copy to the host for all three (on a GPU, one synchronisation per step).
    packed = torch.cat([col, grad, G.reshape(B, k * k)], dim=1).cpu().numpy().astype(np.float64)
    col64, grad64 = packed[:, :k], packed[:, k:2 * k]
    rhs = grad64 * T[:, None]
    A = np.ascontiguousarray(packed[:, 2 * k:]).reshape(B, k, k)  # becomes the system matrix, in place
    diag = A.reshape(B, k * k)[:, :: k + 1]  # a view of the diagonals
    rho = (col64.sum(-1) - diag.sum(-1)) / k + 1e-3 * c  # [B]
    if prices is None:
        np.negative(A, out=A)
        A += (rho / k)[:, None, None]
        diag += col64 + 1e-6 * rho[:, None]
    else:
        keep = (~((prices <= 0) & (grad64 > 0))).astype(np.float64)
        rhs *= keep
        A *= -(keep[:, :, None] * keep[:, None, :])
        diag += col64 * keep + (1.0 + 1e-6 - keep) * rho[:, None]
    from scipy.linalg.lapack import dposv  # (imported here: scipy.linalg adds ~0.4 s to `import routelab`)

    step = np.empty((B, k))
    for b in range(B):
        # A is symmetric: its transpose is the Fortran-ordered matrix LAPACK wants, without a copy.
        _, x, info = dposv(A[b].T, rhs[b])
        if info != 0 or not np.isfinite(x).all():
            x = rhs[b] / np.maximum(diag[b], _TINY32)
        step[b] = x
    factor = np.minimum(step_limit * T / np.maximum(np.abs(step).max(-1), 1e-30), 1.0)
    step *= factor[:, None]
    return step, bool((factor < 1.0).any())


def _logits(S: Tensor, u: Tensor, scale: float | Tensor, out: Tensor) -> Tensor:
    """``(S - u) * scale`` (``scale = log2(e) / T``: log2 units), shifted so that every row's
    maximum is 0, into ``out``."""
    torch.sub(S, u, out=out).mul_(scale)
    return out.sub_(out.amax(dim=-1, keepdim=True))


def _softmax(S: Tensor, u: Tensor, scale: float | Tensor, X: Tensor, out: Tensor) -> Tensor:
    """``softmax((S - u) / T)`` over the experts into ``out``, computed with ``exp2`` (3x faster
    than ``exp`` on CPU); tiny entries are clamped (see ``CLAMP_LOG2``). ``X`` receives the
    shifted log2 logits of :func:`_logits`."""
    _logits(S, u, scale, X)
    P = torch.clamp(X, min=CLAMP_LOG2, out=out).exp2_()
    return P.div_(P.sum(dim=-1, keepdim=True))


def _gram(P: Tensor, small_gram: int) -> tuple[Tensor, Tensor]:
    """Column sums ``[B, k]`` and Gram matrix ``P^T P`` ``[B, k, k]`` of the rows of ``P`` that
    matter for the Hessian ``diag(col) - P^T P``.

    A row whose softmax has saturated (one entry within ``1e-6`` of 1) contributes almost
    nothing to that difference; at low temperatures most rows have, so only the others enter.

    Args:
        P: ``[B, n, k]`` row-stochastic matrix.
        small_gram: up to this many rows, saturated rows are masked rather than selected.
    """
    B, n, k = P.shape
    if n <= small_gram:  # mask the saturated rows: fewer (tiny) operations than selecting them
        Q = P * (P.amax(dim=-1, keepdim=True) < 1.0 - 1e-6)
        return Q.sum(dim=1), Q.transpose(1, 2) @ Q
    live = P.amax(dim=-1) < 1.0 - 1e-6  # [B, n]
    m = int(live.sum(-1).max())
    if m > n // 2:
        return P.sum(dim=1), P.transpose(1, 2) @ P
    Q = scratch("prices.gram", (B, m, k), P.dtype, P.device)
    weight = _pack_rows(P, live, Q)
    if B > 1:
        Q.mul_(weight)  # instances with fewer live rows: padding contributes nothing
    return Q.sum(dim=1), Q.transpose(1, 2) @ Q
