"""Strictly balanced batchwise gating with learned thresholds (Shazeer et al. 2017, App. F)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import check_nonneg
from ..routes import Routes
from ..routing.rules import INFERENCE_MASKS, batchwise_mask_in_use, batchwise_routes
from .base import ChoosesK, Router

__all__ = ["BatchwiseRouter"]


class BatchwiseRouter(ChoosesK, Router):
    """App. F gating: ``G = G_sigma * M / sum(G_sigma * M)`` (eq. 16) with ``G_sigma = softmax(x W_g)``.

    * Training: ``M`` is the batchwise mask (eq. 18): every expert takes ``m = k * tokens / E``
      tokens of the batch (the floor or the ceiling of ``m`` when ``E`` does not divide
      ``k * tokens``; any batch size works).
      The per-expert thresholds ``T`` learn from ``aux["threshold"] = threshold_coef *
      L_batchwise(G_sigma, T, M) / tokens`` (eq. 20, on detached scores, so only ``T`` learns
      from it; divided by the batch size so the step does not depend on it).
    * Inference (``eval()``): ``M`` is the threshold mask ``G_sigma > T`` (eq. 19), which works
      for any batch size, including 1, and depends on no other token; ``inference="batchwise"``
      keeps the batchwise mask instead (only meaningful for large batches; a token's route then
      depends on its batch-mates).

    Routes have ``E`` slots per token (slot ``e`` is expert ``e``) with ``keep`` = the mask, so a
    token may use any number of experts (including none: its gate is then all zero).

    Args:
        d_model: token width.
        num_experts: ``E``.
        k: average experts per token, ``1 <= k <= E``.
        threshold_coef: weight of the threshold loss.
        inference: ``"threshold"`` (default) or ``"batchwise"``.
    """

    fills_quotas = True  # in training: a capacity_factor below 1 is refused (Router.fills_quotas)
    experts_in_range = True

    def __init__(self, d_model: int, num_experts: int, k: int = 1, *, threshold_coef: float = 1.0,
                 inference: str = "threshold") -> None:
        super().__init__(d_model, num_experts, k)
        if inference not in INFERENCE_MASKS:
            raise ValueError(f"inference must be one of {INFERENCE_MASKS}, got {inference!r}")
        self.inference = inference
        self.threshold_coef = check_nonneg("threshold_coef", threshold_coef)
        # Start at the uniform gate value: the median score of an untrained router. With one
        # expert every score is exactly 1 and the strict mask G > T would drop every token: start
        # that threshold below it.
        start = 1.0 / num_experts if num_experts > 1 else 0.5
        self.thresholds = nn.Parameter(torch.full((num_experts,), start))

    @property
    def eval_balanced(self) -> bool:
        """Whether inference fills the quotas too (``inference="batchwise"``): an
        ``eval_capacity_factor`` below 1 is then refused as ``capacity_factor`` is."""
        return self.inference == "batchwise"

    def mask(self, probs: Tensor) -> Tensor:
        """The mask in use: batchwise in training (or if ``inference="batchwise"``), else threshold."""
        return batchwise_mask_in_use(probs, self.k, self.thresholds, training=self.training, inference=self.inference,
                                     check_nan=self.check_finite)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        if capacity is not None and (self.training or self.inference == "batchwise"):
            quota = -(-self.k * logits.shape[0] // self.num_experts)  # ceil(k n / E)
            if capacity < quota:
                raise ValueError(
                    f"capacity {capacity} per expert is below the batchwise quota ceil(k*n/E) = {quota} of App. F "
                    f"(k={self.k}, n={logits.shape[0]} tokens, E={self.num_experts}): the layer would drop part of "
                    "every expert's batchwise picks. Use capacity_factor >= 1 (or None, dropless); with "
                    "inference='batchwise' the same holds for eval_capacity_factor")
        # check_finite=False opts out of the NaN checks too (no host sync: capturable in a CUDA graph).
        return batchwise_routes(logits, self.k, self.thresholds, training=self.training, inference=self.inference,
                                threshold_coef=self.threshold_coef, check_nan=self.check_finite)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", inference={self.inference!r}"
