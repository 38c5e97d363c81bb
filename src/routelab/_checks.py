"""Every argument check of routelab, once (layer 0: imports nothing but torch).

Bad input fails early with a ``ValueError`` (``TypeError`` for a wrong type) whose message names
the argument and says how to fix it. Each rule below has exactly one home; the packages
re-export the ones that are part of their public API (``routelab.routing.expert_capacity``,
``routelab.gates.mtl_gate.check_positive_int``, ...).

* numbers: :func:`check_positive_int`, :func:`check_k`, :func:`check_pos`, :func:`check_nonneg`,
  :func:`check_seed`, :func:`check_generator`;
* the temperature contract: :func:`check_tau` (a number), :func:`tau_tensor` (a number or one
  temperature per batch instance, validated on the device in the caller's one host sync);
* tensors: :func:`check_score_matrix`, :func:`check_finite`, :func:`floating_input`,
  :func:`index_tensor`, :func:`mask_tensor`, :func:`checks_run`; a number argument on the device
  without a copy from the host: :func:`device_scalar`;
* token masks: :func:`token_mask` (``True`` = a real token, ``False`` = padding);
* capacity: :func:`resolve_capacity` (tokens per expert of a balanced problem),
  :func:`balanced_quotas` (the floor/ceil quotas ``k * n / E`` of balanced routers),
  :func:`check_capacity`, :func:`check_capacity_factor` and :func:`expert_capacity` (the MoE
  layer's ``C = ceil(capacity_factor * tokens * k / E)``).
"""

from __future__ import annotations

