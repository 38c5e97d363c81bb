"""The baseline gates DSelect-k is compared with (Hazimeh et al. 2021, Sec. 2, 4, App. C.1, D).

All share the :class:`~routelab.gates.mtl_gate.MTLGate` interface, so each is a drop-in
replacement for :class:`~routelab.gates.dselect.DSelectK` in
:class:`routelab.layers.MultiGateMoE`:

* :class:`SoftmaxGate` — softmax(Ax + b) (static: softmax(b)); dense.
* :class:`TopKGate` — softmax(KeepTopK(Ax + b, k)) (Shazeer et al. 2017, no noise);
  static or per-example.
* :class:`GumbelSoftmaxGate` — App. D: d_i = softmax(alpha)_i U_i with binary U_i ~ Bernoulli(pi_i)
  learned by the Gumbel-softmax trick (straight-through, so U is exactly binary in the forward
  pass); sparsity penalty lambda * sum_i log pi_i. Static.
* :class:`SoftmaxSelectorGate` — the App. C.1 ablation: DSelect-k with each binary-code selector
  replaced by softmax(beta_i / T); :func:`ablation_annealing` anneals T log-linearly,
  :func:`ablation_entropy` adds the entropy regularizer instead. Static.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._checks import check_finite, check_k, check_nonneg, check_pos, check_positive_int, check_seed, floating_input
from ..replay import NoiseReplay
from .dselect import ALPHA_INIT, ENTROPY_EPS
from .mtl_gate import MTLGate, uniform_init
from .protocol import GateOutput

__all__ = [
    "SoftmaxGate",
    "TopKGate",
    "GumbelSoftmaxGate",
    "SoftmaxSelectorGate",
    "ablation_annealing",
    "ablation_entropy",
    "keep_top_k",
]


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """KeepTopK: ``logits [..., n]`` with all but the k largest entries set to -inf.

    Ties go to the lowest index, deterministically on every device: the kept entries are the
    first k of a stable descending sort (``torch.topk`` leaves the order of ties unspecified).

    Raises:
        TypeError: ``logits`` is not a tensor.
        ValueError: ``logits`` is not a floating tensor with at least one dimension, or ``k`` is
            not an integer in ``[1, n]``.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor [..., n], got {type(logits).__name__}")
    if logits.dim() < 1:
        raise ValueError("logits must have shape [..., n] (one entry per expert), got a scalar")
    floating_input(logits, "logits", logits.dtype)  # the floating check only (no cast)
    check_k(k, logits.shape[-1])
    idx = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, idx, True)
    return logits.masked_fill(~mask, float("-inf"))


class _LogitGate(MTLGate):
    """Shared logits: a parameter ``[n]`` (static) or ``nn.Linear(p, n)`` (per-example)."""

    def __init__(self, num_experts: int, *, per_example: bool, input_dim: int | None,
                 generator: torch.Generator | None) -> None:
        super().__init__(num_experts, per_example=per_example, input_dim=input_dim)
        n = num_experts
        if self.per_example:
            assert self.input_dim is not None
            self.A = nn.utils.skip_init(nn.Linear, self.input_dim, n)  # (no draw from the global generator)
            with torch.no_grad():
                self.A.weight.copy_(uniform_init((n, self.input_dim), ALPHA_INIT, generator))
                self.A.bias.copy_(uniform_init((n,), ALPHA_INIT, generator))
        else:
            self.logits = nn.Parameter(uniform_init((n,), ALPHA_INIT, generator))

    def scores(self, x: torch.Tensor | int) -> tuple[torch.Tensor, int]:
        b = self._check_x(x)
        if self.per_example:
            assert isinstance(x, torch.Tensor)
            s = self.A(floating_input(x, "x", self.A.weight.dtype))
            if self.check_finite:
                check_finite(s, "gate logits (A x + b)", "the input x contains NaN/inf or the gate's weights diverged")
            return s, b
        return self.logits.unsqueeze(0), b


