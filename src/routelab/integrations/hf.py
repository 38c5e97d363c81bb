"""routelab routers inside Hugging Face transformers' sparse MoE blocks: :func:`patch_moe`.

transformers (5.x) builds the sparse MoE block of Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE, MiniMax,
DeepSeek-V2, GPT-OSS, Jamba, GraniteMoE, PhiMoE and others from two modules, called by the block's own
``forward``::

    router_logits, routing_weights, selected_experts = block.gate(hidden_states)   # [n, E], [n, k], [n, k]
    out = block.experts(hidden_states, selected_experts, routing_weights)          # [n, d]

with the routing module named ``gate`` or ``router`` (:data:`ROUTING_CHILDREN`), scoring with
``weight [E, d]`` and optionally ``bias [E]`` (``router_logits = hidden_states @ weight.T + bias``),
held by the gate itself or by its one ``nn.Linear`` child (HunYuan's ``wg``, DBRX's ``layer``),
and ``experts`` fused experts (``gate_up_proj``, ``down_proj``) that skip the index ``E``
(transformers' sentinel for "no expert"). :func:`patch_moe` keeps the block, its ``forward``
(shared experts, jitter noise and all), its experts and its router weight, and changes only what the
two modules compute:

* the gate scores with a routelab :class:`~routelab.routers.Router` whose ``proj.weight`` *is*
  the gate's ``weight`` (and ``proj.bias`` its ``bias``: one parameter each, so the optimiser
  state stays meaningful), enforces the capacity (:func:`routelab.routing.apply_capacity`) and
  answers in transformers' contract: ``(router_logits [n, E], weights [n, S], experts [n, S])``
  with the sentinel ``E`` and weight 0 in every slot the router did not propose or the capacity
  dropped (``S`` = the router's slots);
* the experts receive only the kept (token, expert) pairs: when a slot holds the sentinel they run
  on the gathered pairs ``[P, d]`` (one expert each) and the outputs are added back per token, so
  the expert compute is proportional to the routed pairs for every router (batchwise gating's
  ``E`` slots per token, most of them empty, never reach the experts).

Finding the blocks and reading what the model's own gate computes live in
:mod:`routelab.integrations.hf_blocks` (re-exported here). The gate is read by running a
parameter-fresh copy of it (:func:`probe_gate`): softmax top-k with or without renormalisation over the chosen experts
(Mixtral and GPT-OSS renormalise, Jamba and OLMoE do not), times a constant (DeepSeek's
``routed_scaling_factor``), sets ``patch_moe``'s default ``renormalize`` and the patched gate's
``combine_scale``, so ``router="topk"`` reproduces the unpatched model. A gate with a rule of its own
(PhiMoE's sparsemixer, DeepSeek-V3's bias-corrected sigmoid top-k, MiniMax-M2's selection bias passed
in by its block) is replaced with a warning saying so; such a gate's outputs are read on the block's
tensors of those inputs' names, where it holds them. The gate's outputs are read by their roles
(:func:`probe_gate`), so the older contracts of transformers 5.17 are patched too: GraniteMoE's
gate returns ``(experts, weights, router_logits)`` (the patched gate answers in that order), and
Jamba's returns its logits alone, which its block routes with ``route_tokens_to_experts`` (the
patched block's method then returns the patched gate's routing). Blocks that route by another
contract are refused with a ValueError naming the block and the reason: experts not called with
the routing (Llama-4), a routing module without a ``weight [E, d]``, of its own or in one child.

Both modules keep their class's name, parameters, buffers and hooks: the patch swaps their class
for a subclass (as ``torch.nn.utils.parametrize`` does), so transformers' ``output_router_logits``
recorder (a hook on the gate class) and its load-balancing loss keep working (that loss is
transformers' formula on the router logits with the model's top-k, blind to the routelab router's
decisions; the router's own losses are in ``routelab.aux_loss(model)``). The padding mask
``attention_mask [batch, seq]`` of the model's call reaches the gates through forward hooks
(:mod:`routelab.integrations.hf_masks`), also when activation checkpointing recomputes a block.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import check_capacity_factor, check_flag, check_generator, check_positive_int
from ..replay import NoiseReplay
from ..routers import ROUTERS, Router, make_router, router_name, router_options
from ..routers.base import check_capacity_for, proposes_every_slot, routes_need_value_check
from ..routing import DROP_POLICIES, RoutingRecord, apply_capacity, expert_capacity, load_stats
from .hf_blocks import (
    CONTRACT,
    ROUTE_METHOD,
    ROUTING_CHILDREN,
    GateRule,
    block_problem,
    gate_scorer,
    probe_gate,
    replaced_rule,
    routing_child,
    scorer_key,
    scorer_parameter,
    sparse_moe_blocks,
)
from .hf_masks import CallMasks
from .hf_masks import install as install_masks
from .hf_state import load_router_state_dict, router_state_dict

__all__ = ["ROUTING_CHILDREN", "GateProjection", "GateRule", "RoutedExperts", "RoutedGate", "load_router_state_dict",
           "patch_moe", "probe_gate", "router_state_dict", "routing_child", "sparse_moe_blocks"]

RouterFactory = Callable[[int, int, int], Router]


def _accepts_mask(router: Router) -> bool:
    """Whether ``router.forward`` takes a ``mask=`` keyword (the token-mask interface of the routers)."""
    try:
        params = inspect.signature(router.forward).parameters
    except (TypeError, ValueError):
        return False
    return "mask" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class GateProjection(nn.Module):
    """The ``proj`` of a routelab router inside a patched gate: its ``weight`` (and ``bias``) *are* the gate's
    (those of the module the gate scores with: the gate itself or its one Linear child, :func:`gate_scorer`).

    They are read through the gate at every access instead of being registered twice, so no module
    conversion can untie them (``to_empty`` from the meta device makes a new parameter per
    registration), the model's ``state_dict()`` keeps its own keys, and a transformers checkpoint
    loads into a patched model as into the unpatched one.
    """

    def __init__(self, scorer: nn.Module, with_bias: bool) -> None:
        """``scorer``: the module holding the gate's ``weight`` (the gate, or its Linear child);
        ``with_bias``: its ``bias`` enters the logits."""
        super().__init__()
        object.__setattr__(self, "_scorer", scorer)  # not a submodule: the model holds it already
        self._with_bias = bool(with_bias)

    @property
    def weight(self) -> Tensor:
        """The gate's ``weight [E, d]``."""
        return self._scorer.weight

    @property
    def bias(self) -> Tensor | None:
        """The gate's ``bias [E]`` when its logits include it (GPT-OSS), else None."""
        return self._scorer.bias if self._with_bias else None

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class _BlockState:
    """What a patched gate tells the experts of its block about the routing it just returned (and,
    for a gate that returns its logits alone, the routing itself, for the block's route method)."""

    def __init__(self) -> None:
        #: ``(experts, weights)`` of the last forward of a logits-only gate, until the block's
        #: route method (:data:`ROUTE_METHOD`) takes them.
        self.routes: tuple[Tensor, Tensor] | None = None
        #: the expert indices ``[n, S]`` the gate last returned, when it knows (without looking at
        #: them) that every slot names an expert: no capacity, no mask, a router that proposes every
        #: slot. The experts trust it once, for that very tensor unchanged, then forget it.
        self.fully_routed: Tensor | None = None
        #: its version counter then (an in-place change since, by a hook say, voids the promise).
        self.version = 0


