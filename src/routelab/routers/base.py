"""The router interface shared by every routing method.

A router is a thin module: it scores the tokens (:meth:`Router.gate`, routelab's one gate
protocol, :mod:`routelab.gates.protocol`) and calls a routing rule, a pure function of
:mod:`routelab.routing.rules`, on the scores of the whole batch (:meth:`Router.route`). It maps
tokens ``x [tokens, d_model]`` to a :class:`~routelab.Routes` record with ``slots`` columns.
Its ``keep`` marks the slots it *proposes* (all of them for top-k, the mask
for batchwise gating); the MoE layer then enforces the expert capacity on those candidates
(:func:`routelab.routing.apply_capacity`). ``aux`` holds the router's auxiliary losses, already
multiplied by their coefficients, so a training loss is ``task_loss + sum(routes.aux.values())``.

Token masks (``mask [tokens]``, ``True`` = a real token) are applied here for every router: the
masked tokens are removed before :meth:`Router.route` and routed nowhere
(:mod:`routelab.routing.masks`). Stochastic routers draw through a
:class:`~routelab.replay.NoiseReplay`, so activation checkpointing recomputes the
forward's noise.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import (
    GeneratorAttribute,
    check_capacity,
    check_finite,
    check_positive_int,
    checks_run,
    token_mask,
)
from ..gates.protocol import GateOutput
from ..replay import NoiseReplay
from ..routes import Routes
from ..routing.masks import real_tokens, scatter_routes
from ..routing.rules import expert_grid
from ._scores import float32_linear, full_precision

__all__ = ["Router", "check_capacity_for", "check_finite_features", "check_positive_int", "declares", "expert_grid",
           "experts_in_range", "proposes_every_slot", "routes_need_value_check"]


def check_finite_features(features: Tensor) -> None:
    """ValueError if router features (logits) contain NaN or inf (one host sync per call)."""
    check_finite(
        features,
        "router logits",
        "the input x contains NaN/inf or the router weights diverged; check the previous layer or lower "
        "the learning rate",
    )


class Router(nn.Module):
    """Base class: a linear scoring layer ``logits = x W`` plus a routing rule.

    Subclasses implement :meth:`route`. The scoring layer and the routing rule run in float32
    whatever the input dtype, ``torch.autocast`` regions included (routing decisions in half
    precision are fragile), and the input is validated once.
    Subclasses that draw randomness in :meth:`route` set ``stochastic = True``: their draws are
    replayed by activation checkpointing (:class:`~routelab.replay.NoiseReplay`).

    Args:
        d_model: token width.
        num_experts: ``E >= 1``.
        slots: average experts per token ``k`` (used by the layer to size the capacity).

    Attributes:
        proj: ``nn.Linear(d_model, E, bias=False)``, the router's scores.
        generator: the source of randomness of stochastic routers (``None``: torch's global
            generator); set it for bit-for-bit reproducible runs.
        check_finite: check the router's scores for NaN/inf on every call (one host sync;
            skipped anyway while ``torch.compile`` traces). ``False`` drops the check, and the
            other value checks of the routing rule that would sync (batchwise gating's NaN checks
            of its scores and thresholds): a NaN threshold then silently empties its expert.
    """

    #: Whether :meth:`route` draws randomness in training (noise replayed under checkpointing).
    stochastic: bool = False

    #: Whether this class's :meth:`route` proposes every slot (``keep`` all True), as every
    #: built-in router but batchwise gating does. A patched transformers block whose gate routes
    #: without capacity or mask then knows, without a host sync, that every slot reaches an expert.
    #: ``False`` (the safe answer: a sync, never a wrong route) for routers that do not say. Read it
    #: through :func:`proposes_every_slot`, which does not trust it for a subclass that overrides
    #: the routing without declaring it again.
    proposes_every_slot: bool = False

    #: Whether this class's :meth:`route` names experts in ``[0, E)`` by construction (the indices
    #: of a top-k, an argmax or an assignment), as every built-in router does. A layer whose drop
    #: policy does not rank by the gates then skips its value check of the routes (the experts'
    #: range: a host sync, the second of a forward with ``check_finite`` on). ``False`` for routers
    #: that do not say; read it through :func:`experts_in_range`, which does not trust it for a
    #: subclass that overrides the routing without declaring it again.
    experts_in_range: bool = False

    #: Whether the router assigns every token in training (a balanced solve at the quota
    #: ``ceil(k n / E)``, BASE and Gumbel-Matching): the layer's capacity must hold that quota,
    #: so a ``capacity_factor`` below 1 is refused when the layer is built.
    assigns_every_token: bool = False

    #: Whether every expert takes its quota, the floor or ceiling of ``k n / E`` tokens, in
    #: training (batchwise gating, App. F; BASE too): a ``capacity_factor``
    #: below 1 would drop part of it, so it is refused when the layer is built.
    fills_quotas: bool = False

    generator = GeneratorAttribute(
        "The source of randomness of stochastic routers (``None``: torch's global generator)."
    )

    def __init__(self, d_model: int, num_experts: int, slots: int) -> None:
        super().__init__()
        self.d_model = check_positive_int("d_model", d_model)
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.slots = check_positive_int("k", slots, upper=num_experts, upper_name="num_experts")
        self.proj = nn.Linear(d_model, num_experts, bias=False)
        self.generator = None
        self.check_finite = True
        self.logits_in_input_dtype = False
        self._replay = NoiseReplay()

    def logits(self, x: Tensor) -> Tensor:
        """Router logits ``[tokens, E]`` in float32: ``x @ proj.weight.T`` (``+ proj.bias`` when one is set,
        as :func:`~routelab.integrations.hf.patch_moe` does for gates with a bias).

        Computed in float32 from any input dtype, also inside ``torch.autocast`` regions, and
        without keeping a float32 copy of ``x`` for the backward
        (:func:`~routelab.routers._scores.float32_linear`), unless :attr:`logits_in_input_dtype`
        (set by ``patch_moe`` for a model whose own gate scores in its hidden states' dtype, so that
        a bfloat16 model is reproduced): then in ``x``'s dtype, and returned as float32.
        """
        weight, bias = self.proj.weight, self.proj.bias
        if self.logits_in_input_dtype and x.dtype != torch.float32:
            bias = None if bias is None else bias.to(x.dtype)
            with full_precision(x.device):
                return nn.functional.linear(x, weight.to(x.dtype), bias).float()
        return float32_linear(x, weight, bias)

    def features(self, x: Tensor) -> Tensor:
        """Everything the router computes token by token: ``[tokens, F]`` float32.

        The default is the logits (``F = E``); a router with more per-token inputs appends them
        (noisy top-k appends its noise scales). :meth:`route` then decides on the whole batch.
        Splitting the two lets expert parallelism gather the features of every rank and route
        the global batch (:mod:`routelab.parallel`).
        """
        return self.logits(x)

    def gate(self, x: Tensor) -> GateOutput:
        """The gate protocol: ``scores`` = :meth:`features` of ``x`` (checked), no auxiliary loss.

        Routers' losses depend on the routing decision, so they come with the
        :class:`~routelab.Routes` of :meth:`route`. Stores nothing on the module.

        Args:
            x: ``[tokens, d_model]``, any floating dtype.
        """
        if not isinstance(x, Tensor) or x.ndim != 2 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [tokens, d_model={self.d_model}], got {got}")
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating tensor, got {x.dtype}; convert it with x.float()")
        return GateOutput(self.features(x))

    def forward(self, x: Tensor, capacity: int | None = None, *, mask: Tensor | None = None) -> Routes:
        """Route ``x``: score it (:meth:`gate`), check the scores finite, then :meth:`route`.

        Args:
            x: ``[tokens, d_model]``.
            capacity: the layer's per-expert capacity (balanced routers check that it holds
                their quota; others ignore it and leave dropping to the layer). ``None``: no
                limit.
            mask: optional ``BoolTensor [tokens]``, ``True`` for real tokens: the others are
                routed nowhere (no capacity, no balanced solve, no statistic, no auxiliary loss;
                :mod:`routelab.routing.masks`), and the real tokens are routed exactly as
                without the masked ones. One host sync to count the real tokens.

        Returns:
            :class:`~routelab.Routes` ``[tokens, slots]`` (``slots`` may exceed ``k`` for
            routers that choose a variable number of experts, e.g. batchwise gating uses ``E``
            slots with ``keep`` as the mask).
        """
        feats = self.gate(x).scores
        capacity = check_capacity(capacity)
        mask = token_mask(mask, x.shape[:1])
        index = None
        if mask is not None:
            index = real_tokens(mask)
            feats = feats.index_select(0, index)
        routes = self.route_features(feats, capacity)
        return routes if index is None else scatter_routes(routes, index, x.shape[0], check=False)

    def route_features(self, features: Tensor, capacity: int | None) -> Routes:
        """:meth:`route` with the router's safeguards: the finite check of the scores (unless
        ``check_finite`` is False or ``torch.compile`` traces) and, for stochastic routers in
        training, the noise replay of activation checkpointing. For callers that computed the
        features themselves (expert parallelism gathers them from every rank).

        Args:
            features: ``[tokens, F]`` float32, :meth:`features` of the tokens to route.
            capacity: as in :meth:`forward`.
        """
        if self.check_finite and checks_run():
            check_finite_features(features)
        # Inside torch.autocast the rule's matmuls (balanced solvers) would run in half precision.
        with full_precision(features.device):
            if self.stochastic and self.training:
                with self._replay.draw(self.generator):
                    return self.route(features, capacity)
            return self.route(features, capacity)

    def route(self, features: Tensor, capacity: int | None) -> Routes:  # pragma: no cover - abstract
        """The routing rule (a function of :mod:`routelab.routing.rules`) on the float32
        ``features [tokens, F]`` of the whole batch (the logits ``[tokens, E]`` unless
        :meth:`features` says otherwise), with the router's options."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.slots}"


