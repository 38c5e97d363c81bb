"""DSelect-k (Hazimeh et al. 2021): a continuously differentiable, sparse gate with binary codes.

Functional core :func:`dselect_weights` and the module :class:`DSelectK` (static, Sec. 3.1, and
per-example, Sec. 3.2), with the entropy regularizer, the App. B.2 penalty for a number of
experts that is not a power of 2, and convergence reporting. Defaults follow the official
TensorFlow implementation: gamma = 1, Z (or the bias and weights of W) uniform in
±gamma/100, selector logits alpha (or G) uniform in ±0.05, entropy -sum p log(p + 1e-6), summed
over the examples of the batch for the per-example gate (Sec. 3.2: one term per example).

Two exceptions, where routelab differs from the official code:

* The entropy regularizer is computed over all 2^m codes of each selector, h(r(S(z^(i)))) with
  r of 2^m entries as in the paper (App. B.2: r(S(z)) is a distribution over 2^m codes). The
  official code computes it over the n real codes only; the two differ when n is not a power of
  2 (then the unused codes' mass counts here and not there).
* The App. B.2 unused-code penalty of a per-example gate is averaged over the batch by default;
  the official code sums it over the examples (``unused_reduction="sum"``). The paper states the
  penalty for one selector and does not say. See :class:`DSelectK`.

A routelab option that is not in the paper, ``selector_init="distinct"``, starts the k selectors
on k different experts (symmetry breaking); see :data:`SELECTOR_INITS`.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import torch
from torch import nn

from .._checks import ArgumentTypeError, check_finite, check_k, check_nonneg, check_positive_int, floating_input
from .mtl_gate import MTLGate, uniform_init
from .protocol import GateOutput
from .smooth_step import check_gamma, smooth_step

__all__ = ["dselect_weights", "selector_outputs", "num_code_bits", "DSelectK", "ENTROPY_EPS", "UNUSED_FLOOR",
           "ENTROPY_REDUCTIONS", "SELECTOR_INITS", "DISTINCT_CODE_OFFSET"]

ENTROPY_EPS = 1e-6
"""The epsilon of the official entropy regularizer, -sum p log(p + eps)."""

UNUSED_FLOOR = 1e-6
"""Smallest selector mass on the real experts that the App. B.2 penalty divides by.

The penalty ``1 / sum_{e < n} r_e`` is infinite when a selector sits entirely on unused codes;
its value is computed with the mass floored here (at most ``1e6`` per selector) while the gradient
still flows through the unfloored mass, so value and gradient stay finite and point the same way.
Above the floor the penalty is exactly the paper's."""

ALPHA_INIT = 0.05
"""Half-width of the uniform init of the selector logits (Keras RandomUniform default)."""

ENTROPY_REDUCTIONS = ("sum", "mean")
"""How a per-example gate reduces the per-example entropy terms over the batch: ``"sum"`` (the
paper's objective, Sec. 3.2, and the official code; the default) or ``"mean"`` (batch average)."""

SELECTOR_INITS = ("official", "distinct")
"""Selector initialisations. ``"official"`` (default, the paper's code): every code logit uniform in
±gamma/100, so all k selectors start near the uniform distribution and receive nearly the same
gradient (they tend to move together). ``"distinct"`` (a routelab option, not in the paper): k
different experts c_1..c_k are drawn from ``generator`` and selector i's code logits start at
``DISTINCT_CODE_OFFSET * gamma * (2 bit_j(c_i) - 1)`` plus the official noise, so selector i starts
with the most weight on expert c_i while every S(z) stays strictly inside (0, 1) (trainable)."""

DISTINCT_CODE_OFFSET = 0.25
"""|z| / gamma of the ``"distinct"`` initialisation: S(±gamma/4) = 0.84375 / 0.15625 per bit."""


def num_code_bits(num_experts: int) -> int:
    """m = ceil(log2 n): the bits of one selector's code (0 for a single expert)."""
    check_positive_int("num_experts", num_experts)
    return (num_experts - 1).bit_length()