class RoutedGate(RoutingRecord):
    """The routing of a patched transformers gate (mixed into the gate's own class by :func:`patch_moe`).

    Attributes (set by :func:`patch_moe`):
        router: the routelab router; ``router.proj.weight`` is the gate's ``weight``.
        capacity_factor, eval_capacity_factor: capacity in training and in ``eval()`` (``None``:
            dropless).
        drop_policy: the capacity's drop policy.
        importance_weighting: combine with ``gate * weight`` (the router's importance weight
            times the skip correction ``n_z / min(n_z, C)`` of Kool et al. eq. 3) instead of ``gate``.
        aux_coef: multiplies the router's (already weighted) auxiliary losses in the record.
        combine_scale: multiplies the combine weights: the constant the model's own gate puts on its
            weights (:attr:`GateRule.scale`, DeepSeek's ``routed_scaling_factor``), 1.0 for most models.
        weights_in_input_dtype: return the combine weights in the hidden states' dtype, as the
            model's own gate does (:attr:`GateRule.input_dtype_weights`), instead of float32.
    """

    router: Router
    capacity_factor: float | None
    eval_capacity_factor: float | None
    drop_policy: str
    importance_weighting: bool
    aux_coef: float
    combine_scale: float
    weights_in_input_dtype: bool = False
    _routelab_mask: CallMasks
    _routelab_replay: NoiseReplay
    _routelab_takes_mask: bool
    _routelab_generator: torch.Generator | None
    _routelab_state: _BlockState
    #: the roles of the model's gate's outputs, in its order (:attr:`GateRule.outputs`)
    _routelab_outputs: tuple[str, ...] = CONTRACT

    def _token_mask(self, num_tokens: int) -> Tensor | None:
        """The token mask of this forward: the model call's, or, when activation checkpointing
        recomputes the gate inside the backward pass, the one of the forward it recomputes
        (:class:`~routelab.integrations.hf_masks.CallMasks`)."""
        return self._routelab_mask.tokens(num_tokens)

    def forward(self, hidden_states: Tensor, *_own_inputs: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Route ``hidden_states [..., d]`` (flattened to ``[n, d]``) with the routelab router.

        Inputs of the model's own rule that its block passes after the hidden states (MiniMax-M2's
        ``e_score_correction_bias``) are not used: :func:`patch_moe` warned of them.

        Returns:
            transformers' router contract: ``router_logits [n, E]`` (float32), combine weights
            ``[n, S]`` (float32, or the hidden states' dtype where the model's gate returns them
            so; 0 where not routed) and experts ``[n, S]`` (``E`` where not routed); in the order
            of the model's own gate (:attr:`GateRule.outputs`), or the logits alone where its
            block routes them with :data:`ROUTE_METHOD` (which then returns this routing).
        """
        self.forget_routing()  # the last step's graph goes before this one is built (record.py)
        router = self.router
        E = router.num_experts
        x = hidden_states.reshape(-1, router.d_model)
        n = x.shape[0]
        mask = self._token_mask(n)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        # Padding takes no capacity: C counts the real tokens. That is one host sync, and the
        # router's own routing of the real tokens a second (MoE(mask=) needs one: it routes the
        # real tokens alone).
        real = n if mask is None else int(mask.sum())
        capacity = expert_capacity(real, E, router.slots, factor)
        if mask is not None and self._routelab_takes_mask:
            proposed = router(x, capacity, mask=mask)
        else:
            proposed = router(x, capacity)
        candidate = proposed.keep if mask is None else proposed.keep & mask.unsqueeze(-1)
        random = self.drop_policy == "random" and self.training
        # Dropless: no limit at all (every proposed pair), planned without the dropping steps.
        limit = candidate.numel() if factor is None else capacity
        with self._routelab_replay.draw(self._routelab_generator if random else None):
            decision = apply_capacity(proposed.expert, candidate, limit, E, policy=self.drop_policy,
                                      score=proposed.gate, generator=self._routelab_generator,
                                      check=routes_need_value_check(router, self.drop_policy))
        keep = decision.keep
        combine = proposed.gate.float()
        if self.combine_scale != 1.0:  # the model's routed_scaling_factor (GateRule.scale)
            combine = combine * self.combine_scale
        if self.importance_weighting:
            combine = combine * (proposed.weight * decision.skip_weight.to(proposed.weight.dtype)).float()
        weights = torch.where(keep, combine, torch.zeros((), dtype=combine.dtype, device=combine.device))
        if self.weights_in_input_dtype and hidden_states.is_floating_point():
            weights = weights.to(hidden_states.dtype)
        experts = torch.where(keep, proposed.expert, torch.full_like(proposed.expert, E))
        # Known without looking at the data (no host sync): every slot reaches an expert when
        # nothing drops (no capacity, no mask) and the router proposes every slot.
        fully_routed = mask is None and factor is None and proposes_every_slot(router)
        state = self._routelab_state
        state.fully_routed = experts if fully_routed else None
        if fully_routed and not torch.compiler.is_compiling():  # (a version is data Dynamo cannot guard)
            state.version = experts._version
        aux = {name: value * self.aux_coef for name, value in proposed.aux.items()}
        self.record_routing(aux, {**proposed.stats, **load_stats(candidate, decision, capacity, tokens=mask)})
        # transformers' load-balancing loss (output_router_logits) reads the router logits; one more
        # [n, d] x [d, E] product, small next to the experts' [n k, d] x [d, 2I] ones.
        logits = router.logits(x)
        if self._routelab_outputs == ("logits",):  # the block routes the logits itself: it gets these
            state.routes = (experts, weights)
            return logits
        found = {"logits": logits, "weights": weights, "experts": experts}
        return tuple(found[role] for role in self._routelab_outputs)


class RoutedExperts:
    """Fused transformers experts that run only on kept pairs (mixed into their class by :func:`patch_moe`).

    ``forward(hidden_states [n, d], top_k_index [n, S], top_k_weights [n, S]) -> [n, d]`` (or the
    hidden states as ``[batch, seq, d]``, for experts that flatten them themselves, as DBRX's): when
    every slot holds an expert, the experts' own forward runs unchanged; otherwise it runs on the
    ``P`` kept pairs (``hidden_states[token]``, one expert each) and the outputs are summed per
    token, so the compute is proportional to ``P`` whatever implementation the experts use (twice
    that for experts that cannot take one slot per row: :meth:`_two_slots`). Under torch.compile,
    which cannot trace the host read that finds the kept pairs, every slot runs, a left-out one on
    expert 0 at weight 0: the model compiles whole, equal to eager wherever the experts' outputs are
    finite, at the dropless compute.
    """

    _routelab_num_experts: int
    _routelab_state: _BlockState

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        E = self._routelab_num_experts
        state = self._routelab_state
        told = state.fully_routed is top_k_index and (
            torch.compiler.is_compiling() or top_k_index._version == state.version)
        state.fully_routed = None
        if told:  # the gate's own indices, unchanged, which it knows name an expert in every slot: no sync
            return self._every_slot(hidden_states, top_k_index, top_k_weights)
        routed = (top_k_index >= 0) & (top_k_index < E)
        if torch.compiler.is_compiling():  # no host read while tracing: every slot runs, the left-out at weight 0
            return self._every_slot(hidden_states, torch.where(routed, top_k_index, 0),
                                    torch.where(routed, top_k_weights, 0))
        if bool(routed.all()):  # one host sync
            return self._every_slot(hidden_states, top_k_index, top_k_weights)
        token, slot = routed.nonzero(as_tuple=True)
        if token.numel() == 0:  # nothing routed (e.g. a batch of padding): no expert runs
            return hidden_states.new_zeros(hidden_states.shape)
        # [n, d]; DBRX's experts take and return the block's [batch, seq, d] and flatten it themselves
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        rows, index, weights = flat[token], top_k_index[token, slot].unsqueeze(-1), top_k_weights[token, slot]
        if getattr(self, "_routelab_two_slots", False):
            out = self._two_slots(rows, index, weights)
        else:
            try:
                out = super().forward(rows, index, weights.unsqueeze(-1))  # type: ignore[misc]
            except (IndexError, ValueError, RuntimeError) as error:
                if isinstance(error, (torch.OutOfMemoryError, torch.AcceleratorError)):
                    raise
                out = self._two_slots(rows, index, weights, error)
        out = out.reshape(-1, flat.shape[-1]).to(hidden_states.dtype)
        return flat.new_zeros(flat.shape).index_add(0, token, out).view(hidden_states.shape)

    def _every_slot(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The experts' own forward when every slot names an expert; with one slot per token (a
        ``k = 1`` router), through :meth:`_two_slots` for experts that fail on one (LongCat-Flash)."""
        if top_k_index.shape[-1] != 1:
            return super().forward(hidden_states, top_k_index, top_k_weights)  # type: ignore[misc]
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        if getattr(self, "_routelab_two_slots", False):
            out = self._two_slots(flat, top_k_index, top_k_weights[:, 0])
        else:
            try:
                return super().forward(hidden_states, top_k_index, top_k_weights)  # type: ignore[misc]
            except (IndexError, ValueError, RuntimeError) as error:
                if isinstance(error, (torch.OutOfMemoryError, torch.AcceleratorError)):
                    raise
                out = self._two_slots(flat, top_k_index, top_k_weights[:, 0], error)
        return out.reshape(hidden_states.shape).to(hidden_states.dtype)

    def _two_slots(self, rows: Tensor, index: Tensor, weights: Tensor, error: Exception | None = None) -> Tensor:
        """The kept pairs as rows of two slots, the pair's expert twice with weights ``(w/2, w/2)``
        (halving is exact, so the sum is ``w * y`` to the bit, and an infinite ``y`` stays infinite):
        for experts that fail on one slot per row (LongCat-Flash's and NLLB-MoE's ``squeeze(0)`` of
        an ``[1, P]`` mask), at twice the expert compute. Learnt on the first failure (``error``),
        which is raised, with the cause said, when two slots fail too."""
        half = weights / 2
        try:
            out = super().forward(rows, index.expand(-1, 2), torch.stack([half, half], dim=-1))  # type: ignore[misc]
        except (IndexError, ValueError, RuntimeError) as again:
            if error is None or isinstance(again, (torch.OutOfMemoryError, torch.AcceleratorError)):
                raise
            raise RuntimeError(
                f"the experts ({type(self).__name__}) failed on the kept (token, expert) pairs, passed one per row "
                f"(hidden_states [P, d], top_k_index [P, 1]) and as two slots of one expert, as a patched block runs "
                f"them whenever slots are left out (a padding attention_mask, a capacity_factor, a router that does "
                f"not propose every slot); the experts' error: {type(error).__name__}: {error}") from error
        if error is not None:
            object.__setattr__(self, "_routelab_two_slots", True)
        return out


def _route_by_gate(self: nn.Module, *_inputs: Any, **_kwargs: Any) -> tuple[Tensor, ...]:
    """The :data:`ROUTE_METHOD` of a block whose gate returns its logits alone, bound to the block
    by :func:`patch_moe`: it ignores its inputs (the hidden states, the router logits) and returns
    the routing that the block's patched gate just computed, in the order of the model's own
    method (:attr:`GateRule.block_routes`). It finds the gate through the block at every call, so a
    deep copy of the model (which rebinds the method to the copied block) routes with its own."""
    gate = routing_child(self)[1]
    state = gate._routelab_state
    routes, state.routes = state.routes, None
    if routes is None:
        raise RuntimeError(f"{ROUTE_METHOD} of a block patched by routelab was called without its gate "
                           "routing first: the block routes with the routing its patched gate computed")
    found = dict(zip(("experts", "weights"), routes, strict=True))
    return tuple(found[role] for role in gate._routelab_block_routes)


class _BlockRoute:
    """The patched block's :data:`ROUTE_METHOD`: :func:`_route_by_gate` bound to the block, as an
    object (a bound function would not pickle: pickle looks a bound method up by its name)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *inputs: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        return _route_by_gate(self.block, *inputs, **kwargs)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _patched_class(mixin: type, base: type) -> type:
    """The class ``(mixin, base)`` that :func:`_swap_class` gives a module of class ``base``, made once."""
    cls = _SUBCLASSES.get((base, mixin))
    if cls is None:
        cls = type(base.__name__, (mixin, base), {"__module__": __name__, "__qualname__": base.__qualname__,
                                                   "__reduce_ex__": _reduce_patched})
        _SUBCLASSES[(base, mixin)] = cls
    return cls


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Make ``module`` an instance of ``(mixin, type(module))``, named after its class (as parametrize does)."""
    module.__class__ = _patched_class(mixin, type(module))


def _reduce_patched(module: nn.Module, protocol: int) -> tuple:
    """Pickle (and deep-copy) a patched module by its mixin and original class, which pickle can
    find by name, instead of the class made at patch time, which it cannot: a whole patched model
    then saves (``torch.save(model)``) and loads in a fresh process."""
    mixin, base = type(module).__bases__
    return _new_patched, (mixin, base), module.__getstate__()


def _new_patched(mixin: type, base: type) -> nn.Module:
    """An empty instance of the patched class of ``base`` (its state follows: ``nn.Module.__setstate__``)."""
    cls = _patched_class(mixin, base)
    return cls.__new__(cls)


def _model_norm_topk(gate: nn.Module, model: nn.Module) -> bool:
    """The model's top-k normalisation: the gate's (or config's) ``norm_topk_prob``; Mixtral always normalises."""
    value = getattr(gate, "norm_topk_prob", None)
    if value is None:
        value = getattr(getattr(model, "config", None), "norm_topk_prob", None)
    return True if value is None else bool(value)


def _build_router(router: str | RouterFactory, d_model: int, num_experts: int, k: int, k_given: bool,
                  renormalize: bool, router_kwargs: dict[str, Any]) -> Router:
    """One router for one block: by name (the model's ``k`` where the router takes one) or from a factory."""
    if isinstance(router, str):
        name = router_name(router)
        kwargs = dict(router_kwargs)
        if "renormalize" in router_options(name):
            kwargs.setdefault("renormalize", renormalize)
        try:
            return make_router(name, d_model, num_experts, k=k, **kwargs)
        except ValueError as error:
            if k_given or "k=" not in str(error):
                raise
            # The router cannot take the model's k (e.g. one expert per token): its own k, said aloud.
            built = make_router(name, d_model, num_experts, **kwargs)
            warnings.warn(f"router {name!r} cannot route to the model's k={k} experts per token ({error}); "
                          f"it routes each token to {built.slots}", stacklevel=3)
            return built
    if isinstance(router, Router):
        raise ValueError("router must be a router name or a factory (d_model, num_experts, k) -> Router: every "
                         "MoE block needs its own router, so a single Router instance cannot be shared")
    if not callable(router):
        raise ValueError(f"router must be a router name ({', '.join(ROUTERS)}) or a factory "
                         f"(d_model, num_experts, k) -> Router, got {type(router).__name__}")
    if router_kwargs:
        raise ValueError("router_kwargs go with a router name; configure the routers your factory builds directly")
    built = router(d_model, num_experts, k)
    if not isinstance(built, Router):
        raise ValueError(f"the router factory must return a routelab.routers.Router, got {type(built).__name__}")
    if built.d_model != d_model or built.num_experts != num_experts:
        raise ValueError(f"the router factory built a router for d_model={built.d_model}, num_experts="
                         f"{built.num_experts}; the block has d_model={d_model}, num_experts={num_experts}")
    return built



def _model_k(gate: nn.Module, rule: Any, model: nn.Module) -> int | None:
    """The experts per token of the model's own ``gate``: its ``top_k``, its probed rule's ``k``, the
    config's ``num_experts_per_tok``, or the ``Top<k>`` of its class name (NLLB-MoE's
    ``NllbMoeTop2Router``, which says it nowhere else); None when none says it (defaulting to 1
    patched NLLB-MoE's top-2 as top-1, a review found)."""
    for value in (getattr(gate, "top_k", None), rule.k,
                  getattr(getattr(model, "config", None), "num_experts_per_tok", None)):
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
            return int(value)
    named = re.search(r"Top(\d+)", type(gate).__name__)
    return int(named.group(1)) if named else None

def patch_moe(
    model: nn.Module,
    router: str | RouterFactory = "topk",
    *,
    k: int | None = None,
    capacity_factor: float | None = None,
    eval_capacity_factor: float | None = None,
    drop_policy: str = "position",
    importance_weighting: bool = False,
    renormalize: bool | None = None,
    router_kwargs: dict[str, Any] | None = None,
    aux_coef: float = 1.0,
    generator: torch.Generator | None = None,
    check_finite: bool = True,
) -> list[nn.Module]:
    """Route every sparse MoE block of a transformers model with a routelab router.

    Keeps the model's experts, router weight and block code; see the module docstring for how.
    A gate whose own rule is not softmax top-k (PhiMoE's sparsemixer) is replaced with a UserWarning.
    With ``router="topk"`` and the defaults the patched model computes what the unpatched one does
    (the model's ``k``, its top-k normalisation, dropless). Train with ``loss + routelab.aux_loss(model)``
    (the routers' own auxiliary losses) and/or transformers' ``output_router_logits=True``
    load-balancing loss, which keeps working; ``routelab.routing_stats(model)`` gives the load.

    Args:
        model: a transformers model (or any module) whose sparse MoE blocks have a ``gate`` or
            ``router`` child with parameters ``weight [E, d]`` (and optionally ``bias [E]``),
            called on the hidden states alone and returning ``(router_logits, routing_weights,
            selected_experts)``, and an ``experts`` child with ``num_experts == E`` called as
            ``experts(hidden_states, selected_experts, routing_weights)``.
        router: a name of :data:`routelab.routers.ROUTERS` (``"topk"``, ``"noisy_topk"``,
            ``"softmax"``, ``"batchwise"``, ``"base"``, ``"sinkhorn"``, ``"gumbel_matching"``,
            ``"switch"``) or a factory ``(d_model, num_experts, k) -> Router`` called once per block.
        k: experts per token; default the model's (``gate.top_k``, else what its gate returns). A
            router that cannot route to the model's default k (``gumbel_matching``, ``switch``: one expert per token;
            ``softmax``: all) keeps its own, with a warning; an explicit ``k`` it cannot take is a
            ValueError.
        capacity_factor: capacity in training, ``C = ceil(factor * tokens * k / E)``; ``None``
            (default, as transformers): dropless.
        eval_capacity_factor: the same in ``eval()``; ``None`` (default): dropless.
        drop_policy: which pairs the capacity drops, one of :data:`routelab.routing.DROP_POLICIES`.
        importance_weighting: combine with ``gate * weight`` (importance weights, eq. 3 skip
            correction) instead of ``gate``.
        renormalize: for routers with that option (``topk``, ``switch``, ``sinkhorn``): combine weights
            summing to 1 over the chosen experts; default what the model's gate does (:func:`probe_gate`;
            Mixtral: True, OLMoE: False), else its ``norm_topk_prob``. Given for a router without the
            option (or with a factory), a ValueError.
        router_kwargs: other options of the router's constructor (e.g. ``balance_coef``).
        aux_coef: multiplies the routers' weighted auxiliary losses seen by ``routelab.aux_loss``.
        generator: randomness of stochastic routers and of ``drop_policy="random"``.
        check_finite: check the router scores for NaN/inf on every call (one host sync per block;
            a second, the capacity step's check of the routes, with ``drop_policy="score"`` or a
            router that does not declare ``experts_in_range``:
            :func:`~routelab.routers.base.routes_need_value_check`); ``False`` drops both (as
            ``MoE(check_finite=False)``): a block with a top-k-style router and no capacity or mask
            then routes without a host sync.

    Returns:
        The patched blocks, in module order. Their ``gate.router`` is the routelab router.

    Raises:
        ValueError: naming the argument: no sparse MoE block in ``model``, a candidate block that
            does not fit the contract or is already patched (no block is patched then), an unknown
            router, ``k`` not in ``[1, E]``, a bad capacity factor, drop policy or ``aux_coef``.
        TypeError: ``model`` is not an ``nn.Module``, ``generator`` not a ``torch.Generator``.

    Note:
        The router reads the gate's ``weight`` (and ``bias``) through :class:`GateProjection`, so
        ``state_dict()`` keeps the model's own keys and checkpoints load before or after patching.
        A patched model also pickles whole (``torch.save(model)``) and deep-copies.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(router, str):
        router_name(router)  # unknown names fail before anything is patched
    check_capacity_factor(capacity_factor)
    try:
        check_capacity_factor(eval_capacity_factor)
    except ValueError as error:
        raise ValueError(str(error).replace("capacity_factor", "eval_capacity_factor", 1)) from None
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {', '.join(DROP_POLICIES)}, got {drop_policy!r}")
    check_generator(generator)
    check_finite = check_flag("check_finite", check_finite)
    importance_weighting = check_flag("importance_weighting", importance_weighting)
    if renormalize is not None:
        renormalize = check_flag("renormalize", renormalize)
    if isinstance(aux_coef, bool) or not (isinstance(aux_coef, numbers.Real) and math.isfinite(aux_coef)
                                          and aux_coef >= 0):
        raise ValueError(f"aux_coef must be a finite number >= 0 (0 disables routelab's aux losses), got {aux_coef!r}")
    if router_kwargs is not None and not isinstance(router_kwargs, dict):
        raise ValueError(f"router_kwargs must be a dict of router options, got {type(router_kwargs).__name__}")
    taken = sorted({"d_model", "num_experts", "k"} & set(router_kwargs or {}))
    if taken:
        raise ValueError(f"router_kwargs may not set {taken}: patch_moe takes them from the model (pass k= to "
                         f"patch_moe itself for the experts per token)")
    if renormalize is not None and "renormalize" in (router_kwargs or {}) \
            and bool(router_kwargs["renormalize"]) != bool(renormalize):
        raise ValueError(f"renormalize={renormalize} and router_kwargs['renormalize']={router_kwargs['renormalize']} "
                         f"disagree; give it once")
    if renormalize is not None:  # explicit: a router that cannot take it is an error, as an explicit k is
        takes = [name for name in ROUTERS if "renormalize" in router_options(name)]
        if not isinstance(router, str):
            raise ValueError("renormalize goes with a router name; configure the routers your factory builds directly")
        if "renormalize" not in router_options(router):
            raise ValueError(f"router {router_name(router)!r} has no renormalize option (routers with one: "
                             f"{', '.join(takes)}); leave renormalize=None")
    candidates = sparse_moe_blocks(model)
    problems, rules = [], {}
    for name, block in candidates:
        why = block_problem(block)
        if why is None:
            gate = routing_child(block)[1]
            rules[name] = probe_gate(gate, block=block)
            if rules[name].contract is not None:
                why = (f"its gate ({type(gate).__name__}): {rules[name].contract}; its block expects another output "
                       "of the gate than routelab's routers give")
        problems.append((name, why))
    bad = [(name, why) for name, why in problems if why is not None]
    if bad:
        listing = "; ".join(f"{name or '<model>'}: {why}" for name, why in bad[:3])
        raise ValueError(f"patch_moe cannot patch {len(bad)} of the {len(candidates)} sparse MoE blocks ({listing})")
    if not candidates:
        # Modules that route but hold their experts otherwise (JetMoE's router + input_linear/output_linear):
        # named, so the refusal says what was found, not only what was looked for.
        routed = [(name, type(module).__name__, routing_child(module)[0]) for name, module in model.named_modules()
                  if routing_child(module) is not None]
        found = ""
        if routed:
            listing = ", ".join(f"{cls} ({name or '<model>'}, child {child!r})" for name, cls, child in routed[:3])
            more = f" and {len(routed) - 3} more" if len(routed) > 3 else ""
            found = (f"; it has modules with a routing child but no 'experts' child: {listing}{more}. They route by "
                     f"another contract (experts held otherwise), which patch_moe does not read")
        raise ValueError(f"model ({type(model).__name__}) has no sparse MoE block: patch_moe looks for modules with a "
                         f"'gate' or 'router' child (weight [E, d]) and an 'experts' child (fused experts){found}")
    plans, notices = [], {}
    for name, block in candidates:
        _, gate = routing_child(block)
        E, d = scorer_parameter(gate, "weight").shape
        rule = rules[name]
        bias = scorer_parameter(gate, "bias")
        share_bias = isinstance(bias, Tensor) and bias.shape == (E,) and (rule.logit_bias or rule.k is None)
        unused = [n for n, _ in (*gate.named_parameters(), *gate.named_buffers())
                  if n != scorer_key(gate, "weight") and not (n == scorer_key(gate, "bias") and share_bias)]
        notice = replaced_rule(rule, unused)
        if notice is not None:
            notices.setdefault(type(gate).__name__, notice)
        model_k = _model_k(gate, rule, model)
        if model_k is None and k is None:
            raise ValueError(f"patch_moe cannot read how many experts per token the gate {type(gate).__name__} of "
                             f"block {name!r} routes to (no top_k on the gate, no k in its rule, no "
                             f"config.num_experts_per_tok): pass k=")
        use_k = model_k if k is None else k
        check_positive_int("k", use_k, upper=E, upper_name=f"num_experts of block {name!r}")
        if renormalize is not None:
            norm = bool(renormalize)
        else:
            norm = rule.renormalize if rule.renormalize is not None else _model_norm_topk(gate, model)
        built = _build_router(router, d, E, use_k, k is not None, norm, dict(router_kwargs or {}))
        check_capacity_for(built, capacity_factor)
        check_capacity_for(built, eval_capacity_factor, eval=True)
        plans.append((block, gate, built, share_bias, rule))
    for gate_class, notice in notices.items():
        warnings.warn(f"the model's gate {gate_class} {notice}", stacklevel=2)
    masks = CallMasks()
    # every router built: now patch (nothing is half-patched on an error)
    for block, gate, built, share_bias, rule in plans:
        experts = block.experts
        scorer = gate_scorer(gate)[1]
        built = built.to(device=scorer.weight.device)
        built.proj = GateProjection(scorer, share_bias)  # the gate's weight (GPT-OSS: and bias), one parameter each
        built.logits_in_input_dtype = rule.input_dtype_logits  # a bfloat16 model's gate rounds its logits
        gate.combine_scale = float(rule.scale)
        gate.weights_in_input_dtype = rule.input_dtype_weights  # and some round their combine weights
        if generator is not None:
            built.generator = generator
        built.check_finite = check_finite
        built.train(gate.training)
        _swap_class(gate, RoutedGate)
        gate.router = built
        gate.capacity_factor, gate.eval_capacity_factor = capacity_factor, eval_capacity_factor
        gate.drop_policy, gate.importance_weighting = drop_policy, bool(importance_weighting)
        gate.aux_coef = float(aux_coef)
        object.__setattr__(gate, "_routelab_mask", masks)
        object.__setattr__(gate, "_routelab_replay", NoiseReplay())
        object.__setattr__(gate, "_routelab_generator", generator)
        object.__setattr__(gate, "_routelab_takes_mask", _accepts_mask(built))
        state = _BlockState()  # what the gate tells the experts of the same block
        object.__setattr__(gate, "_routelab_state", state)
        object.__setattr__(gate, "_routelab_outputs", rule.outputs)
        if rule.block_routes is not None:  # a logits-only gate: the block's route method answers for it
            object.__setattr__(gate, "_routelab_block_routes", rule.block_routes)
            object.__setattr__(block, ROUTE_METHOD, _BlockRoute(block))
        _swap_class(experts, RoutedExperts)
        object.__setattr__(experts, "_routelab_num_experts", scorer.weight.shape[0])
        object.__setattr__(experts, "_routelab_state", state)
    if not install_masks(model, [plan[1] for plan in plans], masks):
        warnings.warn(f"no module of the patched model ({type(model).__name__}) takes an attention_mask: padding "
                      "tokens cannot be told apart from real ones, so they are routed (they take capacity and enter "
                      "the balanced solves). To route without them, patch the model whose call carries the mask",
                      stacklevel=2)
    return [plan[0] for plan in plans]
