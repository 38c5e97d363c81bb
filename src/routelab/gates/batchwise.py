"""Strictly balanced batchwise gating with learned thresholds (Shazeer et al. 2017, App. F).

Functional forms of eq. 18-20, exactly as written in the paper. ``scores`` are the softmax
gate values ``G_sigma(x) = softmax(x W_g)`` of a batch (eq. 15); the sparse gate of eq. 16 is
``G = scores * M / sum(scores * M)`` for a mask ``M``:

* :func:`batchwise_mask` (eq. 18) — training: every expert keeps its top ``m = k |X| / n``
  scores over the batch, so each expert receives exactly ``m`` examples and each example an
  average of ``k`` experts (``floor`` / ``ceil`` of ``m`` when ``n`` does not divide ``k |X|``).
* :func:`threshold_mask` (eq. 19) — inference: ``x_i > T_i`` with per-expert thresholds ``T``,
  usable with any batch size (including 1).
* :func:`batchwise_threshold_loss` (eq. 20) — trains ``T`` so that the two masks agree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import balanced_quotas, check_positive_int, checks_run

__all__ = ["batchwise_mask", "batchwise_threshold_loss", "threshold_mask"]


def _check_scores(scores: Tensor, thresholds: Tensor | None = None, *, check_nan: bool = True) -> None:
    """Validate ``scores [batch, experts]`` (and ``thresholds [experts]``): one host sync for the NaN
    checks, none with ``check_nan=False``."""
    if not isinstance(scores, Tensor):
        raise TypeError(f"scores must be a torch.Tensor [batch, experts], got {type(scores).__name__}")
    if scores.ndim != 2:
        raise ValueError(
            f"scores must have shape [batch, experts], got shape {tuple(scores.shape)}; "
            f"flatten leading dims with scores.reshape(-1, scores.shape[-1])"
        )
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {scores.dtype}; use scores.float()")
    if thresholds is not None:
        if not isinstance(thresholds, Tensor) or thresholds.shape != scores.shape[-1:]:
            got = tuple(thresholds.shape) if isinstance(thresholds, Tensor) else type(thresholds).__name__
            raise ValueError(f"thresholds must be a tensor of shape [experts] = ({scores.shape[-1]},), got {got}")
    if not check_nan or not checks_run():  # no host sync while torch.compile traces
        return
    checks = [torch.isnan(scores).any()]
    if thresholds is not None:
        checks.append(torch.isnan(thresholds).any())
    nan = torch.stack(checks).tolist() if len(checks) > 1 else [bool(checks[0])]
    if nan[0]:
        raise ValueError("scores contain NaN; fix the upstream computation (NaN scores cannot be ranked)")
    if len(nan) > 1 and nan[1]:
        raise ValueError("thresholds contain NaN; every expert needs a comparable threshold (re-initialise T)")


def batchwise_mask(scores: Tensor, k: int, *, check_nan: bool = True) -> Tensor:
    """The batchwise mask of eq. 18: every expert ``i`` keeps its top ``m_i ~ k * batch / experts`` scores.

    When ``experts`` divides ``k * batch`` every expert keeps exactly ``m = k * batch / experts``
    examples (eq. 18 as written). Otherwise the quotas are the floor and the ceiling of that
    ratio (:func:`routelab._checks.balanced_quotas`): ``r = k * batch mod experts`` experts keep
    one more example, those whose next-best score (their ``floor + 1``-th largest) is the largest
    (ties to the lower expert index), so the mask still holds ``k * batch`` pairs and any batch
    size works.

    Args:
        scores: ``[batch, experts]`` gate values (e.g. softmax probabilities).
        k: average number of experts per example, ``1 <= k <= experts``.
        check_nan: refuse NaN scores (one host sync); ``False`` where the caller has checked
            them or opted out (a router with ``check_finite=False``: no host sync).

    Returns:
        ``BoolTensor [batch, experts]`` with ``floor`` or ``ceil`` of ``k * batch / experts``
        ``True`` entries in every column, ``k * batch`` in all. Ties within a column are broken
        towards the earlier example (deterministic).

    Raises:
        ValueError: ``k`` out of range, or ``scores`` not a floating ``[batch, experts]`` tensor
            without NaN.
    """
    _check_scores(scores, check_nan=check_nan)
    batch, n = scores.shape
    check_positive_int("k", k, upper=n, upper_name="experts")
    m, m_hi = balanced_quotas(batch, n, k)
    if m_hi == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    # Every example's rank within its expert's column by a stable descending sort (ties to the
    # earlier example), then rank < quota. The ranks are the sort's inverse permutation.
    order = torch.argsort(scores, dim=0, descending=True, stable=True)
    if torch.compiler.is_compiling():
        # By a second sort: torch.compile's inductor (torch 2.13, CPU) read a scatter's output
        # before the scatter wrote it when the mask also fed the threshold loss (all-zero gates
        # for some tokens; tests/layers/test_compile_checkpoint.py).
        rank = torch.argsort(order, dim=0)
    else:  # by a scatter, 1.7x faster than the second sort at 8192 x 64 on the CPU
        positions = torch.arange(batch, device=scores.device).unsqueeze(1).expand_as(order)
        rank = torch.empty_like(order).scatter_(0, order, positions)
    mask = rank < m
    extra = k * batch - m * n  # experts that keep one more example
    if extra:
        next_best = scores.gather(0, order[m:m + 1]).squeeze(0)  # [experts]
        expert_rank = torch.argsort(torch.argsort(next_best, descending=True, stable=True))
        mask = mask | ((rank == m) & (expert_rank < extra))
    return mask


def threshold_mask(scores: Tensor, thresholds: Tensor, *, check_nan: bool = True) -> Tensor:
    """The threshold mask of eq. 19: ``scores[:, i] > thresholds[i]``.

    Args:
        scores: ``[batch, experts]`` gate values.
        thresholds: ``[experts]`` per-expert thresholds ``T`` (not NaN).
        check_nan: refuse NaN in either (one host sync); ``False``: no check, no sync.

    Returns:
        ``BoolTensor [batch, experts]``.

    Raises:
        ValueError: bad shapes, or NaN in ``scores`` or ``thresholds`` (a NaN threshold would
            silently drop every example from that expert).
    """
    _check_scores(scores, thresholds, check_nan=check_nan)
    return scores > thresholds


def batchwise_threshold_loss(scores: Tensor, thresholds: Tensor, mask: Tensor, *, check_nan: bool = True) -> Tensor:
    """The threshold-learning loss of eq. 20, summed over the batch and the experts.

    ``L = sum_j sum_i (M_threshold(x_j, T)_i - M_batchwise(X, m)_{j,i}) (X_{j,i} - T_i)``.
    Every term is ``>= 0`` and vanishes exactly where the two masks agree; its gradient moves
    ``T_i`` up for each example that passes the threshold but is not in the batchwise mask and
    down for each example in the batchwise mask that does not pass it. Pass detached ``scores``
    to train only ``T`` (as the paper intends); the loss is a sum, so scale it (e.g. by
    ``1 / batch``) to make the learning rate independent of the batch size.

    Args:
        scores: ``[batch, experts]`` gate values ``X``.
        thresholds: ``[experts]`` thresholds ``T`` (differentiable).
        mask: ``BoolTensor [batch, experts]``, the batchwise mask of the same batch.
        check_nan: refuse NaN scores or thresholds (one host sync); ``False``: no check, no sync.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: bad ``scores`` / ``thresholds`` (as :func:`threshold_mask`), or ``mask`` not a
            ``torch.bool`` tensor of the shape of ``scores``.
    """
    above = threshold_mask(scores, thresholds, check_nan=check_nan)
    if not isinstance(mask, Tensor) or mask.shape != scores.shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a tensor with the shape of scores {tuple(scores.shape)}, got {got}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a torch.bool tensor (the batchwise mask of eq. 18, from batchwise_mask), got {mask.dtype}; "
            "pass batchwise_mask(scores, k), or mask != 0 for a 0/1 mask"
        )
    diff = above.to(scores.dtype) - mask.to(scores.dtype)
    # Only the disagreements count: where the masks agree the term is 0 even for an infinite
    # score or threshold (0 * inf would be NaN; T = +inf switches an expert off).
    terms = torch.where(above != mask, diff * (scores - thresholds), diff.new_zeros(()))  # (on the device: no copy)
    return terms.sum()

