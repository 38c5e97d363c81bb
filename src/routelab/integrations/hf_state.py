"""The routers' own state of a patched transformers model, saved and loaded apart from the model's.

A patched model's ``state_dict()`` holds the model's keys and, besides, each router's own parameters
and buffers (App. F's learned thresholds, noisy top-k's ``W_noise``; the router's ``proj.weight`` is
the gate's, under the gate's key). ``save_pretrained`` writes them, but loading goes through the
unpatched class: ``from_pretrained`` drops them as unexpected keys, and some families save under
legacy module names (Mixtral's ``block_sparse_moe``), so a patched model cannot load them back by
name. These two functions keep them under the patched model's own block names::

    torch.save(router_state_dict(model), "routers.pt")       # beside model.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    patch_moe(model, "batchwise")
    load_router_state_dict(model, torch.load("routers.pt"))
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from .hf_blocks import routing_child

__all__ = ["load_router_state_dict", "router_state_dict"]


def _patched_routers(model: nn.Module) -> dict[str, nn.Module]:
    """``{block name: router}`` of the blocks of ``model`` patched by routelab, in module order."""
    from .hf import RoutedGate  # (hf imports this module's siblings; no cycle at import time)

    found = {}
    for name, module in model.named_modules():
        child = routing_child(module)
        if child is not None and isinstance(child[1], RoutedGate):
            found[name] = child[1].router
    return found


def router_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The routers' own parameters and buffers, ``{"<block>.router.<name>": tensor}`` (detached),
    for every patched block of ``model`` (empty for routers with no state of their own)."""
    routers = _patched_routers(model)
    if not routers:
        raise ValueError(f"model ({type(model).__name__}) has no block patched by routelab: patch_moe it first")
    return {f"{block}.router.{key}" if block else f"router.{key}": value.detach()
            for block, router in routers.items() for key, value in router.state_dict().items()}


def load_router_state_dict(model: nn.Module, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Load :func:`router_state_dict`'s ``state`` into the routers of ``model``'s patched blocks.

    Raises:
        ValueError: ``model`` has no patched block; with ``strict``, keys of ``state`` that no
            router holds or routers' keys that ``state`` lacks (both listed: a model patched with
            another router, or another model).
        RuntimeError: a tensor of ``state`` whose shape differs from the router's (from
            ``nn.Module.load_state_dict``: e.g. a state saved from a model with other ``num_experts``).
    """
    routers = _patched_routers(model)
    if not routers:
        raise ValueError(f"model ({type(model).__name__}) has no block patched by routelab: patch_moe it first")
    wanted = set(router_state_dict(model))
    unexpected = sorted(set(state) - set(wanted))
    missing = sorted(set(wanted) - set(state))
    if strict and (unexpected or missing):
        raise ValueError(f"the router state does not fit this model's routers: unexpected keys {unexpected[:4]}, "
                         f"missing keys {missing[:4]} (patch the model with the router the state was saved from)")
    for block, router in routers.items():
        prefix = f"{block}.router." if block else "router."
        own = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
        router.load_state_dict(own, strict=False)  # (shapes are checked there; the keys above)
