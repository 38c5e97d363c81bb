"""``autograd.Function.apply`` for the layer's hot path, without torch's per-call signature binding.

A ``torch.autograd.Function`` with a separate ``setup_context`` (the form ``torch.func`` transforms
need) binds its arguments to ``forward``'s signature with ``inspect.signature`` on every
``apply``: about 40 us a call on a server CPU, three calls per MoE step (the router's float32
scores, dispatch, combine). Where the layer is bound by the host's launches (a GPU at
d_model 1024) that is time the GPU waits. :func:`apply` passes every argument positionally, so
the binding has nothing to do, and goes straight to autograd's C++ ``apply``; under a
``torch.func`` transform or while ``torch.compile`` traces it calls ``Function.apply`` as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch.utils import unwrap_dead_wrappers

__all__ = ["apply"]


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``, with every argument of ``function.forward`` given positionally
    (``forward``'s defaults are not filled in: pass them all)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    # What Function.apply does outside transforms, without its inspect.signature binding.
    return super(torch.autograd.Function, function).apply(*unwrap_dead_wrappers(args))
