"""Log-space Sinkhorn balancing of an n x k probability matrix (Kool et al. 2021, Sec. 2.3)."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import Tensor

from .._checks import check_positive_int, check_score_matrix, device_scalar
from . import _compiled, _newton
from ._feasibility import hall_violator
from ._newton import newton_balance
from ._ops import SMALL_K, logsumexp
from ._two_experts import closed_form, two_expert_sinkhorn
from ._workspace import scratch

__all__ = ["balance", "sinkhorn"]


def sinkhorn(
    log_p: Tensor,
    *,
    col_sum: float | Tensor | None = None,
    tol: float = 1e-6,
    max_iter: int = 1000,
) -> Tensor:
    """Balance ``p = exp(log_p)`` so rows sum to 1 and columns to ``col_sum``, in log space.

    Finds ``log q[i, j] = log_p[i, j] - f_i - g_j`` (alternately normalising rows and columns),
    the matrix closest to ``p`` in KL divergence with the given marginals. The row sums of the
    result are exactly 1 (the last step normalises rows); the iteration stops when every column
    sum is within ``tol`` of its target.

    Args:
        log_p: ``[..., n, k]`` log-probabilities (any per-row scale is fine: only ratios within a
            row and column matter). ``-inf`` entries (impossible pairs) stay ``-inf``. float16
            and bfloat16 input is balanced (and its convergence judged) in float32, and returned in
            its own dtype. An empty batch (a leading
            dimension of size 0) gives an empty result of the same shape.
        col_sum: target column sums, a number or a ``[..., k]`` tensor (broadcast over the batch);
            default ``n / k``. They must be non-negative and add up to ``n`` (within ``1e-6 * n``). A column with target
            0 is ``-inf`` in the result (no token uses it), with gradient 0 to its entries of
            ``log_p`` and to that target itself (the derivative there is one-sided: a target of 0
            is a constant); the other columns are balanced exactly as if it had been removed.
        tol: largest absolute error of any column sum at convergence. It is floored at
            ``4 * eps(dtype) * sqrt(n) * max(1, col_sum)``, the resolution of a sum of ``n``
            terms (about ``2e-3``, i.e. ``3e-5`` relative, for float32 at ``n = 4096, k = 64``),
            with ``eps`` of the computation dtype (float32 for half-precision input).
        max_iter: maximum number of row+column normalisation sweeps.

    Returns:
        ``[..., n, k]`` log of the balanced matrix ``q`` (``q.exp().sum(-1) == 1``,
        ``q.exp().sum(-2) == col_sum`` within ``tol`` in the computation's dtype; a float16 or
        bfloat16 result adds its own rounding, up to ``n`` times its ``eps`` relative to a column sum).
        Targets within the ``1e-6 * n`` slack of adding up to ``n`` are scaled to add up to it.

    Raises:
        ValueError: NaN/+inf input, marginals that cannot be met (negative targets, targets that
            do not add up to ``n``, a row that is all ``-inf`` or finite only in columns with target
            0, a column that is all ``-inf`` with a positive target), or no convergence within
            ``max_iter`` (the message gives the error; with ``-inf`` entries a maximum flow then
            decides whether their pattern admits the marginals at all, and names the tokens whose
            allowed experts cannot take them when it does not).
    """
    check_score_matrix(log_p, "log_p", values=False)
    n, k = log_p.shape[-2], log_p.shape[-1]
    check_positive_int("max_iter", max_iter)
    if isinstance(tol, Tensor) and tol.numel() == 1 and tol.is_floating_point():
        tol = float(tol)  # a 0-d tensor holding the number
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real):
        raise ValueError(f"tol must be a number > 0 (a Python float), got {type(tol).__name__} {tol!r}")
    if not tol > 0:
        raise ValueError(f"tol must be positive (a number > 0), got {tol!r}")
    # (speed machinery: the commonest call's first round of sweeps, without the general path's
    # tensor operations; its result when that round converged, else the general path's start)
    first_round = _small_cpu_first_round(log_p, tol, max_iter) if col_sum is None else None
    if first_round is not None and first_round[2]:
        return first_round[0]
    out_dtype = log_p.dtype
    if out_dtype not in (torch.float32, torch.float64):  # half precision: balance in float32
        log_p = log_p.float()
    # The values in one pass and one synchronisation: NaN/+inf (an error) and -inf (the checks below).
    try:
        lo, hi = torch.stack(torch.aminmax(log_p.detach())).tolist() if log_p.numel() else (0.0, 0.0)
    except RuntimeError as err:
        if "storage" not in str(err):
            raise
        raise NotImplementedError(
            "sinkhorn does not run under torch.func.vmap: its stopping rule reads the column errors on the host, "
            "which a vmapped tensor cannot give; pass the instances as a leading batch dimension of log_p "
            "[..., n, k] instead (one call balances them all)") from None
    if not hi < float("inf"):
        check_score_matrix(log_p, "log_p")  # raises, naming the problem
    target = _target_columns(col_sum, log_p, n, k)
    top = n / k if col_sum is None else None

    if lo > float("-inf"):
        # Every entry finite (the usual case): no row or column can be dead or stranded (the
        # targets add up to n > 0), so the checks below have nothing to find.
        return _balanced_or_raise(log_p, target, tol, max_iter, out_dtype, top, spread=hi - lo,
                                  first_round=first_round[:2] if first_round is not None else None)
    finite = torch.isfinite(log_p)
    dead_row = ~finite.any(-1)
    dead_col = (~finite.any(-2)) & (target > 0)
    # A row whose finite entries all sit in columns with target 0 cannot sum to 1 either.
    stranded = ~(finite & (target > 0).unsqueeze(-2)).any(-1) & ~dead_row
    bad_row, bad_col, bad_stranded = torch.stack([dead_row.any(), dead_col.any(), stranded.any()]).tolist()
    if bad_row:
        raise ValueError(
            f"log_p has a row that is all -inf ({_first_row(dead_row)}): that token has no expert, so rows "
            f"cannot sum to 1; give every token at least one finite entry"
        )
    if bad_col:
        where = tuple(dead_col.nonzero()[0].tolist())
        instance = f" of batch entry {where[:-1]}" if len(where) > 1 else ""
        raise ValueError(
            f"log_p's column {where[-1]}{instance} is all -inf but its col_sum is positive: no token may use that "
            f"expert, so its target cannot be met; give it col_sum 0 (and the other columns its share) or a finite "
            f"entry")
    if bad_stranded:
        raise ValueError(
            f"log_p {_first_row(stranded)} has finite entries only in columns whose col_sum is 0: that token "
            f"has no expert it may use, so rows cannot sum to 1; give it a finite entry in a column with "
            f"col_sum > 0"
        )

    return _balanced_or_raise(log_p, target, tol, max_iter, out_dtype, top, spread=None)


def _balanced_or_raise(
    log_p: Tensor, target: Tensor, tol: float, max_iter: int, out_dtype: torch.dtype, top: float | None = None,
    *, spread: float | None = None, first_round: tuple[Tensor, float] | None = None,
) -> Tensor:
    """:func:`balance` at the floored tolerance; the result in ``out_dtype``, or ValueError.
    ``top``: the largest target when the caller knows it (else read from ``target``). ``spread``:
    ``max - min`` of an all-finite ``log_p`` (``None``: it has ``-inf`` entries), for the message.
    ``first_round``: ``balance``'s result for the first round of sweeps when the caller has it
    (:func:`_small_cpu_first_round`), which then is not computed again."""
    n = log_p.shape[-2]
    # Below a few rounding errors of a sum of n terms of size up to max(1, target) the output
    # dtype cannot resolve column errors, so the tolerance is floored there.
    if top is None:
        top = float(target.detach().max()) if target.numel() else 0.0
    # (in the dtype of the computation: half precision is balanced, and judged, in float32)
    eff_tol = _floored_tol(tol, log_p.dtype, n, top)
    differentiable = torch.is_grad_enabled() and (log_p.requires_grad or target.requires_grad)
    k = log_p.shape[-1]
    newton = not differentiable and _newton_rounds(k, max_iter) and log_p.numel() > 0 and target.numel() > 0
    if newton:
        # where the sweeps are cheap (the scaling domain: every entry within 80 nats of its row's
        # maximum, which the spread bounds), they have more room first
        limit = COMPILED_SCALING_RANGE.get(log_p.dtype, 80.0)
        cheap = spread is not None and spread <= limit
        if not cheap:  # each row's range over its finite entries (-inf entries are the scaling domain's zeros)
            top = log_p.amax(-1, keepdim=True)
            low = torch.where(torch.isneginf(log_p), top, log_p).amin(-1, keepdim=True)
            cheap = float((top - low).amax()) <= limit
        x, err = _sweeps_then_newton(log_p, target, eff_tol, max_iter, first=CHEAP_FIRST if cheap else None,
                                     room=NEWTON_SWEEPS if cheap else NEWTON_SWEEPS // 8, first_round=first_round)
    else:
        x, err = first_round or balance(log_p, target, tol=eff_tol, max_iter=max_iter)
    if err <= eff_tol:
        return x if x.dtype == out_dtype else x.to(out_dtype)
    if spread is None:
        infeasible = _infeasible_instance(log_p, target)
        if infeasible is not None:
            why = f"The -inf pattern makes the marginals infeasible (a maximum flow shows it): {infeasible}"
        else:
            why = ("The -inf pattern admits the marginals (a maximum flow finds a matrix that meets them), but the "
                   "sweeps converge slowly on it: raise max_iter or tol")
    else:
        # All entries finite: the marginals are feasible and the sweeps converge, but slowly when
        # p is sharp (each sweep moves mass between columns in proportion to the small entries).
        why = (f"Every entry is finite, so the marginals are feasible, but log_p spreads over {spread:.3g}: "
               f"the sharper p is, the slower the sweeps converge. Raise max_iter or tol, or balance "
               f"log_p / T for a temperature T > 1")
    raise ValueError(
        f"sinkhorn did not converge in max_iter={max_iter} sweeps: column sums are off by up to {err:.3g} "
        f"(tol={eff_tol:g}). {why}"
    )


#: Batch instances :func:`_infeasible_instance` examines (a maximum flow each) before it gives up.
FEASIBILITY_CHECKS = 16


#: Largest ``log_p.numel()`` the fast path of :func:`_small_cpu_first_round` takes (its scan of the
#: values is not vectorised; above this size the fixed overhead no longer matters).
FAST_PATH_NUMEL = 1 << 18


def _small_cpu_first_round(log_p: Tensor, tol: float, max_iter: int) -> tuple[Tensor, float, bool] | None:
    """Speed machinery only: the first round of :func:`sinkhorn`'s sweeps for its commonest call.

    The common call (default ``col_sum``, a small contiguous float32/float64 CPU ``log_p`` with every
    entry finite, no autograd, more than 2 columns) spends most of its time on dozens of small
    tensor operations around the compiled sweeps. This runs the same steps on host arrays: the value
    scan and the row shift in one compiled pass (:func:`._compiled.shift_rows_checked`),
    ``K = exp(x)`` by PyTorch, and the same compiled sweeps (:func:`._compiled.scaling_sinkhorn_host`)
    with the same targets, tolerance and sweep count as :func:`_balanced_or_raise` ->
    :func:`_sweeps_then_newton` -> :func:`_balance_scaling`, so the result is the same bit for bit.

    Returns:
        ``(x, err, converged)``: ``balance``'s result for that round and whether it is
        :func:`sinkhorn`'s answer (``err`` within the floored ``tol``); when not, the general path
        goes on from it (``first_round`` of :func:`_balanced_or_raise`). ``None`` for any other
        call (``-inf``/NaN/+inf entries, a spread beyond the scaling domain, a scaling leaving the
        range): the general path then runs from the start (its checks raise, or it balances).
    """
    n, k = log_p.shape[-2], log_p.shape[-1]
    dtype = log_p.dtype
    if not (k > 2 and dtype in (torch.float32, torch.float64) and 0 < log_p.numel() <= FAST_PATH_NUMEL
            and log_p.is_cpu and log_p.is_contiguous()
            and not (log_p.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling() and _compiled.available(log_p)):
        return None
    lp = log_p.detach().numpy().reshape(-1, n, k)
    # x = log_p - rowmax and K = exp(x), in one scratch slot (one look-up)
    work = scratch("sinkhorn.fast", (2, *lp.shape), dtype, log_p.device)
    x, K = work.unbind(0)
    x_host, K_host = work.numpy()
    scanned = _compiled.shift_rows_checked(lp, x_host)
    if scanned is None:  # NaN/+inf (an error) or -inf entries: the general path's checks
        return None
    lo, hi, low = scanned
    limit = COMPILED_SCALING_RANGE[dtype]
    # _balanced_or_raise's choices for these targets (n / k each: the largest is n / k)
    eff_tol = _floored_tol(tol, dtype, n, n / k)
    newton = _newton_rounds(k, max_iter)
    if newton and not hi - lo <= limit:  # not "cheap" there: a shorter first round, after a per-row check
        return None
    if not low >= -limit:  # outside the scaling domain: _balance_scaling hands over to the log domain
        return None
    sweeps = _first_round_sweeps(CHEAP_FIRST, max_iter) if newton else max_iter
    torch.exp(x, out=K)  # PyTorch's exp, as _balance_scaling's (bit for bit)
    # the targets as _target_columns makes them (n / k in log_p's dtype), widened to float64 as
    # scaling_sinkhorn does
    t = np.full((lp.shape[0], k), np.array(n / k, dtype=lp.dtype), dtype=np.float64)
    out = torch.empty(log_p.shape, dtype=dtype, device="cpu")  # numba writes it through numpy
    err = _compiled.scaling_sinkhorn_host(K_host, t, eff_tol, sweeps, x_host, out.numpy().reshape(lp.shape))
    return None if err is None else (out, err, err <= eff_tol)


def _infeasible_instance(log_p: Tensor, target: Tensor) -> str | None:
    """Why the ``-inf`` pattern of ``log_p [..., n, k]`` admits no matrix with row sums 1 and column
    sums ``target`` (a Hall violator of the first infeasible instance, in words), or None when the
    first :data:`FEASIBILITY_CHECKS` instances are feasible. Only the error path calls it."""
    n, k = log_p.shape[-2:]
    finite = torch.isfinite(log_p.detach()).reshape(-1, n, k).cpu().numpy()
    targets = target.detach().expand(*log_p.shape[:-2], k).reshape(-1, k).double().cpu().numpy()
    for b in range(min(finite.shape[0], FEASIBILITY_CHECKS)):
        found = hall_violator(finite[b], targets[b])
        if found is None:
            continue
        rows, cols, room = found
        where = f"batch instance {b}: " if finite.shape[0] > 1 else ""
        shown = ", ".join(str(int(r)) for r in rows[:8]) + (", ..." if rows.size > 8 else "")
        return (f"{where}rows [{shown}] ({rows.size} tokens) have finite entries only in columns "
                f"{[int(c) for c in cols[:16]]}{' ...' if cols.size > 16 else ''}, whose col_sum adds up to "
                f"{room:g} < {rows.size}; allow those tokens more experts (finite entries) or change col_sum")
    return None


def _floored_tol(tol: float, dtype: torch.dtype, n: int, top: float) -> float:
    """``tol`` floored at ``4 eps(dtype) sqrt(n) max(1, top)`` (``top``: the largest target): below a
    few rounding errors of a sum of ``n`` terms of size up to ``max(1, top)`` the computation's
    dtype cannot resolve column errors."""
    return max(tol, 4 * torch.finfo(dtype).eps * n**0.5 * max(1.0, top))


def _newton_rounds(k: int, max_iter: int) -> bool:
    """Whether a balancing without autograd of ``k`` columns runs in rounds finished by Newton's
    method (:func:`_sweeps_then_newton`). (Two experts: their closed form restarts its own search at
    each call, so no rounds there.)"""
    return 2 < k <= NEWTON_MAX_K and max_iter > 2 * NEWTON_AFTER


def _sweeps_then_newton(log_p: Tensor, target: Tensor, tol: float, max_iter: int,
                        first: int | None = None, room: int = 200,
                        first_round: tuple[Tensor, float] | None = None) -> tuple[Tensor, float]:
    """:func:`balance` within ``max_iter`` sweeps, finished by Newton's method where the sweeps crawl.

    ``first`` sweeps (default :data:`NEWTON_AFTER`), then :data:`NEWTON_AFTER` more that measure the
    sweeps' rate of convergence; where it predicts at most ``room`` further sweeps (default
    :data:`NEWTON_SWEEPS`; fewer where the sweeps run in the log domain, 8x dearer), twice that
    many run first. Then Newton's steps on the column dual finish from their iterate
    (the same fixed point; at most as many steps as sweeps are left), and where Newton fails, the
    sweeps go on from that iterate (a continuation: the sweeps from a row and column scaling of
    ``log_p`` are its sweeps) for the rest of ``max_iter``. ``first_round``: the first ``first``
    sweeps' ``balance`` result, when the caller has computed it.
    """
    first = _first_round_sweeps(first, max_iter)
    x, err_first = first_round or balance(log_p, target, tol=tol, max_iter=first)
    if err_first <= tol:
        return x, err_first
    x, err = balance(x, target, tol=tol, max_iter=NEWTON_AFTER)
    left = max_iter - first - NEWTON_AFTER
    if err <= tol:
        return x, err
    rate = (err / err_first) ** (1 / NEWTON_AFTER) if 0 < err < err_first else 1.0
    needed = math.log(tol / err) / math.log(rate) if rate < 1 else math.inf
    if needed <= min(left, room):  # the sweeps should get there soon: twice that, then Newton
        budget = min(left, 2 * math.ceil(needed) + NEWTON_AFTER)
        x, err = balance(x, target, tol=tol, max_iter=budget)
        left -= budget
        if err <= tol:
            return x, err
    polished = newton_balance(x, target, tol=tol, max_steps=left) if left > 0 else None
    if polished is not None:
        return polished
    return balance(x, target, tol=tol, max_iter=left) if left > 0 else (x, err)


def _first_round_sweeps(first: int | None, max_iter: int) -> int:
    """The sweeps of :func:`_sweeps_then_newton`'s first round (``first``: ``None`` for the default)."""
    return min(first or NEWTON_AFTER, max_iter - NEWTON_AFTER)


