"""Top-k gating (Switch for k = 1) and noisy top-k gating (Shazeer et al. 2017, Sec. 2-4, App. A)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_nonneg, check_pos
from ..routes import Routes
from ..routing.rules import noisy_topk_routes, topk_routes
from ._scores import float32_linear
from .base import ChoosesK, Router

__all__ = ["NoisyTopKRouter", "TopKRouter"]


class TopKRouter(ChoosesK, Router):
    """Each token goes to the ``k`` experts with the largest logits.

    Args:
        d_model: token width.
        num_experts: ``E``.
        k: experts per token, ``1 <= k <= E`` (``k = 1`` is Switch routing).
        renormalize: combine weights ``softmax`` over the ``k`` chosen logits (Shazeer et al.,
            Mixtral) instead of the full-softmax probabilities of the chosen experts (Switch,
            GShard). With ``k = 1`` renormalising makes every weight 1, so the router gets no
            gradient; the default keeps the full-softmax probabilities.
        balance_coef: weight of the Switch balance loss ``E sum_e f_e P_e`` in
            ``aux["balance"]`` (Fedus et al. use 0.01; 0 disables it).
    """

    proposes_every_slot = True
    experts_in_range = True

    def __init__(self, d_model: int, num_experts: int, k: int = 1, *, renormalize: bool = False,
                 balance_coef: float = 0.01) -> None:
        super().__init__(d_model, num_experts, k)
        self.renormalize = bool(renormalize)
        self.balance_coef = check_nonneg("balance_coef", balance_coef)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        return topk_routes(logits, self.k, renormalize=self.renormalize, balance_coef=self.balance_coef)


class NoisyTopKRouter(ChoosesK, Router):
    """Noisy top-k gating with the importance and load losses of Shazeer et al. (2017).

    ``H(x) = x W_g + eps * softplus(x W_noise)`` with ``eps ~ N(0, 1)`` in training (eq. 4),
    ``G(x) = softmax(KeepTopK(H(x), k))`` (eq. 3, 5). ``W_g`` and ``W_noise`` start at zero, as
    in the paper. Auxiliary losses (Sec. 4, App. A):

    * ``aux["importance"] = importance_coef * CV(sum_x G(x))^2`` (eq. 6-7);
    * ``aux["load"] = load_coef * CV(Load)^2`` with the smooth load estimator of App. A
      (eq. 8-11), differentiable through ``W_g`` and ``W_noise``.

    Without training (``eval()``) no noise is added; the losses use the clean logits.

    Args:
        d_model: token width.
        num_experts: ``E``.
        k: experts per token.
        importance_coef, load_coef: loss weights (the paper uses 0.1 each).
        noise_epsilon: added to the softplus so the noise never vanishes (reference
            implementations use 1e-2).

    The noise is replayed by activation checkpointing (:class:`~routelab.replay.NoiseReplay`).
    """

    proposes_every_slot = True
    experts_in_range = True
    stochastic = True

    def __init__(self, d_model: int, num_experts: int, k: int = 2, *, importance_coef: float = 0.1,
                 load_coef: float = 0.1, noise_epsilon: float = 1e-2) -> None:
        super().__init__(d_model, num_experts, k)
        self.noise = nn.Linear(d_model, num_experts, bias=False)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.noise.weight)
        self.importance_coef = check_nonneg("importance_coef", importance_coef)
        self.load_coef = check_nonneg("load_coef", load_coef)
        self.noise_epsilon = check_pos("noise_epsilon", noise_epsilon)

    def features(self, x: Tensor) -> Tensor:
        """``[tokens, 2E]``: the clean logits, then the noise scales ``softplus(x W_noise) + eps``."""
        raw = float32_linear(x, self.noise.weight)
        return torch.cat([self.logits(x), F.softplus(raw) + self.noise_epsilon], dim=-1)

    def route(self, features: Tensor, capacity: int | None) -> Routes:
        E = self.num_experts
        return noisy_topk_routes(features[:, :E], features[:, E:], self.k, training=self.training,
                                 importance_coef=self.importance_coef, load_coef=self.load_coef,
                                 generator=self.generator, check=False)  # softplus + eps > 0
