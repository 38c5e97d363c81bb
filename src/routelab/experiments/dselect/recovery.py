"""App. C.2.2 of Hazimeh et al. (2021): can the gate recover the experts that generated the data?

Data: x ~ N(0, I_10); a "data-generating" static MoE of 4 random experts (each a ReLU dense
layer with 4 units), whose average is fed to one logistic unit; labels = 1[logit > 0]. The unit's
bias (not given in the paper) is the negated median logit, so the two labels are equally frequent.
10,000 training and 10,000 validation points. Model: 16 frozen experts, 4 of which are exact
copies of the generating ones (at random positions), the others random; a trainable static gate
(DSelect-k or Top-k, k = 4) mixes them and "the final result is fed into a single logistic unit"
(the paper), which is trained with the gate: started fresh (Glorot-uniform weights, zero bias, the
Keras default) or at the generating unit. (The unit kept frozen at the generating one, the setting
of routelab's first report, is run too, as a reference.) Adam, batch 256, binary cross-entropy;
the learning rate, DSelect-k's entropy coefficient and the number of epochs are chosen on the
validation loss, for DSelect-k only among settings whose S(Z) became binary (the paper's rule).

A run counts how many of the 4 true experts the trained gate selects (nonzero weight); for
DSelect-k only runs with a binary S(Z) count, and the distinct experts picked by the k selectors
are reported. All settings of one repetition train together as one batched model
(:func:`train_rep`; rows are independent, equal to :func:`train_one` run by run); the report is
:mod:`.recovery_report`, the identifiability check :mod:`.identifiability`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from routelab.gates import dselect_weights, keep_top_k, selector_outputs, smooth_step
from routelab.gates.dselect import ENTROPY_EPS, SELECTOR_INITS

from ..kit.divergence import check_finite, diverged_on_error, nonfinite_rows
from ..kit.experiment import Experiment
from ..kit.failed_runs import add_failures_to_report
from ..kit.provenance import CommitStamp
from ..kit.store import append_jsonl_atomic, completed_keys, failed_record, is_failed, read_jsonl, split_failed
from . import identifiability as ident
from .common import Timer, log, make_gate, minibatches, steps_per_epoch

__all__ = ["EXPERIMENT", "RecoverySettings", "RunConfig", "FULL", "QUICK", "UNITS", "KEY", "run_recovery",
           "train_one", "train_rep", "make_problem", "expert_outputs", "initial_unit", "identifiability_record"]

P, UNITS_PER_EXPERT, TRUE_EXPERTS, EXPERTS, K = 10, 4, 4, 16, 4
UNITS = UNITS_PER_EXPERT  # the old name of the expert width, kept for callers

UNIT_KINDS = ("fresh", "generator", "frozen")
"""The output logistic unit: trained from a fresh init, trained from the generating unit, or the
generating unit frozen (the earlier setting, in which the claim cannot show; a reference)."""

KEY = ("gate", "unit", "init", "lr", "entropy_reg", "epochs", "seed")
"""The fields that identify one run in ``runs.jsonl``."""


@dataclass(frozen=True)
class RecoverySettings:
    """Size of the sweep.

    Attributes:
        reps: repetitions (problem seeds 0..reps-1).
        epochs: training epochs (the longest run when ``checkpoints`` is set).
        lrs: Adam learning rates.
        entropy_regs: DSelect-k entropy coefficients.
        checkpoints: epochs at which every run is evaluated and recorded as a run of that many
            epochs (training is deterministic and the same up to there); ``()`` = ``(epochs,)``.
        units: output units (:data:`UNIT_KINDS`).
        inits: DSelect-k selector initialisations (:data:`routelab.gates.dselect.SELECTOR_INITS`).
        gamma: smooth-step width.
        identifiability: run the identifiability check (frozen unit) on every repetition.
        identifiability_fitted: how many repetitions (the first ones) also get the check with a unit
            fitted to each set (the costly part); ``None`` = all.
    """

    reps: int
    epochs: int
    lrs: tuple[float, ...]
    entropy_regs: tuple[float, ...]
    n_train: int = 10_000
    n_val: int = 10_000
    batch: int = 256
    traj_points: int = 200
    quick: bool = False
    checkpoints: tuple[int, ...] = ()
    units: tuple[str, ...] = ("frozen",)
    inits: tuple[str, ...] = ("official",)
    gamma: float = 1.0
    identifiability: bool = False
    identifiability_fitted: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reps, int) or self.reps < 1:
            raise ValueError(f"reps must be a positive int, got {self.reps!r}.")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}.")
        if any(not isinstance(c, int) or not 1 <= c <= self.epochs for c in self.checkpoints):
            raise ValueError(f"checkpoints must be ints in [1, epochs={self.epochs}], got {self.checkpoints!r}.")
        if not self.units or any(u not in UNIT_KINDS for u in self.units):
            raise ValueError(f"units must be a non-empty subset of {UNIT_KINDS}, got {self.units!r}.")
        if not self.inits or any(i not in SELECTOR_INITS for i in self.inits):
            raise ValueError(f"inits must be a non-empty subset of {SELECTOR_INITS}, got {self.inits!r}.")
        if not self.lrs or any(lr <= 0 for lr in self.lrs):
            raise ValueError(f"lrs must be positive learning rates, got {self.lrs!r}.")
        if not self.entropy_regs or any(e < 0 for e in self.entropy_regs):
            raise ValueError(f"entropy_regs must be >= 0, got {self.entropy_regs!r}.")

    @property
    def eval_epochs(self) -> tuple[int, ...]:
        """The epochs at which runs are recorded, ascending."""
        return tuple(sorted(set(self.checkpoints))) if self.checkpoints else (self.epochs,)


FULL = RecoverySettings(reps=20, epochs=200, checkpoints=(50, 200), lrs=(0.1, 0.01, 0.001),
                        entropy_regs=(0.0, 0.001, 0.01), units=("fresh", "generator", "frozen"),
                        inits=("official", "distinct"), identifiability=True)
QUICK = dataclasses.replace(FULL, reps=3, identifiability_fitted=1, quick=True)
"""The quick form: the full grid at full length on the first 3 repetitions (its runs are the full
run's runs of seeds 0-2), the fitted-unit identifiability check on the first."""


@dataclass(frozen=True)
class RunConfig:
    """One setting of the grid (one row of the batched model)."""

    gate: str          # "topk_static" or "dselect_static"
    unit: str          # one of UNIT_KINDS
    init: str | None   # DSelect-k selector init; None for Top-k
    lr: float
    entropy_reg: float


def configs(s: RecoverySettings) -> list[RunConfig]:
    """The grid of ``s``: per unit, Top-k at every lr and DSelect-k at every (init, lr, entropy)."""
    out = []
    for unit in s.units:
        out += [RunConfig("topk_static", unit, None, lr, 0.0) for lr in s.lrs]
        out += [RunConfig("dselect_static", unit, init, lr, er)
                for init, lr, er in product(s.inits, s.lrs, s.entropy_regs)]
    return out


def make_problem(seed: int, s: RecoverySettings) -> dict[str, Any]:
    """Data, the 16 frozen experts (weights ``[16, 10, 4]``, biases ``[16, 4]``), the true set."""
    g = torch.Generator().manual_seed(10_000 + seed)
    w_true = torch.randn(TRUE_EXPERTS, P, UNITS_PER_EXPERT, generator=g) / P**0.5
    b_true = torch.randn(TRUE_EXPERTS, UNITS_PER_EXPERT, generator=g) * 0.1
    head_w = torch.randn(UNITS_PER_EXPERT, generator=g)
    x = torch.randn(s.n_train + s.n_val, P, generator=g)
    h = torch.relu(torch.einsum("bi,nio->bno", x, w_true) + b_true).mean(dim=1)
    # The unit's bias is the negated median logit, so both labels are equally frequent: the experts'
    # outputs are ReLUs (>= 0), and with a zero bias 9 of the first 20 problems had >= 99 % of one
    # label (3 had a single label), on which no gate, true or not, can be told apart.
    head_b = -(h @ head_w).median()
    y = ((h @ head_w + head_b) > 0).float()
    w_all = torch.randn(EXPERTS, P, UNITS_PER_EXPERT, generator=g) / P**0.5
    b_all = torch.randn(EXPERTS, UNITS_PER_EXPERT, generator=g) * 0.1
    true_pos = torch.randperm(EXPERTS, generator=g)[:TRUE_EXPERTS]
    w_all[true_pos] = w_true
    b_all[true_pos] = b_true
    return dict(x_tr=x[: s.n_train], y_tr=y[: s.n_train], x_va=x[s.n_train:], y_va=y[s.n_train:],
                w=w_all, b=b_all, head_w=head_w, head_b=head_b, true=sorted(true_pos.tolist()))


def expert_outputs(prob: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    """The 16 frozen experts on ``x [B, 10]``: ``[B, 16, 4]``."""
    return torch.relu(torch.einsum("bi,nio->bno", x, prob["w"]) + prob["b"])


def initial_unit(unit: str, prob: dict[str, Any], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The output unit's start ``(w [4], b [])``: the generating unit, or (``"fresh"``) Glorot-uniform
    weights (bound sqrt(6 / (4 + 1)), Keras' default) from seed ``30_000 + seed`` and a zero bias."""
    if unit not in UNIT_KINDS:
        raise ValueError(f"unit must be one of {UNIT_KINDS}, got {unit!r}.")
    if unit != "fresh":
        return prob["head_w"].clone(), prob["head_b"].clone()
    g = torch.Generator().manual_seed(30_000 + seed)
    bound = (6.0 / (UNITS_PER_EXPERT + 1)) ** 0.5
    return (torch.rand(UNITS_PER_EXPERT, generator=g) * 2 - 1) * bound, torch.zeros(())


def _forward(gate: nn.Module, prob: dict[str, Any], x: torch.Tensor,
             unit: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits ``[B]`` of one gate's model on ``x [B, 10]``; ``unit`` = (w, b), default the generating one."""
    w_u, b_u = unit if unit is not None else (prob["head_w"], prob["head_b"])
    e = expert_outputs(prob, x)                                              # [B, 16, 4]
    w = gate(x.shape[0])                                                     # [B, 16]
    mix = torch.einsum("bn,bno->bo", w, e)
    return mix @ w_u + b_u


def _selector_picks(z: torch.Tensor, gamma: float) -> list[int]:
    """The expert each selector puts most weight on, ``z [k, m]`` -> k ints (its pick when binary)."""
    return selector_outputs(z, gamma)[:, :EXPERTS].argmax(dim=-1).tolist()


def _summary(w: torch.Tensor, true: list[int]) -> dict[str, Any]:
    selected = sorted(torch.nonzero(w).flatten().tolist())
    return {"selected": selected, "recovered": len(set(selected) & set(true)),
            "mistakes": len(set(selected) - set(true)), "mass_on_true": float(w[true].sum()),
            "weights": [round(v, 6) for v in w.tolist()]}


def train_one(kind: str, lr: float, entropy_reg: float, seed: int, s: RecoverySettings,
              prob: dict[str, Any], record_traj: bool, *, unit: str = "frozen",
              init: str = "official") -> dict[str, Any]:
    """Train one gate (and, unless ``unit == "frozen"``, its output unit) for ``s.epochs`` epochs;
    returns the run's record (JSON-ready). The reference for :func:`train_rep`, run by run.

    Raises:
        RunDiverged: the loss or the parameters became non-finite.
    """
    timer = Timer()
    gate = make_gate(kind, EXPERTS, k=K, input_dim=None, seed=seed, gamma=s.gamma, entropy_reg=entropy_reg,
                     selector_init=init)
    w0, b0 = initial_unit(unit, prob, seed)
    head = nn.ParameterDict({"w": nn.Parameter(w0), "b": nn.Parameter(b0)})
    params = list(gate.parameters()) + ([] if unit == "frozen" else list(head.parameters()))
    opt = torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS)
    bce = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(20_000 + seed)
    total = s.epochs * steps_per_epoch(s.n_train, s.batch, drop_last=False)
    every = max(1, total // s.traj_points)
    traj: list[list[float]] = []
    changes = changes_late = 0
    prev_support: tuple[int, ...] | None = None
    for _, step, idx in minibatches(s.n_train, s.batch, s.epochs, gen, drop_last=False):
        gate.on_step(step, total)
        opt.zero_grad()
        with diverged_on_error(gate, step):
            loss = bce(_forward(gate, prob, prob["x_tr"][idx], (head["w"], head["b"])), prob["y_tr"][idx])
            loss = loss + gate.regularization()
        check_finite(step, loss=loss)
        loss.backward()
        opt.step()
        gate.track(step)
        w = gate._last_weights[0]          # the weights of this step's forward (before the update)
        support = tuple(torch.nonzero(w).flatten().tolist())
        if prev_support is not None and support != prev_support:
            changes += 1
            if step >= total // 2:
                changes_late += 1
        prev_support = support
        if record_traj and step % every == 0:
            traj.append([round(v, 5) for v in w.tolist()])
    check_finite(total - 1, params=gate)
    with torch.no_grad():
        logits = _forward(gate, prob, prob["x_va"], (head["w"], head["b"]))
        val_loss = float(bce(logits, prob["y_va"]))
        val_acc = float(((logits > 0).float() == prob["y_va"]).float().mean())
        train_loss = float(bce(_forward(gate, prob, prob["x_tr"], (head["w"], head["b"])), prob["y_tr"]))
        w = gate(1)[0]
    rep = gate.report()
    picks = _selector_picks(gate.z.detach(), s.gamma) if kind == "dselect_static" else None
    return {
        "gate": kind, "unit": unit, "init": init if kind == "dselect_static" else None, "lr": lr,
        "entropy_reg": entropy_reg, "epochs": s.epochs, "seed": seed,
        "val_loss": val_loss, "val_acc": val_acc, "train_loss": train_loss, "true": prob["true"],
        **_summary(w, prob["true"]),
        "selector_picks": picks, "distinct": len(set(picks)) if picks is not None else None,
        "support_changes": changes, "support_changes_second_half": changes_late,
        "binary": rep.get("binary"), "binary_step": rep.get("binary_step"),
        "unit_w": [round(v, 6) for v in head["w"].detach().tolist()], "unit_b": round(float(head["b"].detach()), 6),
        "steps": total, "wall_s": timer(),
        "traj_every": every if record_traj else None, "traj": traj if record_traj else None,
    }


ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8
"""torch.optim.Adam's defaults, used by :func:`train_one` (torch's Adam) and :class:`_Bank` (row-wise)."""


class _Bank(nn.Module):
    """Every setting of one repetition as one batched model: R static gates and their output units
    as stacked parameters, each row with its own learning rate.

    DSelect-k rows: ``alpha [Rd, k]``, ``z [Rd, k, m]``; Top-k rows: ``logits [Rt, n]``; every row:
    ``unit_w [R, 4]``, ``unit_b [R]``. Each row starts exactly as :func:`train_one`'s gate and unit
    and is updated by Adam with its own learning rate (:meth:`adam_step`); rows share nothing.
    """

    def __init__(self, rows: Sequence[RunConfig], seed: int, prob: dict[str, Any], gamma: float) -> None:
        super().__init__()
        self.rows = list(rows)
        self.gamma = gamma
        self.d_rows = [i for i, c in enumerate(self.rows) if c.gate == "dselect_static"]
        self.t_rows = [i for i, c in enumerate(self.rows) if c.gate == "topk_static"]
        if len(self.d_rows) + len(self.t_rows) != len(self.rows):
            raise ValueError(f"unknown gate in {[c.gate for c in self.rows]}; use dselect_static or topk_static.")
        alphas, zs, logits = [], [], []
        for c in self.rows:
            gate = make_gate(c.gate, EXPERTS, k=K, input_dim=None, seed=seed, gamma=gamma, entropy_reg=c.entropy_reg,
                             selector_init=c.init or "official")
            if c.gate == "dselect_static":
                alphas.append(gate.alpha.detach())
                zs.append(gate.z.detach())
            else:
                logits.append(gate.logits.detach())
        m = zs[0].shape[-1] if zs else 0
        self.alpha = nn.Parameter(torch.stack(alphas) if alphas else torch.zeros(0, K))
        self.z = nn.Parameter(torch.stack(zs) if zs else torch.zeros(0, K, m))
        self.logits = nn.Parameter(torch.stack(logits) if logits else torch.zeros(0, EXPERTS))
        units = [initial_unit(c.unit, prob, seed) for c in self.rows]
        self.unit_w = nn.Parameter(torch.stack([u[0] for u in units]))
        self.unit_b = nn.Parameter(torch.stack([u[1] for u in units]))
        self.register_buffer("frozen", torch.tensor([c.unit == "frozen" for c in self.rows]))
        self.register_buffer("ent", torch.tensor([self.rows[i].entropy_reg for i in self.d_rows]))
        self.register_buffer("d_index", torch.tensor(self.d_rows, dtype=torch.long))
        order = self.d_rows + self.t_rows
        self.register_buffer("inv", torch.argsort(torch.tensor(order)))
        lr = torch.tensor([c.lr for c in self.rows])
        # per parameter: the learning rate of each of its rows, shaped to broadcast over the row
        self._lr = {"alpha": lr[self.d_rows].view(-1, 1), "z": lr[self.d_rows].view(-1, 1, 1),
                    "logits": lr[self.t_rows].view(-1, 1), "unit_w": lr.view(-1, 1), "unit_b": lr}
        self._adam: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._t = 0

    def weights(self) -> torch.Tensor:
        """Expert weights ``[R, n]``: eq. 6 for DSelect-k rows, softmax(KeepTopK) for Top-k rows."""
        parts = []
        if self.d_rows:
            parts.append(dselect_weights(self.alpha, self.z, EXPERTS, self.gamma))      # [Rd, n]
        if self.t_rows:
            parts.append(torch.softmax(keep_top_k(self.logits, K), dim=-1))               # [Rt, n]
        return torch.cat(parts)[self.inv]

    def penalty(self) -> torch.Tensor:
        """Per-row entropy regularizer ``[R]`` (0 for Top-k rows): lambda * sum_i h(r(S(z^(i))))."""
        out = torch.zeros(len(self.rows), dtype=self.z.dtype)
        if self.d_rows and bool((self.ent > 0).any()):
            r = selector_outputs(self.z, self.gamma)                                # [Rd, k, 2^m]
            ent = -(r * torch.log(r + ENTROPY_EPS)).sum(dim=(-1, -2))               # [Rd]
            out = out.index_put((self.d_index,), self.ent * ent)
        return out

    def logits_of(self, w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Model logits ``[R, B]`` from weights ``w [R, n]`` and expert outputs ``e [B, n, 4]``."""
        mix = torch.einsum("rn,bno->rbo", w, e)
        return torch.einsum("rbo,ro->rb", mix, self.unit_w) + self.unit_b.unsqueeze(-1)

    @torch.no_grad()
    def adam_step(self) -> None:
        """One Adam step (torch.optim.Adam's update, defaults) on every row with the row's learning
        rate; the frozen-unit rows' units get a zero gradient, so they stay exactly fixed."""
        self._t += 1
        b1, b2 = ADAM_BETAS
        c1, c2 = 1 - b1 ** self._t, (1 - b2 ** self._t) ** 0.5
        for name, p in self.named_parameters():
            if p.grad is None or p.numel() == 0:
                continue
            g = p.grad
            if name.startswith("unit_"):
                g = g.masked_fill(self.frozen.view(-1, *([1] * (g.dim() - 1))), 0.0)
            m, v = self._adam.get(name, (torch.zeros_like(p), torch.zeros_like(p)))
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            self._adam[name] = (m, v)
            p.sub_(self._lr[name] / c1 * m / (v.sqrt() / c2 + ADAM_EPS))
            p.grad = None

    def binary(self) -> torch.Tensor:
        """Bool ``[Rd]``: S(z) of the row is all 0/1."""
        s = smooth_step(self.z.detach(), self.gamma)
        return ((s == 0) | (s == 1)).flatten(1).all(-1)

    def row_params(self) -> dict[str, torch.Tensor]:
        """Every parameter as ``[R, ...]`` (gate rows of the other kind filled with 0), for divergence checks."""
        R = len(self.rows)
        d = torch.zeros(R, K * (1 + self.z.shape[-1]))
        if self.d_rows:
            d[self.d_rows] = torch.cat([self.alpha.detach(), self.z.detach().flatten(1)], dim=-1)
        t = torch.zeros(R, EXPERTS)
        if self.t_rows:
            t[self.t_rows] = self.logits.detach()
        return {"gate": d, "topk_logits": t, "unit_w": self.unit_w.detach(), "unit_b": self.unit_b.detach()}


def _row_losses(bank: _Bank, e: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [R, n], per-row training objective [R])`` on one batch: mean BCE + entropy penalty."""
    w = bank.weights()
    logits = bank.logits_of(w, e)
    bce = F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none").mean(-1)
    return w, bce + bank.penalty()


def train_rep(rows: Sequence[RunConfig], seed: int, s: RecoverySettings, prob: dict[str, Any],
              record_traj: bool) -> list[dict[str, Any]]:
    """Train every setting in ``rows`` on one problem at once, as one batched model (rows never
    interact: each has its own parameters, loss term, learning rate and Adam state).

    Returns:
        One record per row and evaluation epoch (``s.eval_epochs``), as :func:`train_one` would
        return for that many epochs; a row whose loss or parameters became non-finite gets a
        failed record (kit's :func:`~routelab.experiments.kit.store.failed_record`) at every
        evaluation epoch from the step it failed.
    """
    timer = Timer()
    bank = _Bank(rows, seed, prob, s.gamma)
    e_tr, e_va = expert_outputs(prob, prob["x_tr"]), expert_outputs(prob, prob["x_va"])
    gen = torch.Generator().manual_seed(20_000 + seed)
    per_epoch = steps_per_epoch(s.n_train, s.batch, drop_last=False)
    evals = {ep * per_epoch - 1: ep for ep in s.eval_epochs}
    total = s.epochs * per_epoch
    every = max(1, total // s.traj_points)
    failed: dict[int, tuple[str, int]] = {}
    binary_step = torch.full((len(bank.d_rows),), -1, dtype=torch.long)
    changed = torch.zeros(total, len(bank.rows), dtype=torch.bool)   # per step: the support changed
    prev: torch.Tensor | None = None
    traj: list[torch.Tensor] = []
    records: list[dict[str, Any]] = []
    for _, step, idx in minibatches(s.n_train, s.batch, s.epochs, gen, drop_last=False):
        w, loss = _row_losses(bank, e_tr[idx], prob["y_tr"][idx])
        for r, why in nonfinite_rows(step, loss=loss.detach()).items():
            failed.setdefault(r, (why, step))
        loss.sum().backward()
        bank.adam_step()
        support = w.detach() > 0
        if prev is not None:
            changed[step] = (support != prev).any(-1)
        prev = support
        if record_traj and step % every == 0:
            traj.append(w.detach().clone())
        if bank.d_rows:
            binary_step = torch.where((binary_step < 0) & bank.binary(), step, binary_step)
        if step in evals:
            with torch.no_grad():
                for r, why in nonfinite_rows(step, params=bank.row_params()).items():
                    failed.setdefault(r, (why, step))
                last = evals[step] == s.eval_epochs[-1]
                records += _evaluate(bank, evals[step], step + 1, seed, s, prob, e_tr, e_va, failed,
                                     binary_step.tolist(), changed, traj if record_traj and last else None,
                                     every, timer())
    return records


def _evaluate(bank: _Bank, epochs: int, steps: int, seed: int, s: RecoverySettings,
              prob: dict[str, Any], e_tr: torch.Tensor, e_va: torch.Tensor, failed: dict[int, tuple[str, int]],
              binary_step: list[int], changed: torch.Tensor, traj: list[torch.Tensor] | None,
              every: int, wall: float) -> list[dict[str, Any]]:
    """The records of every row of ``bank`` after ``steps`` training steps (= ``epochs`` epochs)."""
    w = bank.weights()
    va = bank.logits_of(w, e_va)
    tr = bank.logits_of(w, e_tr)
    y_va, y_tr = prob["y_va"], prob["y_tr"]
    val_loss = F.binary_cross_entropy_with_logits(va, y_va.expand_as(va), reduction="none").mean(-1)
    train_loss = F.binary_cross_entropy_with_logits(tr, y_tr.expand_as(tr), reduction="none").mean(-1)
    val_acc = ((va > 0).float() == y_va).float().mean(-1)
    binary = bank.binary()
    late = changed[steps // 2: steps].sum(0)
    early = changed[:steps].sum(0)
    tr_stack = torch.stack(traj) if traj else None                                  # [T, R, n]
    out = []
    for r, c in enumerate(bank.rows):
        key = {"gate": c.gate, "unit": c.unit, "init": c.init, "lr": c.lr, "entropy_reg": c.entropy_reg,
               "epochs": epochs, "seed": seed}
        if r in failed:
            out.append(failed_record(key, failed[r][0], failed[r][1]))
            continue
        rec: dict[str, Any] = {**key, "val_loss": float(val_loss[r]), "val_acc": float(val_acc[r]),
                               "train_loss": float(train_loss[r]), "true": prob["true"], **_summary(w[r], prob["true"])}
        if c.gate == "dselect_static":
            j = bank.d_rows.index(r)
            picks = _selector_picks(bank.z[j].detach(), s.gamma)
            rec.update(selector_picks=picks, distinct=len(set(picks)), binary=bool(binary[j]),
                       binary_step=binary_step[j] if binary_step[j] >= 0 else None)
        else:
            rec.update(selector_picks=None, distinct=None, binary=None, binary_step=None)
        rec.update(support_changes=int(early[r]), support_changes_second_half=int(late[r]),
                   unit_w=[round(v, 6) for v in bank.unit_w[r].tolist()], unit_b=round(float(bank.unit_b[r]), 6),
                   steps=steps, wall_s=wall, batched_rows=len(bank.rows),
                   traj_every=every if tr_stack is not None else None,
                   traj=[[round(v, 4) for v in row] for row in tr_stack[:, r].tolist()] if tr_stack is not None
                   else None)
        out.append(rec)
    return out


def identifiability_record(seed: int, s: RecoverySettings, prob: dict[str, Any], fitted: bool = True
                           ) -> dict[str, Any]:
    """Where the true set ranks among all C(16, 4) = 1,820 equal-weight sets under the training loss,
    with the frozen generating unit and (if ``fitted``) with a unit fitted to each set
    (:mod:`.identifiability`); the ``fitted_*`` fields are None when not ``fitted``."""
    timer = Timer()
    e = expert_outputs(prob, prob["x_tr"])
    rec: dict[str, Any] = {"seed": seed, "true": prob["true"], "n_sets": 0}
    for name, fit in (("frozen", False), ("fitted", True)):
        if fit and not fitted:
            rec.update({f"{name}_{f}": None for f in ("rank", "true_loss", "best_loss", "best_true_count")})
            continue
        sets, loss = ident.set_losses(e, prob["y_tr"], prob["head_w"], prob["head_b"], TRUE_EXPERTS, fit_unit=fit)
        match = (sets == torch.tensor(prob["true"])).all(-1)
        best = int(loss.argmin())
        rec["n_sets"] = int(sets.shape[0])
        rec[f"{name}_rank"] = ident.true_set_rank(sets, loss, prob["true"])
        rec[f"{name}_true_loss"] = float(loss[match])
        rec[f"{name}_best_loss"] = float(loss[best])
        rec[f"{name}_best_true_count"] = len(set(sets[best].tolist()) & set(prob["true"]))
    rec["wall_s"] = timer()
    return rec


_FITTED_FIELDS = ("rank", "true_loss", "best_loss", "best_true_count")


def _n_fitted(s: RecoverySettings) -> int:
    """How many repetitions (the first ones) ``s`` plans the fitted-unit identifiability check for."""
    return s.reps if s.identifiability_fitted is None else min(s.reps, s.identifiability_fitted)


def _ident_for_plan(records: Sequence[dict[str, Any]], s: RecoverySettings) -> dict[int, dict[str, Any]]:
    """``{seed: record}`` for the repetitions of ``s`` whose identifiability check is done: the last
    record of the seed that has the fitted-unit part wherever ``s`` plans it (the first
    ``s.identifiability_fitted`` repetitions, all when ``None``). A record without it (a quick run's
    beyond repetition 0) does not count for a plan that fits that repetition; a record with it where
    ``s`` does not plan it is given without its ``fitted_*`` fields, so the report covers ``s``'s plan."""
    n_fitted = _n_fitted(s)
    out: dict[int, dict[str, Any]] = {}
    for rec in records:
        seed = rec["seed"]
        if seed >= s.reps:
            continue
        if seed < n_fitted:
            if rec.get("fitted_rank") is not None:
                out[seed] = rec
        else:
            out[seed] = {**rec, **{f"fitted_{f}": None for f in _FITTED_FIELDS}}
    return out


def run_recovery(out_dir: Path, s: RecoverySettings) -> Path:
    """Run (or resume) the sweep of ``s``, then write report.md, the figure and results.csv.

    Resumes by repetition: a repetition with every run of the grid recorded in ``runs.jsonl`` is
    not trained again; otherwise it is trained and its missing runs appended. The identifiability
    records go to ``identifiability.jsonl``, one per repetition; a repetition's check is done when
    a record of it has what ``s`` plans for it (:func:`_ident_for_plan`: the fitted-unit part too
    on the first ``s.identifiability_fitted`` repetitions), so a full run into a directory of a
    quick run (fitted check on repetition 0 only) computes the others again and appends them.
    """
    from .recovery_report import write_report

    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    path, ipath = out_dir / "runs.jsonl", out_dir / "identifiability.jsonl"
    done = completed_keys(path, KEY)
    stamp = CommitStamp("dselect-recovery")  # the commit on every record, a warning when resuming another's
    timer = Timer()
    rows = configs(s)
    keys = [(c.gate, c.unit, c.init, c.lr, c.entropy_reg, ep) for c in rows for ep in s.eval_epochs]
    for seed in range(s.reps):          # training first: the headline
        missing = [k for k in keys if k + (seed,) not in done]
        if not missing:
            continue
        stamp.before_training(read_jsonl(path))
        recs = train_rep(rows, seed, s, make_problem(seed, s), record_traj=(seed == 0))
        want = set(missing)
        for rec in recs:
            if tuple(rec[f] for f in KEY[:-1]) in want:
                append_jsonl_atomic(path, stamp(rec))
        n_failed = sum(is_failed(r) for r in recs)
        log(f"dselect-recovery rep {seed + 1}/{s.reps}: {len(recs)} runs ({n_failed} failed) in {timer():.0f}s so far")
    n_fitted = _n_fitted(s)
    idone = _ident_for_plan(read_jsonl(ipath), s)
    for seed in range(s.reps if s.identifiability else 0):   # then the identifiability check
        if seed in idone:
            continue
        rec = identifiability_record(seed, s, make_problem(seed, s), fitted=seed < n_fitted)
        append_jsonl_atomic(ipath, stamp(rec))
        log(f"dselect-recovery rep {seed + 1}/{s.reps} identifiability: the true set ranks {rec['frozen_rank']} "
            f"(frozen unit), {rec['fitted_rank']} (fitted unit) of {rec['n_sets']}")
    planned = set(keys)
    everything = read_jsonl(path)
    records = [r for r in everything if tuple(r[f] for f in KEY[:-1]) in planned and r["seed"] < s.reps]
    by_seed = _ident_for_plan(read_jsonl(ipath), s) if s.identifiability else {}
    idents = [by_seed[seed] for seed in sorted(by_seed)]
    ok, failed = split_failed(records)
    report = write_report(out_dir, ok, s, timer(), idents, unused=len(everything) - len(records))
    return add_failures_to_report(report, failed, len(records), KEY)


EXPERIMENT = Experiment(
    "dselect-recovery",
    "Hazimeh et al. 2021 App. C.2.2: expert recovery by DSelect-k vs Top-k (Fig. 2, C.7-C.8)",
    run_recovery,
    FULL,
    QUICK,
    quick_seconds=75,  # measured 2026-11-25 on this project's 2-core machine
)
"""The registered experiment (``routelab reproduce dselect-recovery``)."""