def selector_outputs(z: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """The single expert selectors r(S(z)) of eq. 4 over all 2^m codes.

    Args:
        z: ``[..., m]`` code logits.
        gamma: smooth-step width.

    Returns:
        ``[..., 2^m]``: entry e is prod_j (S(z_j) if bit j of e is set else 1 - S(z_j)); each
        row is a probability vector (Prop. 2).

    Raises:
        TypeError: ``z`` is not a tensor.
        ValueError: ``z`` is a scalar or not floating, or ``gamma`` is not a valid width.
    """
    if not isinstance(z, torch.Tensor):
        raise TypeError(f"z must be a torch.Tensor [..., m] of code logits, got {type(z).__name__}")
    if z.dim() < 1:
        raise ValueError("z must have shape [..., m] (m code bits; m = 0 for one expert), got a scalar")
    floating_input(z, "z", z.dtype)  # the floating check only (no cast)
    s = smooth_step(z, gamma)
    m = z.shape[-1]
    # Built bit by bit (a Kronecker product): after bit j, entry e < 2^(j+1) holds
    # prod_{j' <= j} (S(z_j') if bit j' of e is set else 1 - S(z_j')); m cheap ops instead of a
    # [..., 2^m, m] product (whose backward is slow).
    r = torch.ones(z.shape[:-1] + (1,), dtype=z.dtype, device=z.device)
    for j in range(m):
        sj = s[..., j: j + 1]
        r = torch.cat([r * (1.0 - sj), r * sj], dim=-1)
    return r


def _check_dselect_args(alpha: torch.Tensor, z: torch.Tensor, num_experts: int) -> int:
    if not isinstance(alpha, torch.Tensor) or not isinstance(z, torch.Tensor):
        raise ArgumentTypeError(f"alpha and z must be torch tensors ([..., k] and [..., k, m]), got "
                                f"{type(alpha).__name__} and {type(z).__name__}; convert them with torch.as_tensor.")
    floating_input(alpha, "alpha", alpha.dtype)  # the floating check only (no cast): softmax needs floats
    check_positive_int("num_experts", num_experts)
    if alpha.dim() < 1:
        raise ValueError("alpha must have shape [..., k], got a scalar.")
    k = alpha.shape[-1]
    if k < 1:
        raise ValueError("alpha must have k >= 1 entries in its last dim.")
    if k > num_experts:
        raise ValueError(f"k = {k} (alpha's last dim) must be <= num_experts = {num_experts}.")
    m = num_code_bits(num_experts)
    if z.dim() != alpha.dim() + 1 or z.shape[:-1] != alpha.shape or z.shape[-1] != m:
        raise ValueError(
            f"z must have shape [..., k, m] = {tuple(alpha.shape) + (m,)} for alpha of shape "
            f"{tuple(alpha.shape)} and num_experts = {num_experts} (m = ceil(log2 n) = {m}); "
            f"got {tuple(z.shape)}."
        )
    return m


def dselect_weights(alpha: torch.Tensor, z: torch.Tensor, num_experts: int,
                    gamma: float = 1.0) -> torch.Tensor:
    """DSelect-k's expert weights, eq. 6: sum_i softmax(alpha)_i r(S(z^(i))).

    Args:
        alpha: ``[..., k]`` selector logits.
        z: ``[..., k, m]`` code logits, m = ceil(log2 num_experts).
        num_experts: n. When n is not a power of 2 only the first n of the 2^m codes have an
            expert; the result keeps those n entries (it sums to <= 1; see the App. B.2 penalty
            in :class:`DSelectK`).
        gamma: smooth-step width (> 0).

    Returns:
        ``[..., num_experts]`` nonnegative weights; at most k nonzero when S(z) is binary.

    Raises:
        ValueError: on mismatched shapes, k > num_experts, gamma <= 0, or ``alpha`` or ``z`` not
            a floating tensor.
    """
    check_gamma(gamma)
    _check_dselect_args(alpha, z, num_experts)
    r = selector_outputs(z, gamma)                               # [..., k, 2^m]
    w = torch.softmax(alpha, dim=-1).unsqueeze(-1)               # [..., k, 1]
    return (w * r).sum(dim=-2)[..., :num_experts]


class DSelectK(MTLGate):
    """The DSelect-k gate, static (Sec. 3.1) or per-example (Sec. 3.2).

    Static: parameters ``alpha [k]`` and ``z [k, m]``; per-example: ``G = nn.Linear(p, k)``
    (alpha = Gx) and ``W = nn.Linear(p, k*m)`` (z^(i) = W^(i) x), both with a bias.

    ``forward(x)`` returns weights ``[batch, num_experts]`` (``x``: ``[batch, input_dim]``; a
    static gate only uses the batch size, or takes an int). The penalties of that call are in
    :attr:`aux` / :meth:`regularization`:

    * ``entropy``: entropy_reg * sum_i h(r(S(z^(i)))), h(p) = -sum p log(p + 1e-6); for the
      per-example gate one such term per example, summed over the batch (the paper's objective,
      Sec. 3.2) or averaged (``entropy_reduction="mean"``);
    * ``unused_codes`` (only when n is not a power of 2): unused_penalty * sum_i 1 / (sum of
      selector i's weight on the n real experts), batch-averaged for per-example gates by
      default; the sum is floored at :data:`UNUSED_FLOOR` for the value (not the gradient), so
      the penalty is finite (App. B.2 divides by 0 when a selector sits on unused codes only).
      The default reduction differs from the official code, which *sums* the penalty over the
      examples of the batch (``unused_reduction="sum"``): for a batch of B examples the official
      penalty is B times the default one (equal for a static gate or B = 1), so the default
      ``unused_penalty = c`` matches the official ``c / B``, and the ratio of this penalty to
      the summed entropy term depends on the batch size.

    The entropy term is over all 2^m codes (the paper, App. B.2); the official code uses only
    the n real codes, which differs when n is not a power of 2 (see the module docstring).

    Dtypes: a per-example gate computes in its parameters' dtype (any floating ``x`` is cast to
    it; integer ``x`` is a ValueError, NaN/inf codes ``G x``, ``W x`` too) and returns the
    weights in ``x``'s dtype; a static gate returns them in ``x``'s dtype when ``x`` is a
    floating tensor, else in its parameters' dtype. Penalties are computed in float32 (or
    float64 for a float64 gate).

    Reporting (:meth:`report`): experts selected per example and on average, whether S(Z) is
    binary, and the first step passed to :meth:`track` at which it was. For a per-example gate
    S(Z) is that of the last non-empty batch: a forward on an empty batch changes neither
    :meth:`is_binary` nor, through :meth:`track`, :attr:`binary_step`.

    ``state_dict()`` holds :attr:`binary_step` (as the extra state, :meth:`get_extra_state`), so a
    resumed run reports the step of the uninterrupted one.

    Args:
        num_experts: n >= 1.
        k: number of selectors, 1 <= k <= n.
        gamma: smooth-step width > 0.
        per_example: static (False) or per-example (True) gating.
        input_dim: width p of x, required when per_example.
        entropy_reg: coefficient of the entropy regularizer (>= 0).
        entropy_reduction: ``"sum"`` (default, the paper) or ``"mean"`` over the examples of a
            batch (per-example gate; a static gate has one term, so both agree).
        selector_init: ``"official"`` (default) or ``"distinct"``; see :data:`SELECTOR_INITS`.
        unused_penalty: coefficient of the App. B.2 penalty (>= 0; the official code uses 1).
        unused_reduction: ``"mean"`` (default, routelab's choice: the penalty does not grow with
            the batch) or ``"sum"`` (the official code; the paper states the penalty for one
            selector only) over the examples of a batch (per-example gate; one term for a static
            gate, so both agree).
        generator: optional torch.Generator for the initialisation (reproducible); anything
            else is a TypeError.
    """

    def __init__(self, num_experts: int, k: int, *, gamma: float = 1.0, per_example: bool = False,
                 input_dim: int | None = None, entropy_reg: float = 0.0,
                 unused_penalty: float = 1.0, generator: torch.Generator | None = None,
                 entropy_reduction: str = "sum", selector_init: str = "official",
                 unused_reduction: str = "mean") -> None:
        super().__init__(num_experts, per_example=per_example, input_dim=input_dim)
        self.k = check_k(k, num_experts)
        self.gamma = check_gamma(gamma)
        self.entropy_reg = check_nonneg("entropy_reg", entropy_reg)
        self.unused_penalty = check_nonneg("unused_penalty", unused_penalty)
        if entropy_reduction not in ENTROPY_REDUCTIONS:
            raise ValueError(f"entropy_reduction must be one of {ENTROPY_REDUCTIONS}, got {entropy_reduction!r}.")
        if unused_reduction not in ENTROPY_REDUCTIONS:
            raise ValueError(f"unused_reduction must be one of {ENTROPY_REDUCTIONS}, got {unused_reduction!r}.")
        if selector_init not in SELECTOR_INITS:
            raise ValueError(f"selector_init must be one of {SELECTOR_INITS}, got {selector_init!r}.")
        self.entropy_reduction = entropy_reduction
        self.unused_reduction = unused_reduction
        self.selector_init = selector_init
        self.m = num_code_bits(num_experts)
        self.power_of_2 = 2**self.m == num_experts
        zr = self.gamma / 100.0
        g = generator
        if self.per_example:
            p = self.input_dim
            assert p is not None
            # Built uninitialised (skip_init): nn.Linear's default init would draw from torch's
            # global generator, shifting every later draw of the user's model, and the values are
            # set from `generator` below. (One expert has m = 0 code bits: W has no outputs, z is
            # empty and the only expert gets weight 1.)
            self.G = nn.utils.skip_init(nn.Linear, p, k)
            with warnings.catch_warnings():  # (m = 0: torch warns that initialising [0, p] is a no-op)
                warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
                self.W = nn.utils.skip_init(nn.Linear, p, k * self.m)
            with torch.no_grad():
                self.G.weight.copy_(uniform_init((k, p), ALPHA_INIT, g))
                self.G.bias.copy_(uniform_init((k,), ALPHA_INIT, g))
                self.W.weight.copy_(uniform_init((k * self.m, p), zr, g))
                self.W.bias.copy_(uniform_init((k * self.m,), zr, g))
                if selector_init == "distinct":
                    self.W.bias.add_(self._distinct_offsets(g).flatten())
        else:
            self.alpha = nn.Parameter(uniform_init((k,), ALPHA_INIT, g))
            z0 = uniform_init((k, self.m), zr, g)
            if selector_init == "distinct":
                z0 = z0 + self._distinct_offsets(g)
            self.z = nn.Parameter(z0)
        self.binary_step: int | None = None
        self._last_s: torch.Tensor | None = None

    def _distinct_offsets(self, generator: torch.Generator | None) -> torch.Tensor:
        """``[k, m]`` code-logit offsets of the ``"distinct"`` init: selector i toward expert c_i,
        c = k distinct experts out of the n real ones (drawn after the official noise)."""
        c = torch.randperm(self.num_experts, generator=generator)[: self.k]          # [k]
        bits = (c.unsqueeze(-1) >> torch.arange(self.m)) & 1                          # [k, m], bit j of c_i
        return (2.0 * bits.to(torch.get_default_dtype()) - 1.0) * (DISTINCT_CODE_OFFSET * self.gamma)

    @property
    def Z(self) -> torch.Tensor:  # noqa: N802 - the paper's name
        """The paper's Z ``[k, m]`` (static gate only; alias of :attr:`z`)."""
        if self.per_example:
            raise AttributeError("a per-example DSelectK has no Z; its codes are W(x) (see .W).")
        return self.z

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, k={self.k}, gamma={self.gamma}, "
                f"per_example={self.per_example}, entropy_reg={self.entropy_reg}, "
                f"entropy_reduction={self.entropy_reduction!r}, unused_reduction={self.unused_reduction!r}, "
                f"selector_init={self.selector_init!r}")

    def codes(self, x: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """alpha ``[batch or 1, k]`` and z ``[batch or 1, k, m]`` for the input ``x``."""
        b = self._check_x(x)
        if self.per_example:
            assert isinstance(x, torch.Tensor)
            x = floating_input(x, "x", self.G.weight.dtype)
            alpha, z = self.G(x), self.W(x).view(b, self.k, self.m)
            if self.check_finite:
                check_finite((alpha, z), "DSelectK codes (G x, W x)",
                             "the input x contains NaN/inf or the gate's weights diverged")
            return alpha, z
        return self.alpha.unsqueeze(0), self.z.unsqueeze(0)

    def gate(self, x: torch.Tensor | int) -> GateOutput:
        """Expert weights ``[batch, num_experts]`` for ``x`` ``[batch, input_dim]`` and the penalties
        (``stats["smooth_step"]``: ``S(z)`` of the codes, detached); stores nothing."""
        b = self._check_x(x)
        alpha, z = self.codes(x)                                   # [B', k], [B', k, m]
        r = selector_outputs(z, self.gamma)                        # [B', k, 2^m]
        w = torch.softmax(alpha, dim=-1).unsqueeze(-1)
        weights = (w * r).sum(dim=-2)[..., : self.num_experts]     # [B', n]
        aux: dict[str, torch.Tensor] = {}
        rp = r if r.dtype in (torch.float32, torch.float64) else r.float()  # penalties in >= float32
        if self.entropy_reg > 0:
            ent = -(rp * torch.log(rp + ENTROPY_EPS)).sum(dim=-1).sum(dim=-1)   # [B']
            aux["entropy"] = self.entropy_reg * (ent.sum() if self.entropy_reduction == "sum" else _mean(ent))
        if not self.power_of_2 and self.unused_penalty > 0:
            real = rp[..., : self.num_experts].sum(dim=-1)         # [B', k]
            # max(real, floor) in value, d real in gradient: finite where App. B.2 divides by 0.
            floored = real + (UNUSED_FLOOR - real.detach()).clamp(min=0.0)
            per_example = (1.0 / floored).sum(dim=-1)              # [B']
            aux["unused_codes"] = self.unused_penalty * (
                per_example.sum() if self.unused_reduction == "sum" else _mean(per_example))
        if weights.shape[0] != b:
            weights = weights.expand(b, self.num_experts)
        return GateOutput(self._output(weights, x), aux, {"smooth_step": smooth_step(z.detach(), self.gamma)})

    def remember(self, out: GateOutput) -> None:
        """As :meth:`MTLGate.remember`, plus ``S(z)`` of the batch for :meth:`is_binary` (not for an
        empty batch, whose S(z) has no entry: "all binary" would hold vacuously)."""
        super().remember(out)
        if out.scores.shape[0] > 0:
            self._last_s = out.stats["smooth_step"]

    def _last_batch_empty(self) -> bool:
        return self._last_weights is not None and self._last_weights.shape[0] == 0

    def is_binary(self) -> bool:
        """Whether S(Z) (static: the parameters; per-example: the last non-empty batch) is all 0/1
        (False for a per-example gate before its first non-empty batch)."""
        if self.per_example:
            if self._last_s is None:
                return False
            s = self._last_s
        else:
            s = smooth_step(self.z.detach(), self.gamma)
        return bool(((s == 0) | (s == 1)).all())

    def track(self, step: int) -> None:
        """Record ``step`` as :attr:`binary_step` the first time S(Z) is binary (a per-example gate
        whose last forward had an empty batch records nothing: that batch showed no codes)."""
        if self.per_example and self._last_batch_empty():
            return
        if self.binary_step is None and self.is_binary():
            self.binary_step = int(step)

    def get_extra_state(self) -> dict[str, Any]:
        """The training state outside the parameters, saved in ``state_dict()``: ``{"binary_step":
        int or None}``."""
        return {"binary_step": self.binary_step}

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved (``load_state_dict``)."""
        step = state.get("binary_step", ...) if isinstance(state, dict) else ...
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
            raise ValueError(
                "DSelectK extra state must be a dict {'binary_step': int or None} (what get_extra_state() "
                f"saves in state_dict()), got {state!r}; load a state_dict saved from a DSelectK"
            )
        self.binary_step = None if step is None else int(step)

    def report(self) -> dict[str, Any]:
        out = super().report()
        out["binary"] = self.is_binary()
        out["binary_step"] = self.binary_step
        return out


def _mean(t: torch.Tensor) -> torch.Tensor:
    """The mean of ``t``'s entries, 0 for an empty ``t`` (a batch of no examples: no penalty, where
    ``t.mean()`` is NaN)."""
    return t.sum() / max(t.numel(), 1)