#: The methods through which a router's routing runs (see :func:`proposes_every_slot`).
_ROUTING_METHODS = ("route", "route_features", "forward", "__call__")


def proposes_every_slot(router: nn.Module) -> bool:
    """Whether ``router``'s routing proposes every slot (``keep`` all True) by its class's own
    declaration (:attr:`Router.proposes_every_slot`); see :func:`declares` for what voids it."""
    return declares(router, "proposes_every_slot")


def experts_in_range(router: nn.Module) -> bool:
    """Whether ``router``'s routing names experts in ``[0, E)`` by its class's own declaration
    (:attr:`Router.experts_in_range`); see :func:`declares` for what voids it."""
    return declares(router, "experts_in_range")


def routes_need_value_check(router: Router, drop_policy: str) -> bool:
    """Whether a layer checks the values of ``router``'s routes before its capacity step (one host
    sync: the experts' range, and NaN in the gates where ``drop_policy="score"`` ranks by them).

    Not with ``router.check_finite`` off (the user's choice of no host sync), nor where nothing
    could fail: a router that declares :func:`experts_in_range`, under a policy that does not read
    the gates. So a layer with a built-in router and its default checks makes one host sync per
    forward, the router's finite check of its scores.
    """
    return bool(router.check_finite) and (drop_policy == "score" or not experts_in_range(router))


