"""What a Hugging Face transformers sparse MoE block is and what its gate computes.

:func:`sparse_moe_blocks` finds the candidate blocks (a routing child named as in
:data:`ROUTING_CHILDREN` beside an ``experts`` child), ``block_problem`` says why one does not fit
:func:`routelab.integrations.hf.patch_moe`'s contract, and :func:`probe_gate` reads the rule of the
model's own gate (its ``k``, top-k normalisation, weight scale, logit bias, scoring dtype) by running a
copy of it with fresh random parameters, so that ``patch_moe``'s defaults reproduce the model and a gate
with a rule of its own is named in a warning. transformers itself is never imported here.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..routers import Router
from ..routing import RoutingRecord

__all__ = ["CONTRACT", "ROUTE_METHOD", "ROUTING_CHILDREN", "GateRule", "probe_gate", "routing_child",
           "sparse_moe_blocks"]

#: What transformers' blocks (5.x) expect of their gate, in this order: ``router_logits [n, E]``,
#: combine ``weights [n, k]``, ``experts [n, k]``. Older gates answer with the same three in another
#: order (GraniteMoE in transformers 5.17: experts, weights, logits), or with the logits alone, the
#: block then routing them with a method of its own (:data:`ROUTE_METHOD`; Jamba in 5.17).
CONTRACT = ("logits", "weights", "experts")

#: The block method that turns a logits-only gate's ``router_logits`` into ``(experts, weights)``
#: (in some order), called as ``(hidden_states, router_logits)`` or ``(router_logits)``.
ROUTE_METHOD = "route_tokens_to_experts"


#: The names under which transformers' sparse MoE blocks hold their router module, in the order tried:
#: ``gate`` (Mixtral, Qwen2/3-MoE, OLMoE, MiniMax, Qwen3-Next, DeepSeek-V2, ...) and ``router``
#: (GPT-OSS, Jamba, GraniteMoE, PhiMoE, ...).
ROUTING_CHILDREN = ("gate", "router")


def routing_child(block: nn.Module) -> tuple[str, nn.Module] | None:
    """The ``(attribute name, module)`` through which ``block`` routes (a :data:`ROUTING_CHILDREN` child
    that scores with a 2-D ``weight``, :func:`gate_scorer`, else the first such child), or None when it
    has none. A routelab :class:`~routelab.routers.Router` child is not one: routelab's own layers are
    routed already."""
    found = [(name, child) for name in ROUTING_CHILDREN
             if isinstance(child := getattr(block, name, None), nn.Module) and not isinstance(child, Router)]
    for name, child in found:
        if gate_scorer(child) is not None:
            return name, child
    return found[0] if found else None


def _own_matrix(module: nn.Module) -> bool:
    """Whether ``module`` holds a 2-D parameter ``weight`` of its own."""
    weight = module._parameters.get("weight")
    return isinstance(weight, Tensor) and weight.dim() == 2


def gate_scorer(gate: nn.Module) -> tuple[str, nn.Module] | None:
    """The module whose ``weight [E, d]`` (and ``bias [E]``) a gate scores the experts with, and its
    name inside the gate (``""`` for the gate itself), or None.

    That is the gate itself when it holds a 2-D parameter ``weight`` of its own (Mixtral, Qwen, OLMoE,
    GPT-OSS, ...), else its one child module with parameters, when that child holds such a ``weight``
    (an ``nn.Linear``: HunYuan's ``wg``, DBRX's ``layer``, AFMoE's ``gate``). None otherwise: no such
    weight, or several children with parameters (an MLP router, as Zaya's: no one matrix scores).
    Whether the gate's logits are that module's ``x @ weight.T (+ bias)`` is checked by :func:`probe_gate`.
    """
    if _own_matrix(gate):
        return "", gate
    children = [(name, child) for name, child in gate.named_children()
                if next(child.parameters(), None) is not None]
    return children[0] if len(children) == 1 and _own_matrix(children[0][1]) else None


def scorer_parameter(gate: nn.Module, name: str) -> Tensor | None:
    """The gate's scoring ``weight`` or ``bias`` (``name``; :func:`gate_scorer`), or None."""
    found = gate_scorer(gate)
    return None if found is None else found[1]._parameters.get(name)


def scorer_key(gate: nn.Module, name: str) -> str:
    """The qualified name inside ``gate`` of its scoring ``weight`` or ``bias`` (``"weight"``, ``"wg.weight"``)."""
    found = gate_scorer(gate)
    return f"{found[0]}.{name}" if found is not None and found[0] else name


def _positional_inputs(function: Callable) -> list[str] | None:
    """The names of the positional inputs of a method (``self`` excluded), or None if it cannot be read."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params[1:] if p.kind in kinds]


def block_problem(block: nn.Module) -> str | None:
    """Why ``block`` (a module with a routing child and an ``experts`` child) does not fit the contract, or None."""
    _, gate = routing_child(block)
    experts = block.experts
    if isinstance(gate, RoutingRecord):  # a patched gate (RoutedGate) records its routing
        return ("it is already patched by routelab (a patch is not undone: to route with another router, patch a "
                "fresh model, or a copy.deepcopy of the model taken before patching, and load its state_dict)")
    weight = scorer_parameter(gate, "weight")
    if weight is None:
        return (f"its gate ({type(gate).__name__}) has no [num_experts, hidden] parameter 'weight', of its own or "
                f"in one child (a Linear), for a routelab router to score with")
    E = weight.shape[0]
    num = getattr(experts, "num_experts", None)
    if num is None:
        gate_up = getattr(experts, "gate_up_proj", None)
        num = gate_up.shape[0] if isinstance(gate_up, Tensor) else None
    if num is None:
        return (f"its experts ({type(experts).__name__}) do not say they hold num_experts={E} fused experts "
                f"(no num_experts attribute or gate_up_proj [E, 2I, d])")
    if num != E:
        return (f"its gate ({type(gate).__name__}) scores {E} experts but its experts ({type(experts).__name__}) "
                f"hold {num}: the gate's rows are not one per routed expert (shared experts scored with them?)")
    inputs = _positional_inputs(type(experts).forward)
    if inputs is not None and len(inputs) < 3:
        return (f"its experts ({type(experts).__name__}) take {inputs}, not (hidden_states, top_k_index, "
                f"top_k_weights): the block routes by a contract of its own")
    return None


@dataclass(frozen=True)
class GateRule:
    """What a transformers gate computes, read by running a copy of it on random inputs (:func:`probe_gate`).

    Attributes:
        k: experts per token it returns (``S`` of its ``[n, S]`` outputs); None if unknown.
        renormalize: True / False when it routes by softmax top-k of its logits, with the weights
            renormalised over the chosen ``k`` / not (the full softmax's); None when it routes
            otherwise or could not be probed.
        scale: the constant its combine weights carry on top of that (DeepSeek's
            ``routed_scaling_factor``); also read when its rule is another one
            (:func:`_own_rule_scale`: DeepSeek-V3's sigmoid scores renormalised times 2.5,
            DeepSeek-V2's group-limited softmax times 16); 1.0 otherwise.
        logit_bias: its logits are ``x @ weight.T + bias`` (GPT-OSS), not ``x @ weight.T``.
        differs: why its routing is not softmax top-k of its logits (PhiMoE's sparsemixer,
            DeepSeek-V3's bias-corrected sigmoid top-k), or None.
        inputs: the inputs its ``forward`` takes besides the hidden states (MiniMax-M2's
            ``e_score_correction_bias``); a gate with any is not probed.
        input_dtype_logits: it computes its logits in the hidden states' dtype (bfloat16 logits
            for a bfloat16 model: Mixtral, Qwen, OLMoE, GPT-OSS; also where it casts them to float32
            afterwards, as GraniteMoE-style gates do), not in float32 (DeepSeek).
        input_dtype_weights: it returns its combine weights in the hidden states' dtype (rounded
            to bfloat16 for a bfloat16 model: Qwen3-MoE, Granite, Aria), not in float32 (Mixtral).
        contract: why its output cannot be read as ``router_logits``, ``weights [tokens, k]`` and
            ``experts [tokens, k]`` (in some order, or the logits alone with the block's
            :data:`ROUTE_METHOD`), or None. A block whose gate breaks the contract cannot be patched.
        outputs: the roles of the gate's outputs, in its order (:data:`CONTRACT` for transformers
            5.x; ``("experts", "weights", "logits")`` for GraniteMoE in 5.17; ``("logits",)`` for a
            gate that returns its logits alone, as Jamba's in 5.17).
        block_routes: for a logits-only gate, the roles of the outputs of its block's
            :data:`ROUTE_METHOD` (Jamba 5.17: ``("experts", "weights")``); else None.
        training: what it does in ``train()`` mode only (DBRX's jitter: it scales its input in
            place), which the routelab router does not do; None when it computes the same in both.
        scale_unread: a gate with a rule of its own whose weights' scale could not be read
            (:func:`_own_rule_scale`): ``scale`` is then 1.0, and ``patch_moe``'s warning says so.
    """

    k: int | None = None
    renormalize: bool | None = None
    scale: float = 1.0
    logit_bias: bool = False
    differs: str | None = None
    inputs: tuple[str, ...] = ()
    input_dtype_logits: bool = False
    input_dtype_weights: bool = False
    contract: str | None = None
    outputs: tuple[str, ...] = CONTRACT
    block_routes: tuple[str, ...] | None = None
    training: str | None = None
    scale_unread: bool = False


def _scale_of(weights: Tensor, reference: Tensor) -> float | None:
    """The constant ``c`` with ``weights == c * reference`` (all ``[n, k]``), or None if there is none."""
    c = float((weights * reference).sum() / (reference * reference).sum().clamp_min(1e-30))
    return c if c > 0 and torch.allclose(weights, c * reference, rtol=1e-4, atol=1e-6) else None


def _own_rule_scale(gate: nn.Module, logits: Tensor, weights: Tensor, experts: Tensor) -> float | None:
    """The constant a gate with a routing rule of its own puts on its combine weights, or None.

    Read, in this order: a constant per-token sum of its ``weights [n, k]`` (DeepSeek-V3's sigmoid
    scores renormalised times 2.5); the constant ``c`` with ``weights == c * score`` (or ``c *`` the
    scores renormalised over the chosen experts), ``score`` the softmax or the sigmoid of its
    ``logits [n, E]`` at the experts ``experts [n, k]`` *it* chose (DeepSeek-V2's group-limited
    softmax top-k times 16, a sigmoid top-k times 2.5 without normalisation); the gate's
    ``routed_scaling_factor`` attribute."""
    sums = weights.sum(-1)
    if sums.numel() and torch.allclose(sums, sums.mean().expand_as(sums), rtol=1e-4):
        return float(sums.mean())
    if logits.dim() == 2 and experts.dim() == 2 and experts.shape == weights.shape and not experts.is_floating_point() \
            and experts.numel() and int(experts.min()) >= 0 and int(experts.max()) < logits.shape[-1]:
        for score in (logits.softmax(-1), logits.sigmoid()):
            chosen = score.gather(1, experts.long())
            for reference in (chosen, chosen / chosen.sum(-1, keepdim=True).clamp_min(1e-30)):
                scale = _scale_of(weights, reference)
                if scale is not None:
                    return scale
    return _scaling_attribute(gate)


def _scaling_attribute(gate: nn.Module) -> float | None:
    """The gate's ``routed_scaling_factor`` attribute (a positive finite number), or None."""
    own = getattr(gate, "routed_scaling_factor", None)
    if isinstance(own, (int, float)) and not isinstance(own, bool) and 0 < own < float("inf"):
        return float(own)
    return None


def _fresh_state(module: nn.Module, dtype: torch.dtype,
                 generator: torch.Generator) -> tuple[dict[str, nn.Parameter | None], dict[str, Tensor | None]]:
    """Random CPU parameters of ``dtype`` shaped as ``module``'s own, and float32 CPU copies of its own
    buffers (zeros for buffers on the meta device), as ``(parameters, buffers)`` dicts."""
    fresh = {name: None if p is None else nn.Parameter(torch.randn(p.shape, generator=generator).to(dtype),
                                                       requires_grad=False)
             for name, p in module._parameters.items()}  # None entries kept: nn.Linear(bias=False) reads self.bias
    buffers = {name: None if b is None else _buffer_copy(b)  # copies: an update must not reach the gate
               for name, b in module._buffers.items()}
    return fresh, buffers


def _probe_inputs(tokens: int, d: int, generator: torch.Generator) -> Tensor:
    """The probe's hidden states ``[tokens, d]``, of variance ``1 / d``: with the fresh N(0, 1) weights
    the logits are of order 1 at any hidden size. Inputs of variance 1 gave logits of spread
    ``sqrt(d)`` (about 45 at d = 2048), a one-hot softmax under which a gate that renormalises its
    top-k weights and one that does not give the same weights (and the k-th probability may
    underflow to a tie at 0): Qwen2-MoE's and DeepSeek-V2's sizes were read as renormalising."""
    return torch.randn(tokens, d, generator=generator) / d ** 0.5


def _buffer_copy(buffer: Tensor) -> Tensor:
    """A CPU copy of a gate's buffer for the probe: float32 for a floating buffer, its own dtype for
    an integer or bool one (an index table); zeros for a buffer on the meta device."""
    dtype = torch.float32 if buffer.is_floating_point() else buffer.dtype
    return torch.zeros(buffer.shape, dtype=dtype) if buffer.is_meta else buffer.detach().to("cpu", dtype, copy=True)


def _fresh_copy(gate: nn.Module, dtype: torch.dtype,
                generator: torch.Generator) -> tuple[nn.Module, dict[str, nn.Parameter | None]] | None:
    """A copy of ``gate`` that shares its attributes but holds random CPU parameters of ``dtype`` and
    copies of its buffers (zeros for buffers on the meta device), its submodules' too (copies of
    them), in eval mode and without hooks; with its parameters by qualified name (``"weight"``,
    ``"wg.weight"``). None if a submodule cannot be copied."""
    fresh, buffers = _fresh_state(gate, dtype, generator)
    try:
        modules = {name: None if m is None else copy.deepcopy(m).eval() for name, m in gate._modules.items()}
    except Exception:  # noqa: BLE001 - a submodule that cannot be copied: the gate is not probed
        return None
    named = dict(fresh)
    for child_name, child in modules.items():
        for path, module in (() if child is None else child.named_modules(prefix=child_name)):
            params, module._buffers = _fresh_state(module, dtype, generator)
            module._parameters = params
            named.update({f"{path}.{name}": p for name, p in params.items()})
    probe = type(gate).__new__(type(gate))
    probe.__dict__.update(gate.__dict__)
    probe.__dict__.update(_parameters=fresh, _buffers=buffers, _modules=modules,
                          _forward_hooks={}, _forward_pre_hooks={}, _backward_hooks={},
                          _forward_hooks_with_kwargs={}, _forward_pre_hooks_with_kwargs={},
                          _forward_hooks_always_called={}, _backward_pre_hooks={}, training=False)
    return probe, named


def _route_method(block: nn.Module | None) -> Callable | None:
    """The block's :data:`ROUTE_METHOD` as a plain function of ``(block, ...)``, or None."""
    method = getattr(type(block), ROUTE_METHOD, None) if block is not None else None
    return method if callable(method) else None


def _call_route_method(block: nn.Module, method: Callable, x: Tensor, logits: Tensor) -> object:
    """``block.route_tokens_to_experts`` on ``(x, logits)`` or ``(logits)``, by its arity."""
    inputs = _positional_inputs(method)
    return method(block, logits) if inputs is not None and len(inputs) == 1 else method(block, x, logits)


def _roles(out: object, tokens: int, E: int, reference: tuple[Tensor, ...]) -> tuple[str, ...] | str:
    """The roles (:data:`CONTRACT`'s names) of a gate's three outputs, in their order; a str says why
    they cannot be read. The experts are the integer tensor; of the two float tensors, the logits
    are the ``[tokens, E]`` one that is not shaped as the experts, or, where both are (``k = E``),
    the one equal to a ``reference`` (the logits the gate's weight gives), else the first."""
    if not (isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, Tensor) for t in out)):
        return "it returns neither (router_logits, weights, experts), in some order, nor its logits alone"
    ints = [i for i, t in enumerate(out) if not t.is_floating_point()]
    floats = [i for i, t in enumerate(out) if t.is_floating_point()]
    if len(ints) != 1 or len(floats) != 2:
        return "it does not return one integer tensor (experts) and two float ones (router_logits, weights)"
    experts = out[ints[0]]
    if experts.dim() != 2 or experts.shape[0] != tokens:
        return "it does not return experts of shape [tokens, k]"
    logits_like = [i for i in floats if tuple(out[i].shape) == (tokens, E)]
    weights_like = [i for i in floats if out[i].shape == experts.shape]
    if not logits_like or not weights_like or set(logits_like + weights_like) != set(floats):
        return "it does not return router_logits [tokens, E] and weights [tokens, k] beside its experts"
    if len(logits_like) == 1 and weights_like != logits_like:
        logits = logits_like[0]
    else:  # k = E: both fit; the logits are the one the gate's weight gives
        equal = [i for i in floats if any(torch.allclose(out[i].float(), r, rtol=1e-4, atol=1e-5) for r in reference)]
        logits = equal[0] if len(equal) == 1 else floats[0]
    roles = ["weights"] * 3
    roles[ints[0]], roles[logits] = "experts", "logits"
    return tuple(roles)


def _roles_with_block_inputs(gate: nn.Module, block: nn.Module | None, extras: tuple[str, ...], tokens: int,
                             seed: int) -> tuple[tuple[str, ...] | str | None, float | None]:
    """The roles of the outputs of a gate that takes inputs of its own (MiniMax-M2's, HY-V3's and
    AFMoE's ``e_score_correction_bias``/``expert_bias``, NLLB-MoE's ``padding_mask``), read by running
    a parameter-fresh copy of it on copies of the block's tensors of those names, or, for an input
    the block does not hold, the input's default (NLLB-MoE's ``None``); a str says why they cannot be
    read. None when an input is neither (DeepSeek-V4's ``input_ids``) or the copy cannot run: the
    outputs are then taken to follow the contract, unread. Second: the scale of its combine weights
    (:func:`_own_rule_scale`; only the gate's ``routed_scaling_factor`` where the copy does not run)."""
    unread = (None, _scaling_attribute(gate))
    try:
        params = inspect.signature(type(gate).forward).parameters
    except (TypeError, ValueError):
        return unread
    values = []
    for name in extras:
        held = getattr(block, name, None) if block is not None else None
        if isinstance(held, Tensor) and held.is_floating_point():
            values.append(torch.zeros(held.shape) if held.is_meta else held.detach().to("cpu", torch.float32,
                                                                                         copy=True))
        elif name in params and params[name].default is not inspect.Parameter.empty:
            values.append(params[name].default)
        else:
            return unread
    E, d = scorer_parameter(gate, "weight").shape
    g = torch.Generator().manual_seed(seed)
    run = _fresh_copy(gate, torch.float32, g)
    if run is None:
        return unread
    probe, fresh = run
    x = _probe_inputs(tokens, d, g)
    copies = values
    try:
        with torch.no_grad():
            out = type(gate).forward(probe, x, *copies)
    except Exception:  # noqa: BLE001 - a gate that cannot run on a CPU copy is simply not read
        return unread
    roles = _roles(out, tokens, E, (nn.functional.linear(x, fresh[scorer_key(gate, "weight")]),))
    if isinstance(roles, str):
        return roles, unread[1]
    found = dict(zip(roles, out, strict=True))
    return roles, _own_rule_scale(gate, found["logits"].float(), found["weights"].float(), found["experts"])


def _run_gate(gate: nn.Module, probe: nn.Module, x: Tensor, block: nn.Module | None,
              rule: GateRule) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(router_logits, weights, experts)`` of the gate copy ``probe`` on ``x``, by the roles of
    ``rule`` (through the block's :data:`ROUTE_METHOD` for a logits-only gate); None on failure."""
    try:
        with torch.no_grad():
            out = type(gate).forward(probe, x)
            if rule.block_routes is not None:
                routed = _call_route_method(block, _route_method(block), x, out)
                found = dict(zip(rule.block_routes, routed, strict=True)) | {"logits": out}
            else:
                found = dict(zip(rule.outputs, out, strict=True))
    except Exception:  # noqa: BLE001 - not probed
        return None
    return found["logits"], found["weights"], found["experts"]


def _half_precision_outputs(gate: nn.Module, block: nn.Module | None = None,
                            rule: GateRule | None = None) -> tuple[bool, bool]:
    """``(logits, weights)``: whether, on bfloat16 hidden states, the gate computes its logits in
    bfloat16 (Mixtral, Qwen, OLMoE, GPT-OSS: ``F.linear`` in bfloat16, also when it casts the result
    to float32 afterwards) rather than in float32 (DeepSeek), and whether it returns its combine
    weights in bfloat16 (Qwen3-MoE, Granite, Aria) rather than in float32 (Mixtral). Read from its
    outputs' dtypes and, for the logits, their values: the bfloat16 product and the float32 one of
    the same inputs differ in their last bits."""
    g = torch.Generator().manual_seed(1)
    run = _fresh_copy(gate, torch.bfloat16, g)
    if run is None:
        return False, False
    probe, fresh = run
    x = torch.randn(8, scorer_parameter(gate, "weight").shape[1], generator=g).to(torch.bfloat16)
    got = _run_gate(gate, probe, x, block, rule or GateRule())
    if got is None:  # not probed: score in float32
        return False, False
    logits, weights, _ = got
    weight, bias = fresh[scorer_key(gate, "weight")], fresh.get(scorer_key(gate, "bias"))
    in_half = logits.dtype == torch.bfloat16
    if not in_half and logits.shape == (x.shape[0], weight.shape[0]):
        for b in (None, bias) if isinstance(bias, Tensor) else (None,):
            half = nn.functional.linear(x, weight, b).float()
            full = nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
            in_half = in_half or (torch.equal(logits.float(), half) and not torch.equal(half, full))
    return in_half, weights.dtype == torch.bfloat16


def probe_gate(gate: nn.Module, tokens: int = 16, seed: int = 0, *, block: nn.Module | None = None) -> GateRule:
    """Run the gate's own ``forward`` on a parameter-fresh copy of it and compare with softmax top-k.

    The gate's outputs are read by their roles (:func:`_roles`), in whatever order it returns
    them. A gate that returns its logits alone is read through ``block``'s :data:`ROUTE_METHOD`
    (called on the copy's logits), when ``block`` is given and has one.

    The copy shares the gate's attributes (``top_k``, ``norm_topk_prob``, ...) but holds random float32
    CPU parameters and float32 CPU copies of its buffers (zeros for buffers on the meta device), so a
    gate on the meta device or with all-zero initial weights is probed alike; it runs in eval mode (no
    jitter) and without hooks. The gate itself is untouched.

    Args:
        gate: a transformers router module with ``weight [E, d]`` (and optionally ``bias [E]``).
        tokens: random tokens to route.
        seed: seed of the random parameters and tokens.

    Returns:
        :class:`GateRule` (all fields unknown when the copy cannot run).
    """
    inputs = _positional_inputs(type(gate).forward)
    if inputs is not None and len(inputs) > 1:
        extras = tuple(inputs[1:])
        roles, scale = _roles_with_block_inputs(gate, block, extras, tokens, seed)
        if isinstance(roles, str):
            return GateRule(inputs=extras, contract=f"it takes inputs of its own ({', '.join(extras)}) and {roles}")
        return GateRule(scale=1.0 if scale is None else scale, inputs=extras, outputs=roles or CONTRACT,
                        scale_unread=scale is None)
    E, d = scorer_parameter(gate, "weight").shape
    g = torch.Generator().manual_seed(seed)
    run = _fresh_copy(gate, torch.float32, g)
    if run is None:
        return GateRule()
    probe, fresh = run
    x = _probe_inputs(tokens, d, g)
    try:
        with torch.no_grad():
            out = type(gate).forward(probe, x)
    except Exception:  # noqa: BLE001 - a gate that cannot run on a CPU copy is simply not probed
        return GateRule()
    bias = fresh.get(scorer_key(gate, "bias"))
    logits = nn.functional.linear(x, fresh[scorer_key(gate, "weight")])
    reference = (logits,) if not isinstance(bias, Tensor) or bias.shape != (E,) else (logits, logits + bias)
    shape = dict(outputs=CONTRACT, block_routes=None)
    method = _route_method(block)
    if isinstance(out, Tensor) and tuple(out.shape) == (tokens, E) and out.is_floating_point() and method is not None:
        try:  # logits alone: the block routes them (Jamba in transformers 5.17)
            with torch.no_grad():
                routed = _call_route_method(block, method, x, out)
        except Exception as error:  # noqa: BLE001 - said in the refusal
            return GateRule(contract=f"it returns its logits alone, and its block's {ROUTE_METHOD} failed on the "
                                     f"probe's random logits ({type(error).__name__}: {str(error)[:120]})")
        roles = _roles((out, *routed) if isinstance(routed, (tuple, list)) and len(routed) == 2 else None,
                       tokens, E, reference)
        if isinstance(roles, str) or roles[0] != "logits":
            return GateRule(contract=f"it returns its logits alone and its block's {ROUTE_METHOD} does not return "
                                     "(experts, weights) in any order")
        shape = dict(outputs=("logits",), block_routes=roles[1:])
        out = (out, *routed)
        roles = ("logits", *roles[1:])
    elif isinstance(out, Tensor) and tuple(out.shape) == (tokens, E):
        return GateRule(contract=f"it returns its logits alone, and its block has no {ROUTE_METHOD} to route them")
    else:
        roles = _roles(out, tokens, E, reference)
        if isinstance(roles, str):
            return GateRule(contract=roles)
        shape["outputs"] = roles
    found = dict(zip(roles, out, strict=True))
    got_logits, got_weights, got_experts = (found[r].float() for r in CONTRACT)
    shape["training"] = _training_difference(gate, probe, x, out[0] if shape["block_routes"] else out)
    k, chosen = got_experts.shape[1], got_experts.long()
    logit_bias = False
    if isinstance(bias, Tensor) and bias.shape == (E,) and got_logits.shape == logits.shape:
        logit_bias = torch.allclose(got_logits, logits + bias, rtol=1e-4, atol=1e-5)
        logits = logits + bias if logit_bias else logits
    # (a rule of its own: the scale its weights carry, read on the experts it chose)
    own = _own_rule_scale(gate, got_logits, got_weights, chosen)
    own_scale = dict(scale=1.0 if own is None else own, scale_unread=own is None)
    if not torch.allclose(got_logits, logits, rtol=1e-4, atol=1e-5):
        scorer = scorer_key(gate, "weight").removesuffix("weight") or "its "
        return GateRule(k, None, logit_bias=logit_bias,
                        differs=f"the router_logits it returns are not hidden_states @ {scorer}weight.T", **own_scale,
                        **shape)
    if k > E or not torch.equal(chosen.sort(-1).values, logits.topk(k, -1).indices.sort(-1).values):
        return GateRule(k, None, logit_bias=logit_bias, differs="it does not choose the k largest logits",
                        **own_scale, **shape)
    p = logits.softmax(-1).gather(1, chosen)
    for renormalize, reference in ((True, p / p.sum(-1, keepdim=True)), (False, p)):
        scale = _scale_of(got_weights, reference)
        if scale is not None:
            in_half_logits, in_half_weights = _half_precision_outputs(gate, block, GateRule(**shape))
            return GateRule(k, renormalize, scale, logit_bias, input_dtype_logits=in_half_logits,
                            input_dtype_weights=in_half_weights, **shape)
    return GateRule(k, None, logit_bias=logit_bias,
                    differs="its weights are not the softmax of its logits, renormalised over the chosen experts or "
                            "not", **own_scale, **shape)


def _training_difference(gate: nn.Module, probe: nn.Module, x: Tensor, eval_out: object) -> str | None:
    """What the gate does in training that it does not in eval (the probe's other runs are in eval mode),
    read by running the parameter-fresh copy ``probe`` in ``train()`` mode on a copy of ``x``: it edits
    its input in place (DBRX's multiplicative jitter), or its outputs differ from ``eval_out`` (noise,
    jitter, dropout); None when neither. The global random state is left as it was."""
    x_train = x.clone()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            out = type(gate).forward(probe.train(), x_train)
    except Exception:  # noqa: BLE001 - the training mode is simply not read
        return None
    finally:
        probe.eval()
    edits = not torch.equal(x_train, x)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    evals = eval_out if isinstance(eval_out, (tuple, list)) else (eval_out,)
    same = len(outs) == len(evals) and all(isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape
                                           and torch.equal(a, b) for a, b in zip(outs, evals, strict=True))
    if not (edits or not same):
        return None
    said = [*(["edits its input hidden states in place, which its block's experts then see"] if edits else []),
            *(["routes otherwise than in eval"] if not same else [])]
    return f"does in training what it does not in eval (random jitter or noise): it {' and '.join(said)}"


def replaced_rule(rule: GateRule, unused: list[str]) -> str | None:
    """What the routelab router replaces of a gate's own routing (for :func:`patch_moe`'s warning), or None."""
    said = []
    if rule.inputs:
        said.append(f"takes inputs of its own ({', '.join(rule.inputs)}) that the routelab router does not use")
    if rule.differs is not None:
        said.append(f"does not route by softmax top-k ({rule.differs})")
    if rule.training is not None:
        said.append(rule.training)
    if unused:
        said.append(f"holds {unused}, which the routelab router does not use")
    if not said:
        return None
    kept = f" (the scale {rule.scale:g} of its weights is kept)" if rule.scale != 1 else ""
    if rule.scale_unread:
        kept = (" (the scale of its weights could not be read, and it has no routed_scaling_factor: the routelab "
                "router's weights are used unscaled)")
    return ("; ".join(said) + ": the routelab router replaces its routing rule, so router='topk' does not "
            "reproduce the unpatched model" + kept)


def sparse_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(name, block)`` pairs of ``model`` with a routing child (:data:`ROUTING_CHILDREN`) and an ``experts``.

    Args:
        model: any module.

    Returns:
        Every candidate block in module order, whether or not it fits :func:`patch_moe`'s contract.
    """
    return [(name, module) for name, module in model.named_modules()
            if routing_child(module) is not None
            and isinstance(getattr(module, "experts", None), nn.Module)]
