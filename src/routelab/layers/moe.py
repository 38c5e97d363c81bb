"""The mixture-of-experts feed-forward layer: route, enforce capacity, dispatch, experts, combine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import check_generator, checks_run, floating_input, token_mask
from ..replay import NoiseReplay
from ..routers import Router, router_options
from ..routers.base import check_capacity_for, routes_need_value_check
from ..routes import Routes
from ..routing import DispatchPlan, GroupedPlan, apply_capacity, expert_capacity, load_stats
from ..routing.dropless import decide_and_plan_dropless
from ..routing.masks import real_tokens, scatter_routes
from ..routing.record import RoutingRecord
from .config import MoEConfig, _groups
from .experts import StackedExperts

__all__ = ["MoE"]

_SAME = object()  # MoE._build: the router goes where the experts go


class MoE(RoutingRecord, nn.Module):
    """Token-level mixture of feed-forward experts with any routelab router.

    ``y_t = sum_s keep[t, s] * c[t, s] * FFN_{expert[t, s]}(x_t)`` with ``c = gate`` (or ``gate *
    weight`` with ``importance_weighting``). Steps, none with a Python loop over tokens or
    experts:

    1. the router proposes ``Routes`` (``[tokens, slots]``);
    2. :func:`routelab.routing.apply_capacity` keeps at most ``C = ceil(capacity_factor *
       tokens * k / E)`` pairs per expert (``drop_policy`` decides who stays) and multiplies
       ``weight`` by the skip correction ``n_z / min(n_z, C)`` of Kool et al. eq. 3;
    3. the kept pairs are dispatched to the experts, either sorted by expert into ``[tokens *
       slots, d_model]`` rows for grouped matmuls (``dispatch="grouped"``,
       :class:`~routelab.routing.GroupedPlan`: no padding, static sizes) or gathered into
       ``[E, C, d_model]`` buffers for batched matmuls (``dispatch="buffers"``,
       :class:`~routelab.routing.DispatchPlan`); the outputs are gathered back and summed with
       the combine weights. Both compute the same function; ``dispatch="auto"`` picks buffers
       where they pad nothing (``E * C <= tokens * k``, a capacity factor of at most 1), else
       grouped where grouped matmuls run on the device and dtype and the router proposes
       exactly ``k`` experts per token (:meth:`uses_grouped`).

    Dropped pairs contribute nothing: a token whose every slot is dropped gets a zero output,
    so put the layer in a residual branch (``x + moe(x)[0]``) to carry it.

    The experts protocol: ``experts`` may be any ``nn.Module`` that maps the dispatched buffers
    ``[E, C, d_model]`` (row ``c`` of ``buffers[e]`` is a token routed to expert ``e``; rows past
    the expert's load are zeros whose outputs are discarded) to outputs ``[E, C, d_model]``, expert
    ``e`` acting on ``buffers[e]`` row by row (so dropping or adding padding rows changes no other
    row). The default is :class:`~routelab.layers.StackedExperts` (``gated=True`` or
    ``activation="swiglu"`` for SwiGLU experts; :meth:`~routelab.layers.StackedExperts.from_hf_fused`
    loads transformers' fused expert weights). A module that returns another shape is a ValueError
    at the call that returns it. The grouped form of the protocol, for ``dispatch="grouped"``:
    ``experts(rows [R, d_model], offsets=[E] int32, expert_of_row=[R]) -> [R, d_model]`` (expert
    ``e`` on rows ``offsets[e-1]:offsets[e]``, see
    :meth:`~routelab.layers.StackedExperts.forward_grouped`) and ``experts.grouped_supported(device)
    -> bool``.

    Host synchronisations: with ``check_finite=False`` and grouped dispatch (or a set capacity
    factor), the forward of the ``topk``, ``switch``, ``noisy_topk`` and ``softmax`` routers runs
    without one. The default checks cost one, the router's finite check of its scores, and a
    second (the value check of the routes before the capacity step) with a router that does not
    declare :attr:`~routelab.routers.Router.experts_in_range` or with ``drop_policy="score"``
    (:func:`~routelab.routers.base.routes_need_value_check`). A ``mask`` (the number of real
    tokens) and dropless buffers (the largest load) cost one each.

    Every forward records its weighted auxiliary losses and statistics
    (:class:`routelab.routing.RoutingRecord`): ``routelab.aux_loss(model)`` sums those of every
    routelab layer of a model, ``routelab.routing_stats(model)`` collects the statistics.

    Padding: ``moe(x, mask=mask)`` with ``mask`` a ``BoolTensor`` of ``x.shape[:-1]`` (``True`` =
    a real token) routes the real tokens exactly as ``moe`` routes them without the padding: the
    masked tokens take no capacity, enter no balanced solve, count in no statistic or auxiliary
    loss, and get an exactly zero output (:mod:`routelab.routing.masks`).

    Training and inference: ``capacity_factor`` applies in training, ``eval_capacity_factor``
    (default ``None``, dropless) in ``eval()``. With the routers' default inference modes
    (top-k by each token's own score for the balanced routers, the threshold mask for batchwise
    gating) and a dropless eval capacity, a token's output at inference depends on nothing but
    the token: not on its batch-mates, not on later tokens of its sequence (see the README,
    "Batch-level routing and causal language models").

    ``torch.compile``: the ``softmax``, ``topk`` and ``noisy_topk`` layers compile without graph
    breaks (no mask, no host synchronisation; the finite-score check is skipped while tracing; a
    router's own ``generator`` is one break per draw, so ``fullgraph=True`` needs ``generator=None``).
    Both layouts have static sizes with a capacity factor. Dropless, a bfloat16 layer compiles on
    the grouped layout; other dtypes compile on buffers sized for the worst case, ``C = tokens``
    per expert (``E`` times the dense size): set a ``capacity_factor`` for compiled training. The solvers of
    the balanced routers run eagerly (excluded from tracing).

    Activation checkpointing: the router's noise and the random drop policy's draws are replayed
    in the recomputation (:class:`~routelab.replay.NoiseReplay`), so
    ``torch.utils.checkpoint`` gives the gradients of the uncheckpointed layer.

    The layer is described by one :class:`~routelab.layers.MoEConfig` (its arguments below, but
    ``generator``, ``device`` and ``dtype``): ``MoE.from_config(config)`` builds it from one and
    ``moe.config`` describes a layer.

    Args:
        d_model: token width.
        d_hidden: hidden width of each expert.
        num_experts: ``E``.
        router: a name in :data:`routelab.routers.ROUTERS` (``"topk"``, ``"noisy_topk"``,
            ``"softmax"``, ``"batchwise"``, ``"base"``, ``"sinkhorn"``, ``"gumbel_matching"``,
            ``"switch"``) or a :class:`routelab.routers.Router` instance.
        capacity_factor: ``> 0``, or ``None`` for dropless routing (the buffer then grows to the
            largest expert load of the batch), in training.
        eval_capacity_factor: the same in ``eval()`` mode; ``None`` (the default): dropless.
        k: experts per token for routers that take it (with a router name only).
        router_kwargs: options passed to the router's constructor (with a router name only).
        drop_policy: one of :data:`routelab.routing.DROP_POLICIES` (``"position"``,
            ``"score"``, ``"random"``).
        importance_weighting: combine with ``gate * weight`` (importance weights of stochastic
            routers and the skip correction of eq. 3) instead of ``gate``.
        activation: expert activation (name, gated name such as ``"swiglu"``, or callable).
        bias: expert biases.
        gated: gated (GLU) stacked experts.
        experts: the experts module (the protocol above) instead of the stacked experts built from
            ``d_hidden``, ``activation``, ``bias`` and ``gated``.
        generator: randomness of stochastic routers and of ``drop_policy="random"`` (a
            :class:`torch.Generator` or ``None``; anything else is a TypeError). Assigning
            ``layer.generator`` later sets the router's too.
        check_finite: the router's NaN/inf check of its scores (``None``: the router's setting,
            ``True`` unless changed; ``False`` saves its host sync and that of the capacity
            step's check of the routes, which runs where the router does not vouch for them:
            :func:`~routelab.routers.base.routes_need_value_check`).
        dispatch: ``"auto"`` (default), ``"grouped"`` or ``"buffers"``: how the tokens are laid
            out for the experts (step 3 above; :data:`routelab.layers.config.DISPATCH_MODES`).

    Dtypes:
        ``x`` may be any floating dtype (float16, bfloat16, float32, float64): the router scores
        and routes in float32 (inside ``torch.autocast`` regions too), the experts compute in
        their parameters' dtype (``dtype=``, default float32; under autocast, in its dtype) and
        the output is cast back to ``x``'s dtype. Integer inputs raise a ValueError, as do
        NaN/inf inputs (detected on the router logits, one host sync per call, unless
        ``check_finite=False``).

    Shapes:
        input ``x [..., d_model]`` -> output ``[..., d_model]`` (same dtype) and a
        :class:`~routelab.Routes` over the flattened ``[tokens, slots]``, whose ``aux`` holds
        the router's weighted auxiliary losses and ``stats``: ``tokens_per_expert [E]``,
        ``load_cv`` (coefficient of variation of the kept load), ``dropped_fraction`` (of the
        proposed pairs), ``tokens_dropped`` (fraction of tokens with no expert at all),
        ``capacity``, plus the router's own diagnostics (for the Gumbel-Matching router:
        ``weights_clamped``, the importance weights clamped at
        :data:`routelab.estimators.MAX_WEIGHT`, and ``unreachable_mass``, the router mass per
        token on pairs its weights' reference probability gives 0: with ``gumbel_matching_iw``
        those no balanced sample can reach, which the estimate misses; the biased methods'
        reference is the proposal, positive everywhere, so it reads 0 for them).

    Example:
        >>> moe = MoE(16, 32, 4, router="topk", k=2, capacity_factor=None)  # dropless
        >>> y, routes = moe(torch.randn(2, 5, 16))
        >>> y.shape, routes.stats["tokens_per_expert"].sum().item()  # 10 tokens x 2 experts, none dropped
        (torch.Size([2, 5, 16]), 20)
    """

    #: (router, name, k, router_kwargs, check_finite, settings) of a router built by name (None: an
    #: instance); a class default for layers pickled before it existed
    _router_spec: tuple | None = None

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        *,
        router: str | Router = "topk",
        capacity_factor: float | None = 1.0,
        k: int | None = None,
        router_kwargs: dict[str, Any] | None = None,
        drop_policy: str = "position",
        importance_weighting: bool = False,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        bias: bool = True,
        gated: bool = False,
        experts: nn.Module | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        eval_capacity_factor: float | None = None,
        check_finite: bool | None = None,
        dispatch: str = "auto",
    ) -> None:
        super().__init__()
        config = MoEConfig(d_model, d_hidden, num_experts, router=router, capacity_factor=capacity_factor, k=k,
                           router_kwargs=router_kwargs, drop_policy=drop_policy,
                           importance_weighting=importance_weighting, activation=activation, bias=bias, gated=gated,
                           experts=experts, eval_capacity_factor=eval_capacity_factor, check_finite=check_finite,
                           dispatch=dispatch)
        self._build(config, generator=generator, device=device, dtype=dtype)

    def _build(self, config: MoEConfig, *, generator: torch.Generator | None,
               device: torch.device | str | None, dtype: torch.dtype | None,
               router_device: torch.device | str | None | object = _SAME) -> None:
        """Build the layer's modules from a validated ``config`` (the experts on ``device``, a router
        built by name on ``router_device``, default ``device``)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating dtype (of the layer's parameters), got {dtype!r}")
        if config.experts is not None:
            self.experts = config.experts
        else:
            self.experts = StackedExperts(config.d_model, config.d_hidden, config.num_experts,
                                          activation=config.activation, bias=config.bias, gated=config.gated,
                                          device=device, dtype=dtype)
        self._custom_experts = config.experts is not None
        self.dispatch = config.dispatch
        self._d_hidden = config.d_hidden
        self.router = config.build_router(device if router_device is _SAME else router_device)
        check_capacity_for(self.router, config.capacity_factor)
        check_capacity_for(self.router, config.eval_capacity_factor, eval=True)
        # what `config` reports while this router is the layer's, as built: its name and options
        object.__setattr__(self, "_router_spec", None if isinstance(config.router, Router) else
                           (self.router, config.router, config.k, config.router_kwargs, config.check_finite,
                            _router_settings(self.router, config.router)))
        self.d_model, self.num_experts = config.d_model, config.num_experts
        self.capacity_factor = config.capacity_factor
        self.eval_capacity_factor = config.eval_capacity_factor
        self.drop_policy = config.drop_policy
        self._replay = NoiseReplay()
        self.importance_weighting = config.importance_weighting
        self._activation = config.activation
        check_generator(generator)
        self.__dict__["_generator"] = generator  # (a router passed with a generator of its own keeps it)
        if generator is not None:
            self.router.generator = generator

    @property
    def generator(self) -> torch.Generator | None:
        """The randomness of ``drop_policy="random"`` and, when set, of the router (``None``:
        torch's global generator). Assigning it sets the router's ``generator`` too (``None``
        included), so that one seed keeps reproducing a run; anything but a
        :class:`torch.Generator` or ``None`` is a TypeError at the assignment."""
        return self.__dict__.get("_generator")

    @generator.setter
    def generator(self, value: torch.Generator | None) -> None:
        check_generator(value, "generator")
        self.__dict__["_generator"] = value
        router = self._modules.get("router")
        if router is not None and hasattr(router, "generator"):
            router.generator = value

    @classmethod
    def from_config(cls, config: MoEConfig, *, generator: torch.Generator | None = None,
                    device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MoE:
        """The layer a :class:`~routelab.layers.MoEConfig` describes (``generator``, ``device`` and
        ``dtype`` as in the constructor)."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a routelab.layers.MoEConfig, got {type(config).__name__}")
        return cls(**config.layer_kwargs(), generator=generator, device=device, dtype=dtype)

    @property
    def config(self) -> MoEConfig:
        """The :class:`~routelab.layers.MoEConfig` of the layer as it is now (``capacity_factor`` and
        the other options as currently set).

        A router built by name, with its options as built, is described by its name, ``k`` and
        ``router_kwargs``, so that ``MoE.from_config(layer.config)`` builds a layer with a router of
        its own (and ``config.replace(router=...)`` keeps ``k``); a router given as an instance,
        assigned since, or whose options (``k``, ``router_kwargs``' names) were changed since, is
        described by the instance, which a layer built from the config then shares, as it shares
        a custom ``experts`` module."""
        spec = self._router_spec
        if spec is not None and spec[0] is self.router and spec[5] == _router_settings(self.router, spec[1]):
            _, name, k, router_kwargs, check_finite, _ = spec
            if self.router.check_finite != (True if check_finite is None else check_finite):
                check_finite = self.router.check_finite
            router = dict(router=name, k=k, router_kwargs=router_kwargs, check_finite=check_finite)
        else:
            router = dict(router=self.router, check_finite=self.router.check_finite)
        if self._custom_experts:
            return MoEConfig(self.d_model, self._d_hidden, self.num_experts, **router,
                             capacity_factor=self.capacity_factor, drop_policy=self.drop_policy,
                             importance_weighting=self.importance_weighting, activation=self._activation,
                             experts=self.experts, eval_capacity_factor=self.eval_capacity_factor,
                             dispatch=self.dispatch)
        return MoEConfig(self.d_model, self.experts.d_hidden, self.num_experts, **router,
                         capacity_factor=self.capacity_factor, drop_policy=self.drop_policy,
                         importance_weighting=self.importance_weighting, activation=self._activation,
                         bias=self.experts.b1 is not None, gated=self.experts.gated,
                         eval_capacity_factor=self.eval_capacity_factor, dispatch=self.dispatch)

    @property
    def active_capacity_factor(self) -> float | None:
        """The capacity factor of the current mode: ``capacity_factor`` in training,
        ``eval_capacity_factor`` in ``eval()`` (``None``: dropless)."""
        return self.capacity_factor if self.training else self.eval_capacity_factor

    def capacity(self, num_tokens: int) -> int:
        """Per-expert capacity for a batch of ``num_tokens`` real tokens in the current mode
        (``num_tokens`` when dropless)."""
        return expert_capacity(num_tokens, self.num_experts, self.router.slots, self.active_capacity_factor)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """As ``nn.Module``'s; an :class:`~routelab.parallel.ExpertParallelMoE` checkpoint records the
        shard of experts it holds (``_extra_state``): one holding all of them (world size 1) loads
        here, a partial one is a ValueError that says so (not a bare size mismatch)."""
        shard = state_dict.get(prefix + "_extra_state") if type(self).get_extra_state is nn.Module.get_extra_state \
            else None
        partial = isinstance(shard, dict) and "expert_offset" in shard and (
            shard.get("local_experts") != self.num_experts or shard.get("expert_offset") != 0)
        if partial:  # before anything is loaded
            raise ValueError(
                f"this state_dict is one rank's shard of an ExpertParallelMoE ({shard}), not all "
                f"{self.num_experts} experts: gather the ranks' experts first, or load it into the "
                "ExpertParallelMoE of that rank")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if isinstance(shard, dict) and "expert_offset" in shard:
            if prefix + "_extra_state" in unexpected_keys:
                unexpected_keys.remove(prefix + "_extra_state")

    def forward(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Routes]:
        """Apply the layer.

        Args:
            x: ``[..., d_model]``.
            mask: optional ``BoolTensor`` of ``x.shape[:-1]``, ``True`` for real tokens (e.g.
                ``attention_mask.bool()``): the others are routed nowhere and get a zero output.

        Returns:
            ``(y [..., d_model], routes)``; ``routes`` is over the flattened tokens (masked
            tokens: ``keep`` False, ``gate`` 0); ``aux`` and ``stats`` cover the real tokens.
        """
        self.forget_routing()  # the last step's graph goes before this one is built (record.py)
        compute = floating_input(x, "x", self._experts_dtype(x))
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [..., d_model={self.d_model}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        mask = token_mask(mask, lead)
        tokens = x.reshape(-1, self.d_model)  # the router scores it in float32 itself
        flat = compute.reshape(-1, self.d_model)
        index = None
        if mask is not None:  # route the real tokens alone (one host sync: how many there are)
            index = real_tokens(mask)
            tokens, flat = tokens.index_select(0, index), flat.index_select(0, index)
        capacity = self.capacity(flat.shape[0])
        proposed = self.router(tokens, capacity)
        grouped = self.uses_grouped(proposed.expert.shape[-1], flat.device, num_tokens=flat.shape[0])
        routes, plan = self.plan(proposed, capacity, grouped=grouped)
        combine = routes.gate * routes.weight if self.importance_weighting else routes.gate
        # Also when nothing is kept (capacity 0): the experts then run on empty buffers, and the
        # zero output stays part of the graph (its gradients are zeros, not an autograd error).
        inputs = plan.dispatch(flat)
        if grouped:
            # Through the module call (not forward_grouped directly): its hooks fire as on buffers.
            out = self.experts(inputs, offsets=plan.offsets, expert_of_row=plan.expert_of_row)
        else:
            out = self.experts(inputs)
        if not isinstance(out, Tensor) or out.shape != inputs.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            layout = "rows [R, d_model]" if grouped else "buffers [E, C, d_model]"
            raise ValueError(f"experts ({type(self.experts).__name__}) must map {layout} = "
                             f"{tuple(inputs.shape)} to the same shape, got {got}")
        y = plan.combine(out, combine).to(x.dtype)
        self.record_routing(routes.aux, routes.stats)
        if index is not None:
            y = y.new_zeros(lead.numel(), self.d_model).index_copy(0, index, y)
            routes = scatter_routes(routes, index, lead.numel(), check=False)
        return y.reshape(*lead, self.d_model), routes

    def _experts_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype the experts compute in: their first floating parameter's (else ``x``'s)."""
        for p in self.experts.parameters():
            if p.is_floating_point():
                return p.dtype
        return x.dtype if isinstance(x, Tensor) and x.is_floating_point() else torch.float32

    def uses_grouped(self, slots: int, device: torch.device, *, num_tokens: int | None = None) -> bool:
        """Whether a forward whose routes have ``slots`` columns dispatches grouped (see ``dispatch``).

        ``dispatch="auto"`` picks grouped where grouped matmuls run here and the router proposes
        exactly its ``k`` experts per token, unless a capacity factor is in force and the ``[E, C]``
        buffers hold no more rows than the grouped layout's ``tokens * slots`` (``E * C <=
        tokens * slots``, a capacity factor of at most 1): buffers then pad nothing and take fewer
        operations (measured faster on an H200 in bfloat16 and on the CPU in float32: the README's
        "On a GPU").

        Args:
            slots: the routes' columns.
            device: where the tokens are.
            num_tokens: the (real) tokens of the forward; ``None``: the layout without the buffer
                comparison (as for a dropless layer).

        Raises:
            ValueError: ``dispatch="grouped"`` where the experts cannot run grouped on ``device``.
        """
        if self.dispatch == "buffers":
            return False
        supported = _groups(self.experts) and self.experts.grouped_supported(device)
        if self.dispatch == "grouped":
            if not supported:
                explain = getattr(self.experts, "grouped_unsupported_reason", None)
                why = explain(device) if callable(explain) else None
                name = type(self.experts).__name__
                why = why or (f"{name}.grouped_supported({device}) is False" if _groups(self.experts) else
                              f"{name} has no grouped form (forward(rows, offsets=, expert_of_row=))")
                raise ValueError(f"dispatch='grouped' cannot run here: {why}; use dispatch='auto' or 'buffers'")
            return True
        if not (supported and slots == self.router.slots):
            return False
        if num_tokens is not None and self.active_capacity_factor is not None:
            return self.num_experts * self.capacity(num_tokens) > num_tokens * slots
        return True

    def plan(self, proposed: Routes, capacity: int, *, grouped: bool = False
             ) -> tuple[Routes, DispatchPlan | GroupedPlan]:
        """Enforce capacity on a router's proposal and plan the dispatch.

        Args:
            proposed: the router's routes ``[tokens, slots]``.
            capacity: ``C``, pairs per expert.
            grouped: plan expert-sorted rows (:class:`~routelab.routing.GroupedPlan`) instead of
                ``[E, C, d_model]`` buffers (:class:`~routelab.routing.DispatchPlan`).

        Returns:
            ``(routes, plan)``: ``routes`` with ``keep`` after capacity, ``weight`` times the
            skip correction, and the layer's ``stats``.
        """
        E = self.num_experts
        # (recorded for checkpointing's replay in training only, as the routers' noise: an eval
        # forward between a checkpointed forward and its backward must not push a record)
        random = self.drop_policy == "random" and self.training
        # Dropless and grouped: no limit at all (every proposed pair; rows are one per pair), which
        # apply_capacity plans without the dropping steps. Buffers keep the token count: compiled,
        # they are sized C = tokens, so a router that names an expert twice for a token must not
        # place more than that. (``capacity``, the token count, is also what the router was told.)
        limit = proposed.expert.numel() if self.active_capacity_factor is None and grouped else capacity
        # The routes' value check (a host sync), where the router cannot vouch for them.
        check = routes_need_value_check(self.router, self.drop_policy)
        if limit >= proposed.expert.numel() and grouped and self.drop_policy != "score":
            # Nothing can drop: the decision and the plan from one sort (the same as below, in
            # half the operations; "random" draws nothing at this limit).
            decision, plan = decide_and_plan_dropless(proposed.expert, proposed.keep, E, check=check)
        else:
            with self._replay.draw(self.generator if random else None):
                decision = apply_capacity(proposed.expert, proposed.keep, limit, E, policy=self.drop_policy,
                                          score=proposed.gate, generator=self.generator, check=check)
            plan = GroupedPlan.build(proposed.expert, decision.keep, decision.position, decision.kept, E) \
                if grouped else None
        keep = decision.keep
        weight = proposed.weight * decision.skip_weight.to(proposed.weight.dtype)
        if grouped:
            # Dropless: the capacity statistic is the largest load, kept on the device (no sync).
            stat_capacity = decision.kept.max() if self.active_capacity_factor is None else capacity
            stats = {**proposed.stats, **load_stats(proposed.keep, decision, stat_capacity)}
            return Routes(expert=proposed.expert, gate=proposed.gate, keep=keep, weight=weight,
                          log_prob=proposed.log_prob, aux=dict(proposed.aux), stats=stats), plan
        if self.active_capacity_factor is None and checks_run():
            # Dropless: the buffer only needs the largest load (one host sync). While
            # torch.compile traces, the buffer keeps the worst case C = tokens (no sync).
            capacity = int(decision.load.max()) if decision.load.numel() else 0
        # apply_capacity's positions are valid by construction: no second host sync to check them.
        plan = DispatchPlan.build(proposed.expert, keep, decision.position, E, capacity, check=False)
        # The router's own diagnostics (e.g. weights_clamped), then the layer's.
        stats = {**proposed.stats, **load_stats(proposed.keep, decision, capacity)}
        routes = Routes(expert=proposed.expert, gate=proposed.gate, keep=keep, weight=weight,
                        log_prob=proposed.log_prob, aux=dict(proposed.aux), stats=stats)
        return routes, plan

    def extra_repr(self) -> str:
        return (f"capacity_factor={self.capacity_factor}, eval_capacity_factor={self.eval_capacity_factor}, "
                f"drop_policy={self.drop_policy!r}, "
                f"importance_weighting={self.importance_weighting}")


def _router_settings(router: Router, name: str) -> tuple:
    """The router's current ``k`` (slots) and the values of its options (those ``router_kwargs``
    can set), to tell whether it is still configured as built."""
    return (router.slots, *(repr(getattr(router, option, None)) for option in router_options(name)))