def declares(router: nn.Module, flag: str) -> bool:
    """Whether ``router``'s class declares the routing property ``flag`` (a class attribute of
    :class:`Router` that is ``True``), in a way that still holds for this instance.

    Anything that could change the routing after the declaration makes the answer ``False`` (a
    host sync or a check where one could be saved, never a wrong route):

    * a subclass that overrides ``route``, ``route_features``, ``forward`` or ``__call__`` without
      declaring the flag again (the declaration counts only from the class that defines the
      routing, or a subclass of it);
    * a flag that is not the plain value ``True`` on the router (a property, an instance's own
      ``False``);
    * routing methods set on the instance, and forward hooks on the router.
    """
    if getattr(router, flag, False) is not True:
        return False
    if any(name in vars(router) for name in _ROUTING_METHODS):
        return False
    if router._forward_hooks or router._forward_pre_hooks:
        return False
    cls = type(router)

    def first_definer(name: str) -> type | None:
        return next((c for c in cls.__mro__ if name in c.__dict__), None)

    declared = first_definer(flag)
    if declared is None or declared.__dict__[flag] is not True:
        return False
    return all(issubclass(declared, definer) for definer in map(first_definer, _ROUTING_METHODS)
               if definer is not None and definer is not nn.Module)


class ChoosesK:
    """Mixin for routers that take any ``k`` experts per token: ``k`` *is* the router's ``slots``.

    One value, read by the routing rule and by the layer that sizes the capacity, so that setting
    ``router.k`` changes both (two copies went apart: the layer sized its capacity for the old
    ``k`` and described the router by it in ``MoE.config``).
    """

    @property
    def k(self) -> int:
        """Experts per token (``1 <= k <= num_experts``)."""
        return self.slots

    @k.setter
    def k(self, value: int) -> None:
        self.slots = check_positive_int("k", value, upper=self.num_experts, upper_name="num_experts")


def check_capacity_for(router: Router, capacity_factor: float | None, *, eval: bool = False) -> None:
    """ValueError for a ``capacity_factor`` below 1 with a router that assigns every token
    (:attr:`Router.assigns_every_token`): its balanced solve needs the quota ``ceil(k n / E)`` of
    every expert (it would fail at the first forward instead); or that fills every expert's quota
    in training (:attr:`Router.fills_quotas`: batchwise gating, whose picks would be dropped).
    With ``eval=True`` the factor is the ``eval_capacity_factor``, checked where the router
    balances at inference too (``eval_balanced``: a balanced router's option, batchwise gating's
    ``inference='batchwise'``)."""
    if capacity_factor is None or capacity_factor >= 1:
        return
    name = "eval_capacity_factor" if eval else "capacity_factor"
    if eval and not getattr(router, "eval_balanced", False):
        return
    if getattr(router, "assigns_every_token", False):
        raise ValueError(f"{name}={capacity_factor} is below 1, but the {type(router).__name__} assigns "
                         f"every token (a balanced solve at the quota ceil(k*n/E)"
                         f"{', also at inference: eval_balanced=True' if eval else ''}): use {name} >= 1 "
                         f"(or None, dropless)")
    if getattr(router, "fills_quotas", False):
        when = "at inference too (inference='batchwise')" if eval else "in training"
        raise ValueError(f"{name}={capacity_factor} is below 1, but the {type(router).__name__} gives every "
                         f"expert its quota floor/ceil(k*n/E) {when}, which a capacity below it would cut: use "
                         f"{name} >= 1 (or None, dropless)")