import argparse
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ArgumentTypeError",
    "random_tensor",
    "bad_tau",
    "check_capacity",
    "check_capacity_factor",
    "check_finite",
    "check_generator",
    "check_k",
    "check_token_count",
    "check_nonneg",
    "check_pos",
    "check_positive_int",
    "check_score_matrix",
    "check_seed",
    "check_tau",
    "checks_run",
    "device_scalar",
    "to_device",
    "balanced_quotas",
    "token_mask",
    "expert_capacity",
    "floating_input",
    "index_tensor",
    "mask_tensor",
    "resolve_capacity",
    "tau_tensor",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` that is also a ``ValueError``, so callers
    catching either (routelab's functions have raised both for a wrong type) see it."""


# ----------------------------------------------------------------------------------- numbers


def check_positive_int(name: str, value: Any, *, upper: int | None = None, upper_name: str = "") -> int:
    """``value`` as an ``int`` if it is an integer (a Python or NumPy integer, not a bool) in
    ``[1, upper]``, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer (an int >= 1), got {value!r}")
    value = int(value)
    if upper is not None and value > upper:
        raise ValueError(f"{name}={value} is larger than {upper_name}={upper}: {name} must be an integer in "
                         f"[1, {upper}], got {name} = {value}; use {name} <= {upper}")
    return value


def check_token_count(num_tokens: Any, meaning: str) -> int:
    """``num_tokens`` as an ``int`` if it is an integer ``>= 0`` (a Python or NumPy integer, not a
    bool), else a ValueError naming ``num_tokens`` (``meaning`` says what it counts)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0 ({meaning}), got {num_tokens!r}")
    return int(num_tokens)


def check_k(k: Any, num_experts: int) -> int:
    """``k`` if it is an int with ``1 <= k <= num_experts``, else a ValueError naming ``k``."""
    return check_positive_int("k", k, upper=num_experts, upper_name="num_experts")


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is True or False (a Python or NumPy bool), else a TypeError naming ``name``
    (``bool("False")`` is True: a string or a number is not taken for a flag)."""
    if not isinstance(value, (bool, np.bool_)):  # (NumPy's bool is no subclass of bool)
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _real_number(v: Any) -> Any:
    """``v``, or the number a 0-dim real tensor holds (so a tensor coefficient is checked as a number)."""
    if isinstance(v, Tensor) and v.dim() == 0 and not v.is_complex() and v.dtype != torch.bool:
        return v.item()
    return v


def check_nonneg(name: str, v: Any) -> float:
    """``v`` as a float if it is a finite real number ``>= 0`` (a Python or numpy scalar or a 0-dim
    tensor, not a bool), else a ValueError naming ``name``. While ``torch.compile`` traces, ``v``
    passes unchecked: under ``dynamic=True`` a module's float attribute is a symbolic graph input,
    which the check would turn into a graph break (the value was checked where it was set, e.g. a
    router's constructor)."""
    if torch.compiler.is_compiling():
        return v
    v = _real_number(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}.")
    return float(v)



def check_pos(name: str, v: Any) -> float:
    """``v`` as a float if it is a finite real number ``> 0`` (a Python or numpy scalar or a 0-dim
    tensor, not a bool), else a ValueError naming ``name``."""
    v = _real_number(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}.")
    return float(v)


def is_device_name(text: str) -> bool:
    """Whether ``text`` names a CPU or CUDA device as ``torch.device`` reads it (``cpu``, ``cuda``,
    ``cuda:1``, ``cpu:0``): the devices routelab's commands take."""
    try:
        return torch.device(text).type in ("cpu", "cuda")
    except (RuntimeError, TypeError, ValueError):
        return False


def positive_int_arg(text: str) -> int:
    """An argparse ``type``: an integer ``>= 1`` (else a usage error, status 2, before anything runs)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def seed_arg(text: str) -> int:
    """An argparse ``type``: a seed as :func:`check_seed` takes it, an integer in ``[0, 2**64)``
    (else a usage error, status 2, before anything runs)."""
    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a seed, an integer in [0, 2**64), got {text!r}") from None


def device_arg(text: str) -> str:
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not is_device_name(text):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda (or cuda:N), got {text!r}")
    return text


def check_seed(seed: Any, name: str = "seed") -> int:
    """``seed`` as an int for ``torch.Generator.manual_seed``: an integer (Python, numpy or a
    0-dim integer tensor; not a bool) in ``[0, 2**64)``, else a ValueError naming ``name``."""
    try:
        value = None if isinstance(seed, bool) else operator.index(seed)
    except TypeError:
        value = None
    if value is None or not 0 <= value < 2**64:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {seed!r}")
    return value


def check_generator(generator: object, name: str = "generator") -> None:
    """``None`` or a ``torch.Generator``; anything else is a ``TypeError`` naming ``name``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{name} must be a torch.Generator or None, got {type(generator).__name__}; "
            f"make one with torch.Generator().manual_seed(seed)"
        )


def random_tensor(sample: Any, shape: Any, *, dtype: torch.dtype, device: Any,
                  generator: torch.Generator | None) -> Tensor:
    """``sample(shape, dtype=, device=, generator=)`` (``torch.rand``, ``torch.randn``) on ``device``.

    A generator draws on its own device: a CPU generator (the library's default advice) with CUDA
    tensors draws on the CPU and the result is moved (through pinned memory, :func:`to_device`: a
    plain copy from the host would wait for the CUDA stream every step), so the same seed gives the
    same numbers on every device; a generator of ``device`` draws there directly.
    """
    if generator is None:  # no generator= keyword: that overload rejects the symbolic shapes of torch.compile(dynamic)
        return sample(shape, dtype=dtype, device=device)
    if generator.device.type == torch.device(device if device is not None else "cpu").type:
        return sample(shape, dtype=dtype, device=device, generator=generator)
    drawn = sample(shape, dtype=dtype, device=generator.device, generator=generator)
    return to_device(drawn, device) if drawn.device.type == "cpu" else drawn.to(device)


class GeneratorAttribute:
    """A module attribute holding ``None`` or a ``torch.Generator``, checked on every assignment.

    Use as a class attribute (``generator = GeneratorAttribute("...doc...")``); assigning anything
    else raises :func:`check_generator`'s ``TypeError``. Reads give ``None`` until one is set.
    """

    def __init__(self, doc: str = "") -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.__dict__.get(self.slot)

    def __set__(self, obj: object, value: object) -> None:
        check_generator(value, self.name)
        obj.__dict__[self.slot] = value


# ------------------------------------------------------------------------ the temperature

# The one contract for a temperature tau: a real number (not a bool) or, where a function takes
# one per batch instance, a real tensor of the batch shape; finite; > 0 where a proposal
# softmax(logits / tau) is sampled, >= 0 where tau = 0 is the deterministic limit
# (gumbel_matching). A wrong type is an ArgumentTypeError, a wrong value a ValueError.


def _tau_type_error(tau: object, name: str, tensors: bool) -> ArgumentTypeError:
    what = "a number or a real tensor of the batch shape" if tensors else "a real number"
    return ArgumentTypeError(f"{name} must be {what}, got {type(tau).__name__}")


def _tau_value_error(tau: object, name: str, positive: bool) -> ValueError:
    if positive:
        return ValueError(f"{name} must be a finite number > 0, got {tau!r}; use a small positive value for "
                          f"near-greedy routing")
    return ValueError(f"{name} must be a finite number >= 0 (0: the deterministic limit), got {tau!r}")


def check_tau(tau: Any, *, positive: bool = False, name: str = "tau") -> float:
    """A temperature given as a number (or a 0-dim real tensor), as a float.

    Args:
        tau: the temperature.
        positive: require ``tau > 0`` (else ``tau >= 0``, ``0`` meaning the deterministic limit).
        name: the argument's name in the error.

    Raises:
        ArgumentTypeError: ``tau`` is a bool or not a real number.
        ValueError: ``tau`` is NaN, infinite, negative, or ``0`` when ``positive``.
    """
    if torch.compiler.is_compiling():  # (checked where it was set: see check_nonneg)
        return tau
    if isinstance(tau, (bool, str, bytes)) or (
        isinstance(tau, Tensor) and (tau.is_complex() or tau.dtype == torch.bool)
    ):
        raise _tau_type_error(tau, name, tensors=False)
    try:  # numbers, one-element tensors and 0-dim arrays (NumPy 2 refuses float() of [0.5])
        t = float(tau)
    except (TypeError, ValueError, RuntimeError):
        raise _tau_type_error(tau, name, tensors=False) from None
    if not (math.isfinite(t) and (t > 0.0 if positive else t >= 0.0)):
        raise _tau_value_error(tau, name, positive)
    return t


def tau_tensor(tau: Any, batch: torch.Size, like: Tensor, name: str = "tau") -> tuple[Tensor, Tensor]:
    """A positive temperature, one number or one per batch instance, as a tensor; no host sync.

    Args:
        tau: a real number or a real tensor of shape ``batch`` (or 0-dim).
        batch: the batch shape ``[...]`` of the caller's ``[..., n, k]`` input.
        like: a tensor whose dtype and device the result takes.
        name: the argument's name in the error.

    Returns:
        ``(T, invalid)``: ``T`` is ``[..., 1, 1]`` (``[1, 1]`` for a number); ``invalid`` a 0-dim
        bool tensor, True when some temperature is not finite and ``> 0``. Check it in the
        caller's host synchronisation and raise :func:`bad_tau` (the caller knows when it syncs).

    Raises:
        ArgumentTypeError: ``tau`` is a bool, not a number, or a non-real tensor.
        ValueError: ``tau`` is a tensor of another shape.
    """
    if isinstance(tau, bool) or not isinstance(tau, (numbers.Real, Tensor)) or (
        isinstance(tau, Tensor) and not (tau.is_floating_point() or tau.dtype in (torch.int32, torch.int64))
    ):
        raise _tau_type_error(tau, name, tensors=True)
    # (a number filled in on the device: torch.as_tensor(number, device=...) is a sync on CUDA)
    t = device_scalar(tau, like) if isinstance(tau, numbers.Real) else tau.to(dtype=like.dtype, device=like.device)
    if t.ndim > 0 and t.shape != batch:
        raise ValueError(f"{name} must be a number or a tensor of the batch shape {tuple(batch)}, got shape "
                         f"{tuple(t.shape)}")
    invalid = ~torch.isfinite(t).all() | (t <= 0).any()
    T = t.reshape(*batch, 1, 1) if t.ndim > 0 else t.reshape(1, 1)
    return T, invalid


def bad_tau(tau: Any, name: str = "tau", dtype: torch.dtype | None = None) -> ValueError:
    """The ValueError for a temperature :func:`tau_tensor` found invalid (raise it); ``dtype``:
    the one it was converted to, named when a finite positive ``tau`` is 0 or inf there."""
    try:
        values = torch.as_tensor(tau, dtype=torch.float64).reshape(-1)
        in_range = bool(torch.isfinite(values).all() and (values > 0).all())
    except (TypeError, ValueError, RuntimeError):
        in_range = False
    if in_range and dtype is not None:
        info = torch.finfo(dtype)
        return ValueError(f"{name}={tau!r} is finite and > 0, but not representable in the logits' dtype {dtype} "
                          f"(0 or inf there: its positive range is [{info.tiny:.3g}, {info.max:.3g}]); pass a {name} "
                          f"in that range, or float64 logits")
    return _tau_value_error(tau, name, positive=True)


# ---------------------------------------------------------------------------------- tensors


def checks_run() -> bool:
    """Whether the value checks that need a host sync run: always, except while ``torch.compile``
    traces (a data-dependent check there would be a graph break on every call)."""
    return not torch.compiler.is_compiling()


def check_plain_tensor(x: Tensor, name: str, what: str) -> None:
    """NotImplementedError for a tensor whose memory cannot be read: inside ``torch.func``
    transforms (``grad``, ``vmap``) tensors are wrappers without storage, and ``what`` (an exact
    solver that reads its scores' memory and is not differentiable) cannot run on them."""
    try:
        x.data_ptr()
    except RuntimeError:
        raise NotImplementedError(
            f"{what} does not run inside torch.func transforms (grad, vmap): {name} has no storage there. Its "
            "routes are not differentiable: compute them outside the transform, or use torch.autograd") from None


def check_score_maximum(hi: float, name: str) -> None:
    """ValueError naming ``name`` unless ``hi``, the largest entry of a score matrix (``amax``,
    which propagates NaN), is below ``+inf`` and not NaN: the value half of
    :func:`check_score_matrix`, for a caller that reads the maximum together with other values
    (one host synchronisation for all)."""
    if hi != hi:
        raise ValueError(f"{name} contains NaN; fix the upstream computation (NaN scores have no assignment)")
    if hi == float("inf"):
        raise ValueError(f"{name} contains +inf; clamp it to a finite value (only -inf, a forbidden pair, is allowed)")


def check_score_matrix(x: Tensor, name: str, *, allow_neg_inf: bool = True, values: bool = True) -> None:
    """Check that ``x`` is a floating tensor ``[..., n, k]`` without NaN or +inf.

    ``-inf`` entries are allowed when ``allow_neg_inf`` (they mark forbidden pairs). ``values=False``
    checks the type and shape only (for a caller that scans the values itself).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [..., n, k], got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions [..., n, k] (tokens x experts), got shape "
            f"{tuple(x.shape)}; add a trailing experts dimension, e.g. {name}.unsqueeze(-1)"
        )
    if not x.is_floating_point():
        raise ValueError(
            f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}; "
            f"use {name}.float()"
        )
    if x.shape[-2] == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one token and one expert, got shape {tuple(x.shape)}")
    if x.numel() == 0 or not values:
        return
    # One reduction each: amax propagates NaN and reveals +inf; amin reveals -inf.
    check_score_maximum(float(x.detach().amax()), name)
    if not allow_neg_inf and float(x.detach().amin()) == float("-inf"):
        raise ValueError(f"{name} contains -inf, which is not allowed here; clamp it to a finite value")


def device_scalar(value: numbers.Real, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``value`` as a 0-dim tensor on ``like``'s device, in ``dtype`` (default ``like``'s), filled
    there: ``torch.tensor(x, device="cuda")`` and ``torch.as_tensor(x, device="cuda")`` build the
    tensor on the host and copy it with ``non_blocking=False``, so the host waits for everything
    queued on the CUDA stream, a sync in the middle of a step (pytorch#190217; it cost the layer's
    capacity statistic one per training step). The CPU test suite finds such copies
    (``tests/host_syncs.py``).

    A floating ``dtype`` takes the value as ``torch.as_tensor`` would: an integer beyond a
    float64's range becomes ``+-inf``, a finite one beyond the dtype's range rounds to ``+-inf``."""
    dtype = like.dtype if dtype is None else dtype
    if dtype.is_floating_point:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float64
            value = math.inf if value > 0 else -math.inf
        if math.isfinite(value) and abs(value) > torch.finfo(dtype).max:
            # rounded as a conversion rounds it (to inf, or to the largest finite value within half
            # a unit of it): new_full refuses a value it cannot represent
            value = torch.tensor(value, dtype=torch.float64).to(dtype).item()
    return like.new_full((), value, dtype=dtype)


def to_device(host: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """``host`` (a CPU tensor) on ``device``, in ``dtype`` (default its own), without a host sync.

    ``t.to("cuda")`` copies from pageable host memory with ``non_blocking=False``: the host waits for
    everything queued on the CUDA stream (as :func:`device_scalar` says of ``torch.tensor(x,
    device="cuda")``). Here the data goes through pinned memory and is copied with
    ``non_blocking=True``: torch's caching host allocator keeps the pinned block until the copy has
    run, so ``host`` (or the NumPy array under it) may change right after. The dtype is converted on
    the host first (for the small tensors this is for: per-instance prices, temperatures, offsets).
    A CPU ``device`` returns ``host`` itself (converted); other devices, a ``torch.compile`` trace
    (which places its own copies) and a CUDA graph capture take a plain copy. (A captured copy from
    a pinned block would replay from that block after the allocator gave it to someone else; the
    plain copy cannot be captured and says so.)
    """
    device = torch.device(device)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda" and not torch.compiler.is_compiling() and not _capturing():
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_finite(tensors: Tensor | Sequence[Tensor], what: str, fix: str) -> None:
    """ValueError ``"{what} are not finite (NaN or inf): {fix}"`` unless every entry is finite.

    One reduction per tensor and a single host synchronisation for all of them together: the
    only sync such a check adds to a forward pass. Skipped while ``torch.compile`` traces
    (:func:`checks_run`: a data-dependent check there is a graph break, an error with
    ``fullgraph=True``). Empty tensors and meta tensors (no values) pass.
    """
    if not checks_run():
        return
    if isinstance(tensors, Tensor):
        tensors = (tensors,)
    # The largest magnitude of each: inf for an inf entry, NaN for a NaN one (amax propagates NaN).
    # Two kernels per tensor, where torch.isfinite(t).all() takes five (abs, two comparisons, a
    # product, the reduction).
    tops = [t.detach().abs().amax() for t in tensors if t.numel() and t.is_floating_point() and not t.is_meta]
    if not tops:
        return
    # (several: compared in float64, which holds every floating dtype's largest finite value)
    top = tops[0] if len(tops) == 1 else torch.stack([t.double() for t in tops]).amax()
    if not math.isfinite(float(top)):
        raise ValueError(f"{what} are not finite (NaN or inf): {fix}")


def floating_input(x: Tensor, name: str, dtype: torch.dtype) -> Tensor:
    """``x`` cast to the module's compute ``dtype``; ValueError (naming ``name``) unless ``x`` is floating.

    The dtype policy of routelab's modules: any floating input (float16, bfloat16, float32,
    float64) is accepted and computed in the dtype of the module's parameters; the module returns
    its output in the input's dtype. Integer, bool and complex inputs are rejected.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(
            f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}; "
            f"convert it with {name}.float()"
        )
    return x if x.dtype == dtype else x.to(dtype)


def index_tensor(t: object, name: str) -> Tensor:
    """``t`` as a ``LongTensor [tokens, slots]``: TypeError/ValueError naming ``name`` unless ``t``
    is a 2-D tensor of an integer dtype (values are checked by the caller)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a LongTensor [tokens, slots], got {type(t).__name__}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{name} must be an integer tensor (LongTensor [tokens, slots]), got {t.dtype}; "
                         f"indices are whole numbers, e.g. {name}.long() if its values are integral")
    if t.dim() != 2:
        raise ValueError(f"{name} must have 2 dimensions [tokens, slots], got shape {tuple(t.shape)}; "
                         f"for one slot per token use {name}.unsqueeze(-1)")
    return t if t.dtype == torch.long else t.long()


def token_mask(mask: object, shape: Sequence[int] | torch.Size, name: str = "mask") -> Tensor | None:
    """A token mask: ``None`` passes through, else a ``BoolTensor`` of ``shape`` (``True`` = a real
    token, ``False`` = padding that routing must ignore), else a TypeError/ValueError naming ``name``.

    Args:
        mask: ``None`` or a bool tensor.
        shape: the token shape, e.g. ``x.shape[:-1]`` (``[batch, seq]``) or ``[tokens]``.
        name: the argument's name in the errors.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a BoolTensor of the token shape {tuple(shape)} (True = real token) or "
                        f"None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a BoolTensor (True = real token), got {mask.dtype}; use {name} != 0 "
                         f"(e.g. attention_mask.bool())")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have the token shape {tuple(shape)} (x.shape[:-1]), got {tuple(mask.shape)}")
    return mask


def mask_tensor(t: object, name: str, shape: torch.Size) -> Tensor:
    """``t`` if it is a ``BoolTensor`` of ``shape``, else a TypeError/ValueError naming ``name``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a BoolTensor [tokens, slots], got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise ValueError(f"{name} must be a BoolTensor [tokens, slots], got {t.dtype}; use {name} != 0")
    if t.shape != shape:
        raise ValueError(f"{name} must have the shape of expert [tokens, slots] = {tuple(shape)}, "
                         f"got {tuple(t.shape)}")
    return t


# --------------------------------------------------------------------------------- capacity


def resolve_capacity(n: int, k: int, capacity: Any, name: str = "capacity", *, default: str = "exact",
                     at_most_tokens: bool = False, fix: str | None = None,
                     counts: tuple[str, str, str] | None = None) -> int:
    """The per-expert capacity ``c`` of ``n`` tokens on ``k`` experts, every token placed.

    Args:
        n, k: tokens and experts.
        capacity: a positive integer (an integral float such as ``4.0`` is accepted; ``inf``,
            NaN, fractions and bools are not), or ``None`` for the default.
        name: the argument's name in the errors.
        default: what ``None`` means: ``"exact"``, the balanced capacity ``n / k`` (``k`` must
            divide ``n``); ``"ceil"``, ``max(ceil(n / k), 1)``.
        at_most_tokens: return ``min(c, n)`` (a larger capacity could not be filled).
        fix: the advice an error about a too small capacity ends with (default: the smallest
            capacity that works).
        counts: how that error names what is placed, ``n`` and ``k`` (default ``("tokens",
            "n=<n>", "k=<k>")``; the b-matching places ``k n`` (token, expert) pairs on ``E`` experts).

    Raises:
        ValueError: naming ``name``: not a positive integer, ``c * k < n`` (some token could not be
            placed), or ``n / k`` not an integer for the ``"exact"`` default.
    """
    need = -(-n // k)
    advice = fix or f"use {name} >= ceil(n/k) = {need}"
    if capacity is None:
        if default == "ceil":
            c = max(need, 1)
            return min(c, n) if at_most_tokens else c
        if n % k != 0:
            raise ValueError(
                f"n={n} tokens are not divisible by k={k} experts, so the balanced capacity n/k is not an "
                f"integer; pass {name}=ceil(n/k)={need} (or larger) explicitly"
            )
        return n // k
    if isinstance(capacity, bool):
        raise ValueError(f"{name} must be a positive integer, got the bool {capacity!r}")
    if not isinstance(capacity, int):
        try:
            as_int = int(capacity)
        except (TypeError, ValueError, OverflowError, RuntimeError):
            as_int = None
        if as_int is None or as_int != capacity:
            raise ValueError(f"{name} must be a positive integer (tokens per expert), got {capacity!r}")
        capacity = as_int
    if capacity < 1:
        raise ValueError(f"{name} must be a positive integer, got {capacity}" + (f"; {fix}" if fix else ""))
    if capacity * k < n:
        unit, items, bins = counts or ("tokens", f"n={n}", f"k={k}")
        raise ValueError(
            f"{name}={capacity} with {bins} experts holds only {capacity * k} {unit} but {items} must be "
            f"placed; {advice}"
        )
    return min(capacity, n) if at_most_tokens else capacity


def balanced_quotas(num_tokens: int, num_experts: int, k: int = 1) -> tuple[int, int]:
    """The per-expert quotas of a balanced router: ``floor`` and ``ceil`` of ``k * n / E`` pairs.

    A balanced router (BASE, Gumbel-Matching, App. F batchwise gating, Sinkhorn's target) gives
    every expert ``k * n / E`` (token, expert) pairs; when ``E`` does not divide ``k * n``,
    ``r = k * n mod E`` experts take the ceiling and the others the floor (the ``n * k`` pairs
    are all placed). The quota never exceeds ``n``: a token never takes one expert twice.

    Args:
        num_tokens: ``n >= 0``, the real tokens of the batch.
        num_experts: ``E >= 1``.
        k: experts per token, ``1 <= k <= E``.

    Returns:
        ``(floor, ceil)``; equal when ``E`` divides ``k * n``.

    Raises:
        ValueError: naming the argument, for a negative ``n``, ``E < 1`` or ``k`` outside ``[1, E]``.
    """
    num_tokens = check_token_count(num_tokens, "real tokens in the batch")
    check_positive_int("num_experts", num_experts)
    check_k(k, num_experts)
    pairs = k * num_tokens
    return pairs // num_experts, -(-pairs // num_experts)


def check_capacity(capacity: Any, name: str = "capacity") -> int | None:
    """``capacity`` as an ``int >= 0`` (``None`` passes through), else a ValueError naming ``name``.

    The integer rule is :func:`resolve_capacity`'s: integral floats (``4.0``) are accepted; bools,
    ``inf``, NaN, fractions, negative numbers and non-numbers are not. ``0`` is allowed here (an
    empty batch has capacity 0).
    """
    if capacity is None:
        return None
    if isinstance(capacity, numbers.Real) and not isinstance(capacity, (bool, np.bool_)) and capacity == 0:
        return 0
    return resolve_capacity(0, 1, capacity, name)  # 0 tokens, 1 expert: only the integer rule applies


def check_capacity_factor(capacity_factor: Any) -> None:
    """ValueError unless ``capacity_factor`` is ``None`` (dropless) or a finite number ``> 0``.

    Skipped while ``torch.compile`` traces: with ``dynamic=True`` a layer's float attribute is a
    symbolic float there, which ``math.isfinite`` cannot take (every eager call checks it).
    """
    if capacity_factor is None or not checks_run():
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real) or not (
        math.isfinite(capacity_factor) and capacity_factor > 0
    ):
        raise ValueError(
            f"capacity_factor must be a finite number > 0 (or None for dropless routing), got {capacity_factor!r}"
        )


def expert_capacity(num_tokens: int, num_experts: int, slots: float, capacity_factor: float | None) -> int:
    """Capacity ``C = ceil(capacity_factor * tokens * slots / experts)``, at most ``tokens``.

    Args:
        num_tokens: tokens in the batch, an integer ``n >= 0`` (``0``: an empty batch).
        num_experts: ``E``, an integer ``>= 1``.
        slots: average experts per token ``k``, a finite number ``> 0`` (``E`` for dense
            softmax gating).
        capacity_factor: ``> 0``; ``None`` means dropless (``C = n``: an expert can take every
            token, since a token never chooses the same expert twice).

    Returns:
        The capacity (``0`` only when there are no tokens). It never exceeds ``n``: a larger
        capacity could not be filled, so the buffer is not padded beyond it.

    Raises:
        ValueError: naming the argument: ``num_tokens`` not an integer ``>= 0``, ``num_experts``
            not an integer ``>= 1``, ``slots`` not a finite number ``> 0``, ``capacity_factor``
            ``<= 0`` or not finite.
    """
    num_tokens = check_token_count(num_tokens, "tokens in the batch")
    check_positive_int("num_experts", num_experts)
    check_pos("slots", slots)
    if capacity_factor is None:
        return num_tokens
    check_capacity_factor(capacity_factor)
    raw = capacity_factor * num_tokens * slots / num_experts
    if not raw < num_tokens:  # also a huge factor whose product overflows to inf
        return num_tokens
    c = math.ceil(raw - 1e-9)
    return min(max(c, 1 if num_tokens else 0), num_tokens)