def _first_row(mask: Tensor) -> str:
    """``"row i"`` or ``"row i of batch entry (b, ...)"`` for the first True of a ``[..., n]`` mask."""
    where = tuple(mask.nonzero()[0].tolist())
    return f"row {where[-1]}" + (f" of batch entry {where[:-1]}" if len(where) > 1 else "")


def balance(log_p: Tensor, target: Tensor, *, tol: float, max_iter: int) -> tuple[Tensor, float]:
    """The Sinkhorn iteration itself, without validation: at most ``max_iter`` sweeps.

    Args:
        log_p: ``[..., n, k]`` log-probabilities (finite rows).
        target: ``[..., k]`` column targets.
        tol: stop once every column sum is within ``tol`` of its target.
        max_iter: most sweeps.

    Returns:
        ``(log_q, err)``: the iterate (rows sum to 1 exactly, whether or not it converged) and its
        largest column error.
    """
    k = log_p.shape[-1]
    if log_p.numel() == 0:  # an empty batch: nothing to balance
        return log_p.clone(), 0.0
    if k == 2 and closed_form(k):
        fast = two_expert_sinkhorn(log_p, target, tol=tol, max_iter=max_iter)
        if fast is not None:
            return fast
    if k > 2 and not (torch.is_grad_enabled() and (log_p.requires_grad or target.requires_grad)):
        fast = _balance_scaling(log_p, target, tol=tol, max_iter=max_iter)
        if fast is not None:
            return fast
    # Dead columns: a target of 0 (the column is -inf in the result) or no finite entry. They are
    # set to -inf once, up front, and never reduced over again: a logsumexp over an all -inf
    # slice has a NaN gradient (exp(-inf - -inf)), and log(0) an infinite one. The other columns
    # are then balanced exactly as if the dead ones had been removed.
    dead = (target <= 0) | ~torch.isfinite(log_p).any(-2)           # [..., k]
    any_dead = bool(dead.any())  # one sync; without dead columns the sweeps below stay as lean as ever
    dead_entries = dead.unsqueeze(-2)                                 # [..., 1, k]
    if any_dead:
        log_p = log_p.masked_fill(dead_entries, float("-inf"))
    log_target = torch.where(dead, torch.ones_like(target), target).log()  # log(1) = 0 on dead columns
    # Columns are normalised over the tokens, rows over the experts. With few experts the
    # iteration runs on the [..., k, n] transpose so both reductions stay fast (see _ops).
    transpose = k <= SMALL_K
    # Shift every row by its maximum first: the normalised rows are then accurate relative to the
    # row's spread, not to its magnitude (a row of logits near 211 in float32 would otherwise
    # sum to 1 only within 211 eps). A row scaling changes no Sinkhorn result.
    top = log_p.amax(-1, keepdim=True)
    x = log_p - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    x = x - logsumexp(x).unsqueeze(-1)
    if transpose:
        x = x.transpose(-1, -2).contiguous()  # [..., k, n]
        dead_entries = dead_entries.transpose(-1, -2)                 # [..., k, 1]
    cols, rows = (-1, -2) if transpose else (-2, -1)
    log_t = log_target.unsqueeze(cols)
    dead_col = dead.unsqueeze(cols)
    got_zero = torch.zeros((), dtype=target.dtype, device=target.device)
    stop = _FirstConverged(tol, max_iter, x.device)
    err = float("inf")  # (max_iter < 0: no sweep, the iterate as it is)
    for sweep in range(max_iter + 1):
        # The logsumexp of a dead column reads zeros instead of its -inf entries (finite value,
        # finite gradient); its result is never used.
        col = torch.logsumexp(x.masked_fill(dead_entries, 0.0) if any_dead else x, dim=cols, keepdim=True)
        # The error of the current iterate (rows already sum to 1): stop before changing it.
        got = col.detach().exp().squeeze(cols).to(target.dtype)
        if any_dead:
            got = torch.where(dead, got_zero, got)
        found = stop.check(sweep, (got - target.detach()).abs().amax(), x)
        if found is not None:
            x, err = found
            break
        step = log_t - col
        x = x + (torch.where(dead_col, torch.zeros_like(col), step) if any_dead else step)
        row = logsumexp(x.transpose(-1, -2)) if transpose else logsumexp(x)
        x = x - row.unsqueeze(rows)
    return (x.transpose(-1, -2) if transpose else x), err


