"""Block coordinate descent (BCD) training for mixtures of attentive experts, Peng et al. (2020) Alg. 1-3.

The parameters of a model with :class:`~routelab.layers.mae.MixtureOfAttentiveExperts` layers
split into the gates' ``phi`` (every ``layer.gate``) and everything else ``theta`` (the experts'
attention weights and the rest of the model: embeddings, feed-forward layers, ...).

* **G step** (Alg. 1): the output is the gate-weighted mixture (``routing="gate"``); only
  ``phi`` is updated, by plain SGD with its own learning rate (paper: lr 1, no momentum).
* **F step** (Alg. 2): each MAE layer samples one expert per instance from its gate, without
  gradient (``routing="sample"``; a per-position gate draws from the instance's last position,
  see ``MixtureOfAttentiveExperts(sample_per=...)``), and computes with that expert only (the other heads are
  weighted 0, so they get no gradient from that instance); ``theta`` is updated by Adam, ``phi``
  never.
* **BCD epoch** (Alg. 3): at epochs ``e`` with ``e % g_every == 0`` every batch gets a G step
  then an F step; otherwise only F steps (paper: ``g_every = 5``). When an "epoch" is short (a
  few dozen batches) this leaves the gates almost untrained, so the schedule can be set in steps
  instead: ``g_every_steps = m`` takes one G step before every ``m``-th F step (the paper's ratio
  of one G update to five F updates is ``m = 5``), and :meth:`BCDTrainer.g_phase` runs a G-only
  phase (G steps over a list of batches, no F step), e.g. at the end of each epoch so that the
  gates catch up with the experts. :attr:`BCDTrainer.steps` counts every G and F step taken.

The same trainer runs the paper's baselines (``mode``):

* ``"bcd"``: MAE (above);
* ``"uni"``: UNI-MAE, no learned gate: F steps with one expert drawn uniformly per instance,
  and the uniform mixture (plain multi-head attention) at test time; no G steps;
* ``"nobcd"``: NOBCD, joint training: every step uses the gate mixture and updates ``phi`` (SGD)
  and ``theta`` (Adam) together;
* ``"base"``: BASE, the plain transformer: uniform responsibilities (= ``nn.MultiheadAttention``,
  eq. 5), only ``theta`` is trained.

The same trainer fine-tunes (Sec. 5.2) with ``trainable`` restricting ``theta``, e.g. FTG:
``mode="nobcd", trainable=lambda name, p: False`` (gates only).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from routelab.layers.mae import MixtureOfAttentiveExperts, mae_modules

from .._checks import check_generator, check_nonneg, check_pos, check_positive_int

__all__ = ["EVAL_ROUTING", "MODES", "BCDTrainer", "gate_parameter_names"]

MODES: tuple[str, ...] = ("bcd", "uni", "nobcd", "base")
"""Training modes of :class:`BCDTrainer`: MAE with BCD, UNI-MAE, NOBCD, BASE."""

EVAL_ROUTING: dict[str, str] = {"bcd": "gate", "nobcd": "gate", "uni": "uniform", "base": "uniform"}
"""Test-time routing of a model trained in each mode: the gate mixture, or uniform (= MHA, eq. 5)."""


def gate_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of every MAE gate's parameters (``phi``)."""
    names: set[str] = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MixtureOfAttentiveExperts):
            prefix = f"{mod_name}.gate." if mod_name else "gate."
            names.update(prefix + n for n, _ in mod.gate.named_parameters())
    return names


