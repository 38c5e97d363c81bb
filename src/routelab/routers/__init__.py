"""Routers: ``nn.Module``s that turn tokens into a :class:`routelab.Routes` decision.

Every router has the same interface (:class:`Router`), so a model switches routing method by
changing one argument: ``MoE(..., router="topk")`` -> ``router="base"``. Names:

=====================  =================================================================
``softmax``            dense softmax gating (every expert on every token)
``topk``               top-k gating; ``k=1`` is Switch routing (alias ``switch``)
``noisy_topk``         noisy top-k with importance + load losses (Shazeer et al. 2017)
``batchwise``          strictly balanced batchwise gating, learned thresholds (App. F)
``base``               exact balanced assignment (BASE layers; Kool et al. eq. 4)
``sinkhorn``           Sinkhorn-balanced top-k (Kool et al. Sec. 2.3; S-BASE)
``gumbel_matching``    stochastic balanced Gumbel-Matching with importance weights (Kool et al.)
=====================  =================================================================
"""

from __future__ import annotations

from typing import Any

from routelab.routers.balanced import BASERouter, GumbelMatchingRouter, SinkhornRouter
from routelab.routers.base import Router
from routelab.routers.batchwise import BatchwiseRouter
from routelab.routers.softmax import SoftmaxRouter
from routelab.routers.topk import NoisyTopKRouter, TopKRouter

__all__ = [
    "ALIASES",
    "ROUTERS",
    "BASERouter",
    "BatchwiseRouter",
    "GumbelMatchingRouter",
    "NoisyTopKRouter",
    "Router",
    "SinkhornRouter",
    "SoftmaxRouter",
    "TopKRouter",
    "make_router",
    "router_name",
]

#: Router classes by name (``switch`` is ``topk`` with ``k=1``).
ROUTERS: dict[str, type[Router]] = {
    "softmax": SoftmaxRouter,
    "topk": TopKRouter,
    "switch": TopKRouter,
    "noisy_topk": NoisyTopKRouter,
    "batchwise": BatchwiseRouter,
    "base": BASERouter,
    "sinkhorn": SinkhornRouter,
    "gumbel_matching": GumbelMatchingRouter,
}

#: Other spellings accepted by :func:`make_router` (``-`` and ``_`` are interchangeable too).
ALIASES: dict[str, str] = {
    "top_k": "topk",
    "noisy_top_k": "noisy_topk",
    "noisy": "noisy_topk",
    "dense": "softmax",
    "strictly_balanced": "batchwise",
    "gumbel": "gumbel_matching",
    "balanced": "base",
}

# Routers whose number of experts per token is fixed by the method, not by a k argument.
_NO_K = {"softmax", "gumbel_matching"}


def router_name(name: str) -> str:
    """The key of :data:`ROUTERS` that ``name`` spells (case, ``-``/``_`` and :data:`ALIASES`
    accepted), else a ValueError listing the choices."""
    if not isinstance(name, str):
        raise ValueError(f"router name must be a string, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    return key


def make_router(name: str, d_model: int, num_experts: int, *, k: int | None = None, **kwargs: Any) -> Router:
    """Build a router by name.

    Args:
        name: a key of :data:`ROUTERS`.
        d_model: token width.
        num_experts: ``E``.
        k: experts per token for ``topk``/``noisy_topk``/``batchwise``/``sinkhorn``/``base``
            (default 1, 2 for ``noisy_topk``); must be ``None`` or match for the others
            (``softmax`` uses all ``E``, ``gumbel_matching`` one).
        **kwargs: the router's own options (see its class).

    Raises:
        ValueError: unknown name, or a ``k`` the router cannot use.
    """
    name = router_name(name)
    cls = ROUTERS[name]
    if name in _NO_K:
        fixed = num_experts if name == "softmax" else 1
        if k is not None and k != fixed:
            raise ValueError(f"router {name!r} sends every token to {fixed} expert(s); drop k={k} (or use 'topk')")
        return cls(d_model, num_experts, **kwargs)
    if name == "base":
        return cls(d_model, num_experts, k=1 if k is None else k, **kwargs)
    if name == "switch":
        if k not in (None, 1):
            raise ValueError(f"router 'switch' is top-1; use router='topk' with k={k}")
        k = 1
    return cls(d_model, num_experts, k if k is not None else (2 if name == "noisy_topk" else 1), **kwargs)


def __getattr__(name: str) -> Any:
    """``BaseRouter``: the deprecated name of :class:`BASERouter`."""
    if name == "BaseRouter":
        from routelab.routers import balanced

        return balanced.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