#: Sweeps after which (twice: the rate of convergence is measured over the second round) a balancing
#: without autograd that has not converged goes on by Newton's method
#: (:func:`~routelab.assignment._newton.newton_balance`), the sweeps being slow on sharp matrices...
NEWTON_AFTER = 16
#: The first round of sweeps before that where the sweeps are cheap (see :func:`_balanced_or_raise`).
CHEAP_FIRST = 16 * NEWTON_AFTER
#: ... where the sweeps' rate of convergence predicts more than this many further sweeps (Newton's
#: few steps cost about as much as a few hundred sweeps: at 512 x 16 on this project's CPU, the
#: compiled sweeps converge in 0.3 ms at logit scale 10, and Newton's finish takes 1-2 ms).
NEWTON_SWEEPS = 200
#: Newton's method runs for at most this many columns (:data:`routelab.assignment._newton.MAX_K`).
NEWTON_MAX_K = _newton.MAX_K


#: Sweeps between two reads of the convergence errors on the host, per device type (others: the
#: default). Each read is a synchronisation on a GPU; on the CPU it costs nothing, and reading
#: every sweep computes no sweep past the answer. The answer is the same either way.
CHECK_EVERY = {"cpu": 1}
CHECK_EVERY_DEFAULT = 4


class _FirstConverged:
    """The first sweep whose error is within ``tol`` (or the last, ``max_iter``), with the errors
    read on the host every :data:`CHECK_EVERY` sweeps: the iterates of the sweeps in between are
    kept until their errors are read, and the first one that converged is the answer, so the
    result is the one a read per sweep gives (the later sweeps are computed and dropped)."""

    def __init__(self, tol: float, max_iter: int, device: torch.device, *, stop_on_nan: bool = False) -> None:
        self.tol, self.max_iter, self.stop_on_nan = tol, max_iter, stop_on_nan
        self.every = CHECK_EVERY.get(device.type, CHECK_EVERY_DEFAULT)
        self.pending: list[tuple[Tensor, object]] = []

    def check(self, sweep: int, err: Tensor, state: object) -> tuple[object, float] | None:
        """Record sweep ``sweep``'s ``err`` (a 0-d tensor) and ``state``; every few sweeps, and at
        ``max_iter``, read the errors and return ``(state, err)`` of the first sweep within ``tol``
        (or of sweep ``max_iter``; with ``stop_on_nan``, or with a NaN error), else None. A NaN
        error never converges."""
        self.pending.append((err, state))
        if len(self.pending) < self.every and sweep < self.max_iter:
            return None
        errors = torch.stack([e for e, _ in self.pending]).tolist()  # one host read
        first = sweep - len(self.pending) + 1
        for i, value in enumerate(errors):
            if value <= self.tol or first + i == self.max_iter or (self.stop_on_nan and value != value):
                return self.pending[i][1], value
        self.pending.clear()
        return None


