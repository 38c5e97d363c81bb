"""Token masks: padding takes no part in routing.

A token mask is a ``BoolTensor`` over the tokens, ``True`` for a real token and ``False`` for
padding (``attention_mask.bool()`` of a padded batch). routelab applies it in one way
everywhere: the masked tokens are *removed* before routing (:func:`real_tokens`), the rule or
layer runs on the real tokens alone, and the result is put back in token order with the masked
tokens routed nowhere (:func:`scatter_routes`). So a masked token takes no capacity, enters no
balanced solve (BASE, Sinkhorn, Gumbel-Matching, the batchwise quotas), counts in no statistic
or auxiliary loss, draws no noise, and gets a zero output; the real tokens of a padded batch are
routed exactly as the same tokens without the padding.

Removing tokens is data-dependent: with a mask, one host synchronisation reads the number of
real tokens (a graph break under ``torch.compile``; without a mask there is none).
:func:`scatter_routes` called on its own checks the indices it puts back (one more), unless told
they come from :func:`real_tokens`, as routelab's layers and routers do.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import checks_run, token_mask
from ..routes import Routes

__all__ = ["masked_rule", "real_tokens", "scatter_routes"]


def real_tokens(mask: Tensor) -> Tensor:
    """``LongTensor [real]``: the indices of the ``True`` entries of a token mask (any shape, read
    flattened), ascending. One host sync (the count is data-dependent).

    Raises:
        TypeError, ValueError: ``mask`` is not a ``BoolTensor`` (naming ``mask``).
    """
    token_mask(mask, mask.shape if isinstance(mask, Tensor) else ())
    return mask.reshape(-1).nonzero().squeeze(-1)


def scatter_routes(routes: Routes, index: Tensor, num_tokens: int, *, check: bool = True) -> Routes:
    """Routes of the real tokens put back among all ``num_tokens`` tokens.

    Args:
        routes: ``Routes [real, slots]`` of the tokens ``index``.
        index: ``LongTensor [real]`` their positions among the tokens (:func:`real_tokens`).
        num_tokens: all tokens, padding included.
        check: check that ``index`` holds positions in ``[0, num_tokens)`` (one host sync);
            ``False`` where ``index`` comes from :func:`real_tokens` of a ``[num_tokens]`` mask, as
            inside routelab's layers and routers, where it cannot be out of range.

    Returns:
        ``Routes [num_tokens, slots]``: the real tokens' rows unchanged (``gate`` and ``log_prob``
        differentiable through the scatter); masked rows routed nowhere: ``keep`` False, ``gate``,
        ``weight`` and ``log_prob`` 0, ``expert`` 0. ``aux`` and ``stats`` are the real tokens'.

    Raises:
        TypeError, ValueError: naming the argument: ``routes`` not a :class:`~routelab.Routes`,
            ``index`` not a 1-D integer tensor with one entry per routed token, or
            ``num_tokens`` not an integer that holds every index.
    """
    if not isinstance(routes, Routes):
        raise TypeError(f"routes must be a routelab.Routes, got {type(routes).__name__}")
    if not isinstance(index, Tensor) or index.ndim != 1 or index.is_floating_point() or index.dtype == torch.bool:
        got = f"{index.dtype} of shape {tuple(index.shape)}" if isinstance(index, Tensor) else type(index).__name__
        raise ValueError(f"index must be a 1-D LongTensor [real] (real_tokens(mask)), got {got}")
    if index.shape[0] != routes.expert.shape[0]:
        raise ValueError(f"index must have one entry per routed token ({routes.expert.shape[0]}), got {index.shape[0]}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < index.shape[0]:
        raise ValueError(f"num_tokens must be an integer >= the {index.shape[0]} routed tokens, got {num_tokens!r}")
    if check and index.numel() and checks_run():
        lo, hi = torch.stack([index.min(), index.max()]).tolist()  # one host sync
        if lo < 0 or hi >= num_tokens:
            raise ValueError(f"index must hold token positions in [0, num_tokens={num_tokens}), got {lo} to {hi}")
    index = index.long()

    def put(t: Tensor) -> Tensor:
        out = t.new_zeros((num_tokens, *t.shape[1:]))
        return out.index_copy(0, index, t)

    return Routes(expert=put(routes.expert), gate=put(routes.gate), keep=put(routes.keep), weight=put(routes.weight),
                  log_prob=put(routes.log_prob), aux=routes.aux, stats=routes.stats)


def masked_rule(*per_token: str) -> Callable[[Callable[..., Routes]], Callable[..., Routes]]:
    """Give a routing rule a ``mask`` keyword: the rule runs on the real tokens only.

    Args:
        per_token: the names of the rule's arguments that hold one row per token (``"logits"``,
            ``"noise_std"``); they are cut to the real tokens.

    The decorated rule takes ``mask: BoolTensor [tokens] | None = None`` besides its own
    arguments; with a mask its result is :func:`scatter_routes` of the rule on the real tokens.
    """

    def decorate(rule: Callable[..., Routes]) -> Callable[..., Routes]:
        signature = inspect.signature(rule)

        @functools.wraps(rule)
        def wrapper(*args: Any, mask: Tensor | None = None, **kwargs: Any) -> Routes:
            if mask is None:
                return rule(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            first = bound.arguments.get(per_token[0])
            if not isinstance(first, Tensor) or first.ndim < 1:
                return rule(*args, **kwargs)  # the rule names the bad argument itself
            n = first.shape[0]
            mask = token_mask(mask, (n,))
            index = real_tokens(mask)
            for name in per_token:
                value = bound.arguments.get(name)
                if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == n:
                    bound.arguments[name] = value.index_select(0, index)
            return scatter_routes(rule(*bound.args, **bound.kwargs), index, n, check=False)

        params: Sequence[inspect.Parameter] = list(signature.parameters.values())
        extra = inspect.Parameter("mask", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Tensor | None")
        wrapper.__signature__ = signature.replace(parameters=[*params, extra])  # type: ignore[attr-defined]
        return wrapper

    return decorate