@contextmanager
def _no_grad_for(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Temporarily set ``requires_grad=False`` on ``params`` (restoring each flag after)."""
    params = list(params)
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)


class BCDTrainer:
    """Trains a model with MAE layers by block coordinate descent (or a baseline mode).

    Args:
        model: the model; must contain at least one :class:`MixtureOfAttentiveExperts`.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor`` (mean loss of the batch); the MAE
            layers route according to the step being taken.
        mode: one of :data:`MODES`.
        g_every: G steps are taken in epochs ``e`` with ``e % g_every == 0`` (mode ``"bcd"``;
            ignored when ``g_every_steps`` is set).
        g_every_steps: if set (``m >= 1``), the schedule is in steps: :meth:`train_step` takes a
            G step before the F step whenever the F steps taken so far are a multiple of ``m``
            (one G step per ``m`` F steps, whatever the epoch).
        gate_lr: SGD learning rate of the gates (no momentum; paper: 1).
        lr, betas, weight_decay: Adam's, for ``theta``.
        clip_norm: if set, clip ``theta``'s gradient norm to it before each Adam step.
        trainable: optional filter ``(name, param) -> bool`` over the non-gate parameters; the
            ones it rejects are never updated (fine-tuning FTG / FTG+). Default: all.
        train_gates: if False, the gates are never updated (e.g. ``mode="bcd"`` without G
            steps). Ignored (False) in modes ``"uni"`` and ``"base"``.
        generator: the :class:`torch.Generator` for the experts sampled in F steps (None: each
            MAE layer's own :attr:`~routelab.layers.MixtureOfAttentiveExperts.generator`, kept
            across steps, else torch's global one).

    Every step routes the MAE layers as it needs and leaves them routed as at test time
    (:attr:`eval_routing`), so evaluation after any step (``model.eval()`` does not change the
    routing) uses the gate mixture (or uniform responsibilities), never a sampled expert.

    Attributes:
        optimizer: Adam over the trainable ``theta`` (None if there is none).
        gate_optimizer: SGD over ``phi`` (None if the gates are not trained).
        steps: counts of ``{"g": ..., "f": ..., "joint": ..., "base": ...}`` steps taken.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        *,
        mode: str = "bcd",
        g_every: int = 5,
        g_every_steps: int | None = None,
        gate_lr: float = 1.0,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.98),
        weight_decay: float = 0.0,
        clip_norm: float | None = None,
        trainable: Callable[[str, nn.Parameter], bool] | None = None,
        train_gates: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        check_positive_int("g_every", g_every)  # the paper uses 5
        if g_every_steps is not None:
            check_positive_int("g_every_steps", g_every_steps)
        gate_lr, lr = check_pos("gate_lr", gate_lr), check_pos("lr", lr)
        if clip_norm is not None and clip_norm != float("inf"):  # (inf: measure the norm, never clip, as torch)
            clip_norm = check_pos("clip_norm", clip_norm)  # (a negative norm would scale gradients by it: ascent)
        weight_decay = check_nonneg("weight_decay", weight_decay)
        self.mae = mae_modules(model)
        if not self.mae:
            raise ValueError(
                "model contains no MixtureOfAttentiveExperts layer; build it with "
                "MixtureOfAttentiveExperts (or from_multihead_attention) first."
            )
        self.model = model
        self.loss_fn = loss_fn
        self.mode = mode
        self.g_every = g_every
        self.g_every_steps = g_every_steps
        self.clip_norm = clip_norm
        check_generator(generator)
        self.generator = generator
        gate_names = gate_parameter_names(model)
        named = dict(model.named_parameters())
        self.gate_params: list[nn.Parameter] = [named[n] for n in sorted(gate_names)]
        self.theta_params: list[nn.Parameter] = []
        self.frozen_params: list[nn.Parameter] = []
        for n, p in model.named_parameters():
            if n not in gate_names:
                keep = trainable is None or trainable(n, p)
                (self.theta_params if keep else self.frozen_params).append(p)
        self.train_gates = train_gates and mode in ("bcd", "nobcd")
        self.optimizer = (
            torch.optim.Adam(self.theta_params, lr=lr, betas=betas, weight_decay=weight_decay)
            if self.theta_params
            else None
        )
        self.gate_optimizer = (
            torch.optim.SGD(self.gate_params, lr=gate_lr, momentum=0.0) if self.train_gates else None
        )
        self.steps = {"g": 0, "f": 0, "joint": 0, "base": 0}

    # ------------------------------------------------------------------ routing

    @property
    def eval_routing(self) -> str:
        """The routing at test time: the gate mixture (bcd, nobcd) or uniform (uni, base)."""
        return EVAL_ROUTING[self.mode]

    def set_eval_routing(self) -> None:
        """Route every MAE layer as at test time (:attr:`eval_routing`); their generators stay."""
        for m in mae_modules(self.model):
            m.routing = self.eval_routing

    @contextmanager
    def _routed(self, routing: str, generator: torch.Generator | None = None) -> Iterator[None]:
        """Route every MAE layer by ``routing`` for one step, and as at test time after it (also
        when the step raises): a step never leaves the layers sampling. ``generator`` (the
        trainer's) draws the step's experts where given; each layer's own generator is restored
        after the step (None: the layers draw from their own, else from torch's global one)."""
        mods = mae_modules(self.model)
        own = [m.generator for m in mods]
        for m in mods:
            m.routing = routing
            if generator is not None:
                m.generator = generator
        try:
            yield
        finally:
            for m, g in zip(mods, own, strict=True):
                m.generator = g
            self.set_eval_routing()

    # ------------------------------------------------------------------ steps

    def _zero(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def _forward_backward(self, batch: Any) -> Tensor:
        loss = self.loss_fn(self.model, batch)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}.")
        loss.backward()
        return loss.detach()

    def _step_theta(self) -> None:
        if self.optimizer is None:
            return
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.theta_params, self.clip_norm)
        self.optimizer.step()

    def g_step(self, batch: Any) -> float:
        """Alg. 1: gate mixture forward, update only the gates (SGD). Returns the loss."""
        if self.gate_optimizer is None:
            raise ValueError(f"no G step in mode {self.mode!r} (the gates are not trained).")
        self.model.train()
        self._zero()
        gate_ids = {id(p) for p in self.gate_params}
        others = [p for p in self.model.parameters() if id(p) not in gate_ids]
        with self._routed("gate"), _no_grad_for(others):  # no weight gradients for theta: cheaper, nothing to leak
            loss = self._forward_backward(batch)
        self.gate_optimizer.step()
        self._zero()
        self.steps["g"] += 1
        return float(loss)

    def f_step(self, batch: Any) -> float:
        """Alg. 2: one expert per instance sampled from the gates (uniformly in mode "uni"),
        forward with it only, update ``theta`` (Adam), never the gates. Returns the loss.

        The heads that no instance's expert keeps get exactly zero gradient; Adam's first moment
        from earlier steps (and ``weight_decay``) still moves them, as a dense Adam over the
        shared attention weights does in the paper's fairseq code. With a batch of several
        instances the sampled experts nearly always keep every head between them."""
        if self.mode not in ("bcd", "uni"):
            raise ValueError(f"no F step in mode {self.mode!r}; use train_step().")
        self.model.train()
        self._zero()
        routing = "sample" if self.mode == "bcd" else "uniform_sample"
        with self._routed(routing, self.generator), _no_grad_for(self.gate_params + self.frozen_params):
            loss = self._forward_backward(batch)
        self._step_theta()
        self._zero()
        self.steps["f"] += 1
        return float(loss)

    def joint_step(self, batch: Any) -> float:
        """NOBCD: gate mixture forward; gates (SGD) and ``theta`` (Adam) updated together."""
        self.model.train()
        self._zero()
        with self._routed("gate" if self.mode == "nobcd" else "uniform"), _no_grad_for(self.frozen_params):
            loss = self._forward_backward(batch)
        if self.gate_optimizer is not None:
            self.gate_optimizer.step()
        self._step_theta()
        self._zero()
        self.steps["joint" if self.mode == "nobcd" else "base"] += 1
        return float(loss)

    def takes_g_step(self, epoch: int) -> bool:
        """Whether :meth:`train_step` at ``epoch`` takes a G step before its F step now: by the
        step schedule (``g_every_steps``) if set, else by the epoch schedule (``g_every``)."""
        if self.mode != "bcd" or not self.train_gates:
            return False
        if self.g_every_steps is not None:
            return self.steps["f"] % self.g_every_steps == 0
        return epoch % self.g_every == 0

    def g_phase(self, batches: Iterable[Any]) -> list[float]:
        """A G-only phase: one G step (Alg. 1) per batch, no F step. Returns the losses.

        Raises:
            ValueError: in a mode without G steps (the gates are not trained).
        """
        losses = [self.g_step(batch) for batch in batches]
        self.set_eval_routing()
        return losses

    def train_step(self, batch: Any, epoch: int) -> dict[str, float]:
        """One batch of Alg. 3 (or of the baseline mode) at epoch ``epoch`` (0-based).

        Returns:
            ``{"loss": ...}`` (the F / joint step's loss) plus ``"g_loss"`` if a G step was taken.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer (0-based), got {epoch!r}")
        if self.mode == "bcd":
            out: dict[str, float] = {}
            if self.takes_g_step(epoch):
                out["g_loss"] = self.g_step(batch)
            out["loss"] = self.f_step(batch)
            return out
        if self.mode == "uni":
            return {"loss": self.f_step(batch)}
        return {"loss": self.joint_step(batch)}

    def train_epoch(self, batches: Iterable[Any], epoch: int) -> dict[str, float]:
        """Alg. 3 over ``batches``. Returns mean ``loss`` (and ``g_loss``) and step counts."""
        total, g_total, n, n_g = 0.0, 0.0, 0, 0
        for batch in batches:
            out = self.train_step(batch, epoch)
            total += out["loss"]
            n += 1
            if "g_loss" in out:
                g_total += out["g_loss"]
                n_g += 1
        self.set_eval_routing()
        res = {"loss": total / max(n, 1), "batches": float(n), "g_steps": float(n_g)}
        if n_g:
            res["g_loss"] = g_total / n_g
        return res

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Optimizer states, step counts and the sampling generator's state (not the model)."""
        return {
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "gate_optimizer": None if self.gate_optimizer is None else self.gate_optimizer.state_dict(),
            "steps": dict(self.steps),
            "generator": None if self.generator is None else self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.gate_optimizer is not None and state.get("gate_optimizer") is not None:
            self.gate_optimizer.load_state_dict(state["gate_optimizer"])
        self.steps = dict(state.get("steps", self.steps))
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])