#: The scaling domain is used when every finite entry lies within this many nats of its row's
#: maximum (per dtype): ``exp`` of the shifted entries then stays a normal number with room to
#: spare for the column scalings (float32: ``e^-30 ~ 1e-13``, its normal range ends at ``1e-38``).
SCALING_RANGE = {torch.float32: 30.0, torch.float64: 300.0}
#: The same for the compiled sweeps, which keep the scalings and sums in float64: only ``K`` itself
#: must stay normal (float32: ``e^-80 ~ 2e-35``).
COMPILED_SCALING_RANGE = {torch.float32: 80.0, torch.float64: 600.0}


def _balance_scaling(log_p: Tensor, target: Tensor, *, tol: float, max_iter: int) -> tuple[Tensor, float] | None:
    """The same iteration as :func:`balance` in the scaling domain (``q = diag(a) K diag(b)``).

    With ``K = exp(log_p - rowmax)`` every sweep is two matrix-vector products (``K^T a`` for the
    column sums, ``K b`` for the row normalisation) instead of two ``logsumexp`` passes over
    ``n x k`` entries: the iterates are the log-domain ones up to rounding, so it stops after the
    same sweeps. ``-inf`` entries are exact zeros of ``K`` (and ``-inf`` in the result).

    Used without autograd only, and ``None`` is returned (the log domain takes over, the
    stabilised path) when a finite entry lies more than :data:`SCALING_RANGE` (compiled:
    :data:`COMPILED_SCALING_RANGE`) nats below its
    row's maximum (low temperatures), when a column has target 0 or no finite entry, or when the
    scalings leave the floating range during the sweeps.

    Returns:
        ``(log_q, err)`` as :func:`balance`, or ``None``.
    """
    if max_iter < 0:  # no sweep: the compiled kernel would leave its row scalings unset; the log domain's iterate
        return None
    compiled = _compiled.available(log_p) and log_p.is_contiguous()
    positive = float(target.detach().amin()) > 0
    if compiled:
        # (On CPU the two n x k temporaries live in memory kept between calls: fresh pages of a
        # few MiB cost more in page faults than the sweeps themselves, see _workspace.)
        x = scratch("sinkhorn.x", log_p.shape, log_p.dtype, log_p.device)
        low = _compiled.shift_rows(log_p.view(-1, *log_p.shape[-2:]), x.view(-1, *x.shape[-2:]))
    else:
        x = log_p - log_p.amax(-1, keepdim=True)  # rows are finite (validated): their maxima too
        low = float(x.amin())
        if low == float("-inf"):  # -inf entries: the range of the finite ones
            low = float(torch.where(torch.isneginf(x), torch.zeros((), dtype=x.dtype, device=x.device), x).amin())
    limit = (COMPILED_SCALING_RANGE if compiled else SCALING_RANGE).get(x.dtype, 30.0)
    if not low >= -limit or not positive:
        return None
    if compiled:  # the same sweeps, compiled: one fused pass over K per sweep
        K = torch.exp(x, out=scratch("sinkhorn.K", x.shape, x.dtype, x.device))  # 0 at the -inf entries
        flat = K.reshape(-1, K.shape[-2], K.shape[-1])
        targets = target.expand(K.shape[:-2] + target.shape[-1:]).reshape(-1, K.shape[-1])
        out = torch.empty_like(x)
        err = _compiled.scaling_sinkhorn(flat, targets, tol, max_iter, x.view(flat.shape), out.view(flat.shape))
        return None if err is None else (out, err)
    K = x.exp()  # [..., n, k], 0 at the -inf entries
    Kt = K.transpose(-1, -2)
    t = target.expand(K.shape[:-2] + target.shape[-1:]).unsqueeze(-1).to(K.dtype)  # [..., k, 1]
    a = 1.0 / K.sum(-1, keepdim=True)  # [..., n, 1]: rows sum to 1
    b = torch.ones_like(t)  # [..., k, 1]
    stop = _FirstConverged(tol, max_iter, K.device, stop_on_nan=True)
    err = float("inf")
    for sweep in range(max_iter + 1):
        col = b * (Kt @ a)  # [..., k, 1] column sums of diag(a) K diag(b)
        # (a NaN error: a scaling left the range; the sweeps stop there)
        found = stop.check(sweep, (col - t).abs().amax(), (a, b))
        if found is not None:
            (a, b), err = found
            break
        b = b * (t / col)
        a = 1.0 / (K @ b)
    # Where a scaling left the range, the log domain takes over (one read for both scalings).
    if not (err == err and bool(torch.stack([torch.isfinite(a).all(), torch.isfinite(b).all()]).all())):
        return None
    return x + a.log() + b.log().transpose(-1, -2), err


