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

import inspect
import numbers
from collections.abc import Mapping
from typing import Any

from routelab._checks import check_positive_int
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
    "check_router_arguments",
    "make_router",
    "router_name",
    "router_options",
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

# Routers whose number of experts per token is fixed by the method, not by a k argument: the k
# they support, in words, for the error a generic caller gets when it passes the model's k.
_FIXED_K = {
    "softmax": "k=None or k=num_experts: softmax gating is dense (every token uses all E experts, weighted by "
               "the full softmax; it is not renormalised over a top-k); for k experts per token use router='topk'",
    "switch": "k=None or k=1: Switch routing is top-1; for k experts per token use router='topk'",
    "gumbel_matching": "k=None or k=1: Gumbel-Matching samples one expert per token (a balanced n x E matching); "
                       "for k experts per token use router='sinkhorn' or 'topk'",
}


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


def router_options(name: str) -> tuple[str, ...]:
    """The options (``router_kwargs``) the router ``name`` takes besides ``d_model``, ``num_experts`` and ``k``."""
    skip = {"self", "d_model", "num_experts", "k"}
    params = inspect.signature(ROUTERS[router_name(name)].__init__).parameters.values()
    return tuple(p.name for p in params if p.name not in skip
                 and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def check_router_arguments(name: str, num_experts: int, k: int | None, options: Mapping[str, Any]) -> None:
    """Raise ValueError unless the router ``name`` takes every key of ``options`` (its
    ``router_kwargs``) and, for a router of one ``k`` (``softmax``, ``switch``, ``gumbel_matching``),
    ``k`` is that one or ``None``. The message lists the options it takes, or the ``k`` it supports."""
    name = router_name(name)
    known = router_options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"router {name!r} takes no option {', '.join(map(repr, unknown))} (router_kwargs); its "
                         f"options: {', '.join(known) or 'none'}")
    if name in _FIXED_K:
        fixed = num_experts if name == "softmax" else 1
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k != fixed):
            supported = _FIXED_K[name].replace("k=num_experts", f"k=num_experts={num_experts}")
            raise ValueError(f"router {name!r} got k={k!r} but supports {supported}")
    elif k is not None:
        check_positive_int("k", k, upper=num_experts, upper_name="num_experts")


def make_router(name: str, d_model: int, num_experts: int, *, k: int | None = None, **kwargs: Any) -> Router:
    """Build a router by name.

    Args:
        name: a key of :data:`ROUTERS`.
        d_model: token width.
        num_experts: ``E``.
        k: the model's experts per token. ``topk``/``noisy_topk``/``batchwise``/``sinkhorn``/``base``
            take any ``1 <= k <= E`` (default 1, 2 for ``noisy_topk``); the others support one
            value, or ``None``: ``softmax`` ``k = E`` (dense), ``switch`` and ``gumbel_matching``
            ``k = 1``.
        **kwargs: the router's own options (see its class).

    Raises:
        ValueError: unknown name, an option the router does not take (the message lists those it
            does), or a ``k`` the router cannot use (the message says which ``k`` it supports).
    """
    name = router_name(name)
    cls = ROUTERS[name]
    check_router_arguments(name, num_experts, k, kwargs)
    if name in _FIXED_K:
        if name == "switch":
            return cls(d_model, num_experts, 1, **kwargs)
        return cls(d_model, num_experts, **kwargs)
    if name == "base":
        return cls(d_model, num_experts, k=1 if k is None else k, **kwargs)
    return cls(d_model, num_experts, k if k is not None else (2 if name == "noisy_topk" else 1), **kwargs)


def __getattr__(name: str) -> Any:
    """``BaseRouter``: the deprecated name of :class:`BASERouter`."""
    if name == "BaseRouter":
        from routelab.routers import balanced

        return balanced.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