class SoftmaxGate(_LogitGate):
    """Dense softmax gate: ``[batch, p] -> [batch, n]`` weights softmax(Ax + b) (static: softmax(b)).

    Args:
        num_experts: n. per_example / input_dim: as :class:`MTLGate`.
        generator: optional torch.Generator for the (uniform ±0.05) initialisation.
    """

    def __init__(self, num_experts: int, *, per_example: bool = False, input_dim: int | None = None,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(num_experts, per_example=per_example, input_dim=input_dim, generator=generator)

    def gate(self, x: torch.Tensor | int) -> GateOutput:
        s, b = self.scores(x)
        return GateOutput(self._output(torch.softmax(s, dim=-1).expand(b, self.num_experts), x))


class TopKGate(_LogitGate):
    """Top-k gate: ``[batch, p] -> [batch, n]`` weights softmax(KeepTopK(Ax + b, k)).

    Args:
        num_experts: n. k: experts kept, 1 <= k <= n. per_example / input_dim: as :class:`MTLGate`.
        generator: optional torch.Generator for the initialisation.
    """

    def __init__(self, num_experts: int, k: int, *, per_example: bool = False,
                 input_dim: int | None = None, generator: torch.Generator | None = None) -> None:
        check_k(k, check_positive_int("num_experts", num_experts))
        super().__init__(num_experts, per_example=per_example, input_dim=input_dim, generator=generator)
        self.k = k

    def gate(self, x: torch.Tensor | int) -> GateOutput:
        s, b = self.scores(x)
        return GateOutput(self._output(torch.softmax(keep_top_k(s, self.k), dim=-1).expand(b, self.num_experts), x))


class GumbelSoftmaxGate(MTLGate):
    """Gumbel-softmax gate of App. D (static): d_i = softmax(alpha)_i U_i, U_i in {0, 1}.

    In training, U_i is a straight-through Gumbel-softmax sample of Bernoulli(pi_i),
    pi = sigmoid(beta), at temperature ``temperature`` (exactly binary forward, relaxed
    gradient); in eval mode U_i = 1[pi_i > 1/2]. Penalty: ``aux["sparsity"] = sparsity_reg *
    sum_i log pi_i``. :meth:`report` adds the expected number of nonzeros sum_i pi_i; after a
    forward on an empty batch it reports the eval-mode weights softmax(alpha) * 1[pi > 1/2] (no
    noise is drawn for a report).

    The noise generator's state is saved in ``state_dict()`` (the gate's extra state,
    :meth:`get_extra_state`), so a run resumed from a checkpoint draws the noise of the
    uninterrupted run.

    Args:
        num_experts: n.
        temperature: Gumbel-softmax temperature (> 0).
        sparsity_reg: lambda >= 0.
        seed: seed of the gate's own torch.Generator for the Gumbel noise (same seed, same run),
            an integer in ``[0, 2**64)``. ``None`` (default): drawn from torch's global generator
            when the gate is built (after the initialisation of alpha and beta), so the gates of
            one model (e.g. the per-task gates of a multi-gate MoE) draw independent noise and
            ``torch.manual_seed`` makes the run reproducible. The seed used is :attr:`seed`.
        generator: optional generator for the initialisation.
        input_dim: accepted for interchangeability (ignored: the gate is static).
    """

    def __init__(self, num_experts: int, *, temperature: float = 1.0, sparsity_reg: float = 0.0,
                 seed: int | None = None, generator: torch.Generator | None = None,
                 input_dim: int | None = None) -> None:
        super().__init__(num_experts, per_example=False, input_dim=input_dim)
        self.temperature = check_pos("temperature", temperature)
        self.sparsity_reg = check_nonneg("sparsity_reg", sparsity_reg)
        n = num_experts
        self.alpha = nn.Parameter(uniform_init((n,), ALPHA_INIT, generator))
        # start with every expert likely on (pi ~ 0.73), as a sparsifying penalty then prunes
        self.beta = nn.Parameter(1.0 + uniform_init((n,), ALPHA_INIT, generator))
        if seed is None:  # one draw from the global generator: distinct per gate, fixed by torch.manual_seed
            seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.seed = check_seed(seed)
        self.noise = torch.Generator().manual_seed(self.seed)
        self._replay = NoiseReplay()

    @property
    def exact_zeros(self) -> bool:  # type: ignore[override]
        """In training an expert switched off (``U_i = 0``) still has the straight-through gradient."""
        return not self.training

    def probabilities(self) -> torch.Tensor:
        """pi = P(U_i = 1): ``[n]``."""
        return torch.sigmoid(self.beta)

    def get_extra_state(self) -> dict[str, Any]:
        """The training state outside the parameters, saved in ``state_dict()``: ``{"noise": the
        noise generator's state}`` (a ``uint8`` tensor)."""
        return {"noise": self.noise.get_state()}

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved (``load_state_dict``): the noise continues
        where it was when the state was saved."""
        noise = state.get("noise") if isinstance(state, dict) else None
        if not isinstance(noise, torch.Tensor) or noise.dtype != torch.uint8:
            raise ValueError(
                "GumbelSoftmaxGate extra state must be a dict {'noise': uint8 tensor} (what get_extra_state() "
                f"saves in state_dict()), got {state!r}; load a state_dict saved from a GumbelSoftmaxGate"
            )
        try:
            self.noise.set_state(noise.detach().cpu())
        except RuntimeError as exc:
            raise ValueError(f"GumbelSoftmaxGate extra state: 'noise' is not a CPU generator state ({exc})") from exc

    def _parameter_weights(self) -> torch.Tensor:
        """The eval-mode weights ``[1, n]``, softmax(alpha) * 1[pi > 1/2]: no noise is drawn."""
        with torch.no_grad():
            u = (self.probabilities() > 0.5).to(self.alpha.dtype)
            return (torch.softmax(self.alpha, dim=-1) * u).unsqueeze(0)

    def gate(self, x: torch.Tensor | int) -> GateOutput:
        b = self._check_x(x)
        if self.training:
            # two-class Gumbel-softmax on logits [log pi, log(1 - pi)] = [logsigmoid(b), logsigmoid(-b)]
            logits = torch.stack([nn.functional.logsigmoid(self.beta),
                                  nn.functional.logsigmoid(-self.beta)], dim=-1)     # [n, 2]
            with self._replay.draw(self.noise):  # checkpointing's recomputation redraws the same noise
                u = torch.rand(logits.shape, generator=self.noise).clamp_(1e-10, 1 - 1e-10)
            # drawn on the CPU (the generator's device), used where the gate's parameters are
            g = -torch.log(-torch.log(u)).to(device=logits.device, dtype=logits.dtype)
            soft = torch.softmax((logits + g) / self.temperature, dim=-1)[..., 0]
            hard = (soft > 0.5).to(soft.dtype)
            u_bin = hard + soft - soft.detach()
        else:
            u_bin = (self.probabilities() > 0.5).to(self.alpha.dtype)
        weights = torch.softmax(self.alpha, dim=-1) * u_bin
        aux = {}
        if self.sparsity_reg > 0:
            aux["sparsity"] = self.sparsity_reg * nn.functional.logsigmoid(self.beta).sum()
        return GateOutput(self._output(weights.unsqueeze(0).expand(b, self.num_experts), x), aux)

    def report(self) -> dict[str, Any]:
        out = super().report()
        out["expected_nonzeros"] = float(self.probabilities().detach().sum())
        return out


class SoftmaxSelectorGate(MTLGate):
    """App. C.1 ablation (static): h = sum_i softmax(alpha)_i softmax(beta^(i) / T).

    Args:
        num_experts: n. k: number of selectors (1 <= k <= n).
        temperature: initial T (> 0).
        final_temperature: if given, T is annealed log-linearly from ``temperature`` to it over
            training (via :meth:`on_step`); "Ablation (Annealing)".
        entropy_reg: coefficient of sum_i h(softmax(beta^(i)/T)) (>= 0); "Ablation (Entropy)".
        generator: optional generator for the initialisation (alpha, beta uniform ±0.05).
        input_dim: accepted for interchangeability (ignored: the gate is static).
    """

    def __init__(self, num_experts: int, k: int, *, temperature: float = 1.0,
                 final_temperature: float | None = None, entropy_reg: float = 0.0,
                 generator: torch.Generator | None = None, input_dim: int | None = None) -> None:
        super().__init__(num_experts, per_example=False, input_dim=input_dim)
        self.k = check_k(k, num_experts)
        self.initial_temperature = check_pos("temperature", temperature)
        self.final_temperature = (None if final_temperature is None
                                  else check_pos("final_temperature", final_temperature))
        self.temperature = self.initial_temperature
        self.entropy_reg = check_nonneg("entropy_reg", entropy_reg)
        self.alpha = nn.Parameter(uniform_init((k,), ALPHA_INIT, generator))
        self.beta = nn.Parameter(uniform_init((k, num_experts), ALPHA_INIT, generator))

    def on_step(self, step: int, total_steps: int) -> None:
        """Anneal T log-linearly: T = T0 (T1 / T0)^(step / (total_steps - 1))."""
        if self.final_temperature is None:
            return
        frac = min(max(step / max(total_steps - 1, 1), 0.0), 1.0)
        self.temperature = self.initial_temperature * (self.final_temperature / self.initial_temperature) ** frac

    def selectors(self) -> torch.Tensor:
        """The k softmax selectors ``[k, n]``."""
        beta = self.beta if self.beta.dtype in (torch.float32, torch.float64) else self.beta.float()
        # (in >= float32: beta / 1e-16 overflows half precision)
        return torch.softmax(beta / self.temperature, dim=-1).to(self.beta.dtype)

    def gate(self, x: torch.Tensor | int) -> GateOutput:
        b = self._check_x(x)
        r = self.selectors()
        weights = (torch.softmax(self.alpha, dim=-1).unsqueeze(-1) * r).sum(dim=0)
        aux = {}
        if self.entropy_reg > 0:
            aux["entropy"] = self.entropy_reg * (-(r * torch.log(r + ENTROPY_EPS)).sum())
        return GateOutput(self._output(weights.unsqueeze(0).expand(b, self.num_experts), x), aux)

    def report(self) -> dict[str, Any]:
        out = super().report()
        w = self._report_weights()  # (an empty batch: the weights of the parameters)
        if w is not None:  # softmax never gives exact zeros; also count weights >= 1e-3
            out["experts_above_1e-3"] = float((w[0] >= 1e-3).sum())
        out["argmax_experts"] = sorted(set(self.selectors().argmax(dim=-1).tolist()))
        return out


def ablation_annealing(num_experts: int, k: int, *, temperature: float = 1.0,
                       final_temperature: float = 1e-16, **kw: Any) -> SoftmaxSelectorGate:
    """Ablation (Annealing) of App. C.1: softmax selectors whose temperature is annealed
    log-linearly down to ``final_temperature`` (App. D.4: 1e-16). The paper tunes the starting
    temperature over a grid from 1e-6 to 1e-2 (its text lost the exponents' signs; "down to
    1e-16" implies them); the default 1.0 starts the selectors soft at this gate's
    initialisation (logits uniform in ±0.05): pass ``temperature=`` to follow the paper's grid."""
    return SoftmaxSelectorGate(num_experts, k, temperature=temperature,
                               final_temperature=final_temperature, **kw)


def ablation_entropy(num_experts: int, k: int, *, entropy_reg: float = 0.01, **kw: Any) -> SoftmaxSelectorGate:
    """Ablation (Entropy) of App. C.1: softmax selectors with the entropy regularizer."""
    return SoftmaxSelectorGate(num_experts, k, entropy_reg=entropy_reg, **kw)