def _target_columns(col_sum: float | Tensor | None, log_p: Tensor, n: int, k: int) -> Tensor:
    """Column targets as a ``[..., k]`` tensor (broadcastable to the batch), validated."""
    if col_sum is None:  # valid by construction
        return torch.full((k,), n / k, dtype=log_p.dtype, device=log_p.device)
    else:
        bad = f"col_sum must be a number or a [..., k] tensor, got {type(col_sum).__name__}"
        if isinstance(col_sum, (bool, str, bytes)):
            raise ValueError(bad)
        try:  # (a number is filled in on the device: as_tensor would copy it from the host, a sync on CUDA)
            target = device_scalar(col_sum, log_p) if isinstance(col_sum, numbers.Real) else \
                torch.as_tensor(col_sum, dtype=log_p.dtype, device=log_p.device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(bad) from None
        if target.ndim == 0:
            target = target.expand(k)
        if target.shape[-1] != k:
            raise ValueError(f"col_sum must be a number or have last dimension k={k}, got shape {tuple(target.shape)}")
        batch = log_p.shape[:-2]
        try:
            fits = torch.broadcast_shapes(target.shape[:-1], batch) == batch
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"col_sum's batch dimensions {tuple(target.shape[:-1])} do not broadcast to the batch "
                             f"{tuple(batch)} of log_p {tuple(log_p.shape)}; give col_sum [k] or [*batch, k]")
    if bool(torch.isnan(target).any()) or bool((target < 0).any()):
        raise ValueError("col_sum must be non-negative and not NaN")
    total = target.sum(-1)
    if bool(((total - n).abs() > 1e-6 * max(n, 1)).any()):
        raise ValueError(
            f"col_sum must add up to n={n} (every row sums to 1), got {total.flatten()[:4].tolist()}; "
            f"for equal columns use col_sum=n/k={n / k:g}"
        )
    if n > 0:
        # Within that slack (e.g. n/k rounded in float32, used with float64 log_p), the targets are
        # scaled to add up to n in log_p's dtype: column sums that exceed n by 1e-6 n can otherwise
        # never all be met (rows sum to 1). Exact targets are unchanged (a factor of exactly 1).
        target = target * (n / total.detach()).unsqueeze(-1)
    return target
