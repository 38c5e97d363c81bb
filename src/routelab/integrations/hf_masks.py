"""The padding mask of a patched transformers model's call, for its patched gates, also when
activation checkpointing recomputes a block inside the backward pass.

A gate sees the hidden states ``[batch * seq, d]`` alone; the ``attention_mask [batch, past + seq]``
is an argument of the model's call. :class:`CallMasks` carries it from one to the other:

* **Sources**: the patched model and every module in it whose ``forward`` takes both an
  ``attention_mask`` and ``input_ids`` or ``inputs_embeds`` (a transformers model and its base
  model). A forward pre-hook pushes each call's mask, a forward hook (``always_call``) pops it:
  the gates route under the innermost call in progress, and a call that passes no source (a
  decoder layer called alone) routes every token. So ``model.model(ids)`` after a padded
  ``model(...)`` does not reuse the old mask, and a wrapper that calls ``model.forward`` directly
  (PEFT) still has its base model's call.
* **Recomputation.** Checkpointing runs a block's forward again during backward, when no call is
  in progress, and possibly after other calls (an evaluation forward, the second of a DPO pair).
  The gate's ancestors and their children (the *carriers*) record, at each forward with
  gradients, their tensor inputs (by memory address and shape, weakly) with the mask of that
  call. The recomputation runs the checkpointed code on the very inputs of the original forward
  (the same tensors, or detached aliases of them: the same memory), and the layer's per-call
  tensors (its attention mask, its position embeddings) are the originals too; so a carrier it
  calls finds records of its inputs, alive at the same address, and the gates after it route under
  that call's mask, whichever calls ran in between or however often the graph is recomputed. A
  tensor that reached a module in several calls under different masks (one ``inputs_embeds`` for
  a DPO pair) decides nothing while another input does. A recomputation without a record (a
  checkpointed function entered below every carrier) falls back to the latest call's mask, with a
  warning where that mask pads.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..replay import in_backward

__all__ = ["CallMasks", "mask_sources"]

#: Carrier records kept (those of freed inputs are forgotten first, then the oldest): one per tensor
#: input of a carrier per forward with gradients, so at least those of the calls between a
#: checkpointed forward and its backward.
MAX_RECORDS = 16384


class CallMask(NamedTuple):
    """One call's ``attention_mask [batch, past + seq]`` (2-D, else None) and its ``seq`` (``None``: unknown)."""

    value: Tensor | None
    query_length: int | None


NO_MASK = CallMask(None, None)


