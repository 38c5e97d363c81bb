"""Training of the five variants (BASE, MAE-7, MAE-6, UNI-MAE-7, NOBCD) and the fine-tuning
runs (Sec. 5.2), resumable: a checkpoint after every epoch, one JSON line per finished run."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from routelab.layers.bcd import BCDTrainer
from routelab.layers.mae import set_routing

from ..kit.divergence import check_finite, diverged_on_error
from .model import LMConfig, TransformerLM, lm_loss

__all__ = [
    "VARIANTS",
    "Schedule",
    "Variant",
    "epoch_batches",
    "evaluate",
    "finetune",
    "run_training",
    "train_variant",
]


@dataclass(frozen=True)
class Variant:
    """One compared model (Sec. 4.1): its trainer mode and experts."""

    name: str
    mode: str  # BCDTrainer mode
    drop_heads: int


VARIANTS: tuple[Variant, ...] = (
    Variant("BASE", "base", 1),
    Variant("MAE-7", "bcd", 1),
    Variant("MAE-6", "bcd", 2),
    Variant("UNI-MAE-7", "uni", 1),
    Variant("NOBCD", "nobcd", 1),
)


@dataclass(frozen=True)
class Schedule:
    """How long and how fast to train.

    Attributes:
        epochs: training epochs; an epoch here is ``batches_per_epoch`` batches (a fixed slice
            of the shuffled training windows, cycling through them).
        batches_per_epoch, batch: batches per epoch and windows per batch.
        lr, warmup: Adam's peak learning rate, linear warm-up steps, then cosine decay to 10%.
        gate_lr: the gates' SGD learning rate (paper: 1; the experiment selects it on dev).
        g_every: G steps every ``g_every`` epochs (paper: 5); used only when ``g_every_steps``
            is None.
        g_every_steps: one G step before every ``g_every_steps``-th F step (the paper's ratio of
            one G update per five F updates is 5), whatever the epoch.
        g_phase: a G-only phase of this many G steps (on the epoch's first batches) at the end
            of every epoch of BCD training, so that the gates catch up with the experts they
            route to (0: none).
        clip_norm: gradient clipping of theta.
        seed: seeds the initialisation, dropout, data order and the sampled experts.
    """

    epochs: int = 8
    batches_per_epoch: int = 60
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 60
    gate_lr: float = 1.0
    g_every: int = 5
    g_every_steps: int | None = 5
    g_phase: int = 10
    clip_norm: float = 1.0
    seed: int = 0


def _lr_at(step: int, total: int, s: Schedule) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = (step - s.warmup) / max(1, total - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


LossFn = Callable[[nn.Module, Tensor], Tensor]
"""``loss_fn(model, batch) -> scalar``: the mean loss of a batch (rows of the data tensor)."""


def lm_targets(batch: Tensor) -> int:
    """The number of predicted tokens of an LM batch ``[batch, seq + 1]`` (the weight of its mean loss)."""
    return batch[:, 1:].numel()


@torch.no_grad()
def evaluate(model: nn.Module, windows: Tensor, routing: str, *, batch: int = 64,
             generator: torch.Generator | None = None, loss_fn: LossFn = lm_loss,
             targets: Callable[[Tensor], int] = lm_targets) -> float:
    """Mean per-target loss over the rows of ``windows`` under ``routing``.

    By default the next-token cross-entropy (nats) of an LM over windows ``[n, seq + 1]``; another
    task passes its ``loss_fn`` (mean over a batch's targets) and ``targets`` (how many targets a
    batch holds), so that batches of unequal size are weighted by their targets.
    """
    was = model.training
    model.eval()
    set_routing(model, routing, generator)
    total, count = 0.0, 0
    try:
        for i in range(0, windows.shape[0], batch):
            b = windows[i: i + batch]
            n = targets(b)
            total += float(loss_fn(model, b)) * n
            count += n
    finally:  # the caller's mode back, also after an error in the loss
        model.train(was)
    return total / count


def epoch_batches(windows: Tensor, s: Schedule, epoch: int) -> list[Tensor]:
    """The batches of ``epoch``: consecutive slices of a per-pass permutation of the windows.

    Pass ``p`` uses the permutation seeded by ``s.seed * 1000 + p``, so the batches depend only
    on ``(s, epoch)`` and a resumed run sees the same ones.
    """
    n = windows.shape[0]
    per_pass = max(1, n // s.batch)
    perms: dict[int, Tensor] = {}
    out = []
    for j in range(s.batches_per_epoch):
        k = epoch * s.batches_per_epoch + j
        p, r = divmod(k, per_pass)
        if p not in perms:
            perms[p] = torch.randperm(n, generator=torch.Generator().manual_seed(s.seed * 1000 + p))
        out.append(windows[perms[p][r * s.batch:(r + 1) * s.batch]])
    return out


def _log(msg: str) -> None:
    print(f"[mae] {msg}", file=sys.stdout, flush=True)


def run_training(
    model: TransformerLM,
    trainer: BCDTrainer,
    train: Tensor,
    dev: Tensor,
    s: Schedule,
    ckpt: Path,
    label: str,
    extra_eval: dict[str, Tensor] | None = None,
    evaluate_fn: Callable[[nn.Module, Tensor, str], float] = evaluate,
    batches_fn: Callable[[Tensor, Schedule, int], list[Tensor]] | None = None,
) -> dict[str, Any]:
    """Epoch loop with a checkpoint after every epoch (resumes from ``ckpt``).

    ``batches_fn(train, s, epoch)`` gives an epoch's batches; it must depend only on its arguments,
    so that a resumed run sees the same ones (default: random windows, :func:`epoch_batches`).

    ``evaluate_fn(model, data, routing) -> loss`` scores ``dev`` (and ``extra_eval``) after every
    epoch (default: the LM's :func:`evaluate`).

    Raises:
        RunDiverged: a loss or a parameter became non-finite (no checkpoint is written for
            that epoch; the caller records the run as failed).
    """
    total = s.epochs * s.batches_per_epoch
    state: dict[str, Any] = {"epoch": 0, "curve": [], "seconds": 0.0}
    torch.manual_seed(s.seed)
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        trainer.load_state_dict(saved["trainer"])
        torch.set_rng_state(saved["rng"])
        if "cuda_rng" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        state = saved["state"]
        _log(f"{label}: resumed at epoch {state['epoch']}")
    for epoch in range(state["epoch"], s.epochs):
        t0 = time.perf_counter()
        model.train()
        batches = (batches_fn or epoch_batches)(train, s, epoch)
        losses, g_losses = [], []
        for j, b in enumerate(batches):
            step = epoch * s.batches_per_epoch + j
            if trainer.optimizer is not None:
                for group in trainer.optimizer.param_groups:
                    group["lr"] = _lr_at(step, total, s)
            with diverged_on_error(model, step):
                out = trainer.train_step(b, epoch)
            check_finite(step, loss=out["loss"])
            losses.append(out["loss"])
            if "g_loss" in out:
                check_finite(step, loss=out["g_loss"])
                g_losses.append(out["g_loss"])
        if s.g_phase and trainer.mode == "bcd" and trainer.train_gates:  # the G-only phase
            with diverged_on_error(model, step):
                phase = trainer.g_phase(batches[: s.g_phase])
            check_finite(step, loss=sum(phase))
            g_losses += phase
        check_finite(step, params=model)  # before the checkpoint: never save a diverged model
        point = {
            "epoch": epoch + 1,
            "step": (epoch + 1) * s.batches_per_epoch,
            "train_loss": sum(losses) / len(losses),
            "g_steps": len(g_losses),
            "g_steps_total": trainer.steps["g"],
            "dev_loss": evaluate_fn(model, dev, trainer.eval_routing),
        }
        if g_losses:
            point["g_loss"] = sum(g_losses) / len(g_losses)
        for name, w in (extra_eval or {}).items():
            point[f"{name}_loss"] = evaluate_fn(model, w, trainer.eval_routing)
        state["curve"].append(point)
        state["epoch"] = epoch + 1
        state["seconds"] += time.perf_counter() - t0
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        saved = {"model": model.state_dict(), "trainer": trainer.state_dict(),
                 "rng": torch.get_rng_state(), "state": state}
        if torch.cuda.is_initialized():  # dropout on a GPU draws from its own generator
            saved["cuda_rng"] = torch.cuda.get_rng_state_all()
        torch.save(saved, tmp)
        tmp.replace(ckpt)
        extra = " ".join(f"{k}={v:.3f}" for k, v in point.items() if k.endswith("_loss"))
        _log(f"{label}: epoch {epoch + 1}/{s.epochs} {extra} ({state['seconds']:.0f}s)")
    return state


def train_variant(
    variant: Variant, cfg: LMConfig, train: Tensor, dev: Tensor, s: Schedule, work: Path,
    name: str | None = None,
) -> tuple[TransformerLM, dict[str, Any]]:
    """Train one variant from scratch (or resume it); returns the model and its curve/time.

    ``name`` (default: the variant's) names the checkpoint ``work / f"{name}.pt"`` and the log
    lines; the state records the G and F steps taken (``state["steps"]``).
    """
    name = name or variant.name
    torch.manual_seed(s.seed)
    model = TransformerLM(replace(cfg, drop_heads=variant.drop_heads))
    trainer = BCDTrainer(
        model, lm_loss, mode=variant.mode, g_every=s.g_every, g_every_steps=s.g_every_steps,
        gate_lr=s.gate_lr, lr=s.lr, clip_norm=s.clip_norm,
        generator=torch.Generator().manual_seed(s.seed + 17),
    )
    state = run_training(model, trainer, train, dev, s, work / f"{name}.pt", name)
    state["steps"] = dict(trainer.steps)
    trainer.set_eval_routing()
    model.eval()
    return model, state


FINETUNE_METHODS: dict[str, str] = {
    "FTG": "gates only (phi), on the gate mixture, SGD",
    "FTG+": "gates (SGD) + every attention output projection W (Adam), on the gate mixture",
    "FTALL": "all parameters, by BCD (a G step and an F step on every batch)",
}


def finetune(
    pretrained: TransformerLM,
    method: str,
    train: Tensor,
    dev: Tensor,
    test: Tensor,
    s: Schedule,
    work: Path,
    label: str,
) -> dict[str, Any]:
    """Fine-tune a copy of the pretrained MAE-7 with ``method`` (FTG, FTG+, FTALL).

    Returns:
        the curve, the best dev loss, the test loss at that epoch, the step reached, and the
        number of parameters updated.
    """
    if method not in FINETUNE_METHODS:
        raise ValueError(f"method must be one of {tuple(FINETUNE_METHODS)}, got {method!r}.")
    torch.manual_seed(s.seed)
    model = TransformerLM(pretrained.cfg)
    model.load_state_dict(pretrained.state_dict())
    filters: dict[str, Callable[[str, nn.Parameter], bool]] = {
        "FTG": lambda n, p: False,
        "FTG+": lambda n, p: ".attn.out_proj." in n,
    }
    s = replace(s, g_phase=0)  # fine-tuning: the methods' own steps only
    if method == "FTALL":
        trainer = BCDTrainer(model, lm_loss, mode="bcd", g_every=1, gate_lr=s.gate_lr, lr=s.lr,
                             clip_norm=s.clip_norm, generator=torch.Generator().manual_seed(s.seed + 17))
    else:
        trainer = BCDTrainer(model, lm_loss, mode="nobcd", gate_lr=s.gate_lr, lr=s.lr,
                             clip_norm=s.clip_norm, trainable=filters[method])
    updated = sum(p.numel() for p in trainer.theta_params) + sum(p.numel() for p in trainer.gate_params)
    state = run_training(model, trainer, train, dev, s, work / f"ft_{label}.pt", f"ft {label}",
                          extra_eval={"test": test})
    best = min(state["curve"], key=lambda c: c["dev_loss"])
    return {
        "curve": state["curve"],
        "best_dev_loss": best["dev_loss"],
        "test_loss_at_best": best["test_loss"],
        "best_step": best["step"],
        "updated_params": updated,
        "seconds": state["seconds"],
    }