def takes_attention_mask(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes ``attention_mask`` and ``input_ids`` or ``inputs_embeds``
    (a transformers model, or its base model): a source of the call's padding mask."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "attention_mask" in params and ("input_ids" in params or "inputs_embeds" in params)


def mask_sources(model: nn.Module) -> list[nn.Module]:
    """``model`` and the modules in it that take an attention mask (:func:`takes_attention_mask`)."""
    return [model] + [m for _, m in model.named_modules() if m is not model and takes_attention_mask(m)]


class CallMasks:
    """The padding masks of a patched model's calls, shared by its patched gates (see the module docstring)."""

    def __init__(self) -> None:
        # the source calls in progress, innermost last: (source module's id, its call, pushed in backward)
        self.calls: list[tuple[int, CallMask, bool]] = []
        self.latest: CallMask = NO_MASK            # the latest source call's (a recomputation's fallback)
        self.records: OrderedDict[tuple, _Record] = OrderedDict()
        self.replayed: _Replay | None = None      # the call a recomputation in progress recomputes
        self._signatures: dict[type, inspect.Signature] = {}
        self._warned: set[str] = set()

    def __getstate__(self) -> dict:
        """Nothing: the calls in progress and the records are of this process's tensors (a copy or
        a pickle starts afresh)."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    # -- sources --------------------------------------------------------------------------------
    def enter_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of a source: push its call's mask."""
        arguments = dict(kwargs)
        if args:  # passed by position: bind the call to the module's signature (keywords win)
            signature = self._signatures.get(type(module))
            if signature is None:
                signature = self._signatures[type(module)] = inspect.signature(module.forward)
            try:
                arguments = {**signature.bind_partial(*args, **kwargs).arguments, **kwargs}
            except TypeError:
                pass
        mask = arguments.get("attention_mask")
        mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        # The positions of this call: a block that sees batch * that many tokens sees all of them.
        inputs = arguments.get("input_ids")
        if not isinstance(inputs, Tensor):
            inputs = arguments.get("inputs_embeds")
        seq = inputs.shape[1] if isinstance(inputs, Tensor) and inputs.dim() >= 2 else None
        call = CallMask(mask, seq)
        # A call of a module already in progress that is no recursion: the earlier one never
        # returned (a KeyboardInterrupt skips the forward hooks): drop it and what it left above.
        for depth, (owner, _, _) in enumerate(self.calls):
            if owner == id(module):
                del self.calls[depth:]
                break
        recomputing = not torch.compiler.is_compiling() and in_backward()
        self.calls.append((id(module), call, recomputing))
        self.latest = call

    def leave_call(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook (``always_call``) of a source: pop its call (and any left above it)."""
        for depth in range(len(self.calls) - 1, -1, -1):
            if self.calls[depth][0] == id(module):
                del self.calls[depth:]
                return

    def current(self) -> CallMask:
        """The innermost source call in progress, else no mask."""
        return self.calls[-1][1] if self.calls else NO_MASK

    # -- carriers -------------------------------------------------------------------------------
    def enter_carrier(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of a carrier: in a forward, record each tensor input with the call's mask;
        in a recomputation, the records of those very inputs (alive, at the same address) name the
        call being recomputed, whose mask the gates then route under."""
        if torch.compiler.is_compiling():  # (compiled checkpointing recomputes no Python)
            return
        inputs = _tensor_inputs(module, args, kwargs)
        if in_backward():
            self._replay(inputs)
            return
        self.replayed = None  # a forward: no recomputation in progress
        if not inputs or not (torch.is_grad_enabled() or module.training):
            return  # no backward will recompute it (a reentrant checkpoint's forward is in training mode)
        call = self.current()
        for key, tensor in inputs:
            old = self.records.get(key)
            calls: tuple[CallMask, ...] = (call,)
            if old is not None and (original := old.tensor()) is not None and _same_memory(original, tensor):
                # this tensor, alive, reached the module before: it keeps every distinct mask it had
                calls = (*(c for c in old.calls if not _same_mask(c.value, call.value)), call)
            self.records[key] = _Record(weakref.ref(tensor), calls)
            self.records.move_to_end(key)
        if len(self.records) > MAX_RECORDS:  # the records of freed inputs go first, then the oldest
            for stale in [k for k, record in self.records.items() if record.tensor() is None]:
                del self.records[stale]
            while len(self.records) > MAX_RECORDS:
                self.records.popitem(last=False)

    def _replay(self, inputs: list[tuple[tuple, Tensor]]) -> None:
        """In a recomputation: the call whose forward gave this module these inputs. A record of one
        call decides (a checkpoint's original inputs: the hidden states, or a per-call tensor such
        as the layer's attention mask or position embeddings); a tensor that reached the module in
        several calls under different masks decides nothing while another input does."""
        found: list[tuple[CallMask, ...]] = []
        for key, tensor in inputs:
            record = self.records.get(key)
            if record is not None and (original := record.tensor()) is not None and _same_memory(original, tensor):
                found.append(record.calls)
        decided = [calls[0] for calls in found if len(calls) == 1]
        if decided:
            self.replayed = _Replay(decided[0], ambiguous=False)
        elif found and (self.replayed is None or self.replayed.ambiguous):
            self.replayed = _Replay(found[0][-1], ambiguous=True)

    # -- the gates --------------------------------------------------------------------------------
    def tokens(self, num_tokens: int) -> Tensor | None:
        """``BoolTensor [num_tokens]`` (a block's flattened ``[batch * seq]`` tokens; True = real),
        or None, for the gate routing now: under the call in progress, or, in a recomputation,
        under the call of the forward it recomputes."""
        call = self.current()
        if not torch.compiler.is_compiling() and in_backward():
            if self.calls and self.calls[-1][2]:
                pass  # a whole model call recomputed (a checkpoint around it): its own call, pushed now
            elif self.replayed is not None:
                call = self.replayed.call
                if self.replayed.ambiguous:
                    self._warn("ambiguous", "activation checkpointing recomputed a patched MoE block whose inputs "
                               "reached it in several calls under different padding masks, with nothing else to "
                               "tell them apart: it routes under the latest. Pass each call its own input tensor "
                               "(e.g. inputs_embeds.clone())")
            else:
                call = self.latest
                if call.value is not None:
                    self._warn("unmatched", "activation checkpointing recomputed a patched MoE block that no "
                               "recorded forward matches (a checkpointed function entered below the modules "
                               "patch_moe hooks): it routes under the latest call's padding mask, which may be "
                               "another call's")
        return _block_tokens(call, num_tokens)

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, stacklevel=4)


class _Record(NamedTuple):
    """A carrier's input in a forward: the tensor (weakly) and the call's mask; or the masks of the
    calls that gave the module this same tensor (alive) under different masks, in call order."""

    tensor: weakref.ref
    calls: tuple[CallMask, ...]


class _Replay(NamedTuple):
    """The call a recomputation in progress recomputes, and whether only an ambiguous input named it."""

    call: CallMask
    ambiguous: bool


def _same_mask(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether two calls' masks are the same (one host read where they are distinct tensors)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return a.shape == b.shape and bool(torch.equal(a, b))


def _tensor_inputs(module: nn.Module, args: tuple, kwargs: dict) -> list[tuple[tuple, Tensor]]:
    """A call's tensor inputs (positional, keyword, and one level into tuples and lists), each with
    its key ``(module, argument, address, shape)``; tensors without memory (torch.func's wrappers)
    are left out."""
    found = []
    named = [(i, value) for i, value in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        items = [(name, value)]
        if isinstance(value, (tuple, list)):
            items = [((name, j), item) for j, item in enumerate(value)]
        for slot, item in items:
            if isinstance(item, Tensor):
                try:
                    found.append(((id(module), slot, item.data_ptr(), tuple(item.shape)), item))
                except (RuntimeError, NotImplementedError):
                    continue
    return found


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` is ``a`` or a detached alias of it (reentrant checkpointing's inputs)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _block_tokens(call: CallMask, num_tokens: int) -> Tensor | None:
    """The real tokens among a block's ``num_tokens`` under ``call``'s mask ``[batch, past + seq]``:
    the block sees the last ``seq`` positions. A block that sees another number of tokens than
    ``batch * seq`` of the call (one that runs on a subset of them, as Ernie 4.5 VL's text and
    vision experts do) cannot be told which are padding: it routes them all, with a warning."""
    mask, seq = call
    if mask is None or num_tokens == 0:
        return None
    batch, total = mask.shape
    if (num_tokens % batch or num_tokens // batch > total
            or (seq is not None and seq <= total and num_tokens != batch * seq)):
        grid = f"the call's {batch} x {seq} tokens" if seq is not None else f"attention_mask {tuple(mask.shape)}"
        warnings.warn(f"a patched MoE block sees {num_tokens} tokens, not {grid} (a block that runs on a subset "
                      "of the tokens): its padding tokens cannot be told apart, so it routes all of them (they "
                      "take capacity and enter the balanced solves; the other tokens' routes may change with "
                      "the padding)", stacklevel=4)
        return None
    return mask[:, total - num_tokens // batch:].reshape(-1).bool()


def install(model: nn.Module, gates: list[nn.Module], masks: CallMasks) -> bool:
    """Hook ``masks`` into ``model``: its sources, and the carriers (each gate, its ancestors up to
    ``model`` and their children; not the gate's own children: a hook on the router costs it its
    promise to route every slot). Returns whether ``model`` has a source that takes an attention
    mask (else padding cannot be told apart)."""
    sources = mask_sources(model)
    for source in sources:
        source.register_forward_pre_hook(masks.enter_call, with_kwargs=True)
        source.register_forward_hook(masks.leave_call, always_call=True)
    wanted = {id(gate) for gate in gates}
    carriers: dict[int, nn.Module] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if id(module) not in wanted:
            continue
        carriers.setdefault(id(module), module)
        parts = name.split(".") if name else []
        for depth in range(len(parts)):  # the gate's ancestors, and their children (a checkpointed
            ancestor = modules[".".join(parts[:depth])]  # forward's first calls take its inputs)
            for carrier in (ancestor, *ancestor.children()):
                carriers.setdefault(id(carrier), carrier)
    for carrier in carriers.values():
        carrier.register_forward_pre_hook(masks.enter_carrier, with_kwargs=True)
    return any(takes_attention_mask(source) for source in sources)
