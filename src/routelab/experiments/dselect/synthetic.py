"""App. C.1 of Hazimeh et al. (2021): synthetic multi-task data from a multi-gate MoE.

Groups of 16 regression tasks; each group has its own random MoE of 4 experts (each
expert the sum of 4 ReLU units, weights N(0, 1)); task t of a group outputs sum_i beta^(t)_i
f_i(x), a convex combination of the group's experts (App. C.1: "the output of each task in the
group is a convex combination of the 4 experts"). x ~ N(0, I_10), shared by all tasks. Problems
with T = 16, 32, 64, 128 tasks (groups 1..T/16) are fit by a multi-gate MoE with T/4 trainable
experts of the same form and one static gate per task choosing k = 4 experts. Measured: test MSE
(mean over tasks) and the Jaccard index of the selected expert sets for related (same group) and
unrelated task pairs, with the expected Jaccard index of a gate picking 4 experts uniformly at random.

The paper says "128 tasks in four groups" but also "each group consists of 16 tasks", "T/4
experts, the number used to generate the data" (4 per group) and problems G1, G1∪G2, G1∪G2∪G3,
all four = 16, 32, 64, 128 tasks; these agree only with groups of 16 tasks and T/16 groups, so
128 tasks here are 8 groups of 16 (the report says so).

The paper also says the task weights are drawn from a zero-mean multivariate normal with correlation
0.8 between tasks, which contradicts "convex combination": such weights are negative half the time and
do not sum to 1, so targets take both signs, while the fitted model (experts = sums of ReLUs, convex
gates) predicts only values >= 0 -- the model mis-specification the paper built this data to avoid.
Here the correlated normal draws are mapped onto the simplex by a softmax per task
(:func:`make_problem`): every task is a convex combination, and tasks of a group, whose draws are
correlated, get similar weights. The report states this departure.

A run can collapse: every expert's ReLU units die, the model predicts 0 (a constant) whatever x, and
each gate then reports the same test MSE (that of predicting 0). :func:`train_one` records how many
tasks' test predictions are constant; a run with all of them constant (:func:`collapsed`) is left out of
every statistic of the report and listed there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
from torch import nn

from routelab.gates import keep_top_k, selector_outputs
from routelab.gates.dselect import ALPHA_INIT, ENTROPY_EPS, num_code_bits
from routelab.gates.mtl_gate import uniform_init
from routelab.layers import StackedLinear

from ..kit.claims import (
    HOLDS,
    INCONCLUSIVE,
    NOT_HOLD,
    NOT_MEASURED,
    PARTLY,
    Claim,
    claims_markdown,
    single_seed,
    write_claims_json,
)
from ..kit.divergence import check_finite, diverged_on_error, train_or_fail
from ..kit.experiment import Experiment
from ..kit.failed_runs import add_failures_to_report
from ..kit.provenance import CommitStamp, software_line
from ..kit.stats import Stat, beyond_spread, mean_se, paired_difference, spread_bound
from ..kit.store import append_jsonl_atomic, atomic_write_text, completed_keys, is_failed, read_jsonl, split_failed
from ..kit.tables import md_table
from . import common
from .common import GATE_LABELS, Timer, log, minibatches, steps_per_epoch, write_csv

__all__ = ["EXPERIMENT", "SyntheticSettings", "FULL", "QUICK", "SyntheticProblem", "collapsed", "constant_tasks",
           "make_data", "make_problem", "random_gate_jaccard", "run_synthetic"]

P, UNITS, K, GROUP_TASKS, CORR = 10, 4, 4, 16, 0.8
GROUPS = 8  # 16 tasks each; see the module docstring on the paper's group count
GATES = ("dselect_static", "topk_static", "ablation_annealing", "ablation_entropy")


@dataclass(frozen=True)
class SyntheticSettings:
    """Size of the sweep and the (fixed, untuned) hyperparameters."""

    tasks: tuple[int, ...]
    reps: int
    epochs: int
    n_train: int
    n_test: int
    batch: int = 256
    lr: float = 0.01
    gamma: float = 1.0
    entropy_reg: float = 0.01
    ablation_entropy_reg: float = 0.01
    anneal: tuple[float, float] = (1.0, 1e-3)
    quick: bool = False


FULL = SyntheticSettings(tasks=(16, 32, 64, 128), reps=3, epochs=20, n_train=20_000, n_test=5_000)
QUICK = SyntheticSettings(tasks=(16, 32, 64, 128), reps=1, epochs=20, n_train=20_000, n_test=5_000, quick=True)
"""The quick form: the full run's first repetition (every T, same data and training length; about 30 s on
one core of this project's 2-core machine)."""


class SumOfReLUExperts(nn.Module):
    """n experts f_i(x) = sum_u ReLU(w_iu . x + b_iu): ``[batch, p] -> [batch, n, 1]``."""

    def __init__(self, num_experts: int, generator: torch.Generator) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.units = StackedLinear(num_experts, P, UNITS, activation=torch.relu, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.units(x).sum(dim=-1, keepdim=True)


class StaticGateBank(nn.Module):
    """T static gates of one kind with stacked parameters, evaluated in one call: ``-> [T, n]``.

    With 128 tasks, 128 separate gate modules cost ~0.1-0.5 s per training step on one CPU
    core (Python and autograd overhead per gate), so this experiment evaluates the gates of
    all tasks together through the same functional cores the gate modules use
    (:func:`~routelab.gates.dselect_weights`, :func:`~routelab.gates.selector_outputs`,
    :func:`~routelab.gates.keep_top_k`). The initialisation and penalties are those of
    :class:`~routelab.gates.DSelectK`, :class:`~routelab.gates.TopKGate` and
    :class:`~routelab.gates.SoftmaxSelectorGate`; ``tests/experiments/test_dselect_experiments.py`` checks
    that the bank equals T separate gate modules with the same parameters.
    """

    def __init__(self, kind: str, num_gates: int, num_experts: int, k: int, *, gamma: float = 1.0,
                 entropy_reg: float = 0.0, anneal: tuple[float, float] = (1.0, 1e-3),
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if kind not in GATES:
            raise ValueError(f"kind must be one of {GATES}, got {kind!r}.")
        self.kind, self.num_gates, self.num_experts, self.k = kind, num_gates, num_experts, k
        self.gamma, self.entropy_reg, self.anneal = gamma, entropy_reg, anneal
        self.temperature = anneal[0]
        g = generator
        if kind == "dselect_static":
            m = num_code_bits(num_experts)
            self.alpha = nn.Parameter(uniform_init((num_gates, k), ALPHA_INIT, g))
            self.z = nn.Parameter(uniform_init((num_gates, k, m), gamma / 100, g))
        elif kind == "topk_static":
            self.logits = nn.Parameter(uniform_init((num_gates, num_experts), ALPHA_INIT, g))
        else:
            self.alpha = nn.Parameter(uniform_init((num_gates, k), ALPHA_INIT, g))
            self.beta = nn.Parameter(uniform_init((num_gates, k, num_experts), ALPHA_INIT, g))
        self.aux: torch.Tensor = torch.zeros(())
        self.binary_step: int | None = None

    def on_step(self, step: int, total_steps: int) -> None:
        """Anneal the ablation's temperature log-linearly (same schedule as SoftmaxSelectorGate)."""
        if self.kind == "ablation_annealing":
            frac = min(max(step / max(total_steps - 1, 1), 0.0), 1.0)
            self.temperature = self.anneal[0] * (self.anneal[1] / self.anneal[0]) ** frac

    def selectors(self) -> torch.Tensor:
        """Softmax selectors of the ablations: ``[T, k, n]``."""
        t = self.temperature if self.kind == "ablation_annealing" else 1.0
        return torch.softmax(self.beta / t, dim=-1)

    def forward(self) -> torch.Tensor:
        """Weights ``[T, n]``; the penalty of this call is in :attr:`aux` (a scalar)."""
        self.aux = torch.zeros(())
        if self.kind == "dselect_static":
            # = dselect_weights(alpha, z, n, gamma), sharing r with the entropy term
            r = selector_outputs(self.z, self.gamma)                        # [T, k, 2^m]
            w = (torch.softmax(self.alpha, dim=-1).unsqueeze(-1) * r).sum(dim=1)[:, : self.num_experts]
            if self.entropy_reg > 0:
                self.aux = self.entropy_reg * -(r * torch.log(r + ENTROPY_EPS)).sum()
            if r.shape[-1] != self.num_experts:  # App. B.2 penalty, as DSelectK (coefficient 1)
                self.aux = self.aux + (1.0 / r[..., : self.num_experts].sum(dim=-1)).sum()
            return w
        if self.kind == "topk_static":
            return torch.softmax(keep_top_k(self.logits, self.k), dim=-1)
        r = self.selectors()
        w = (torch.softmax(self.alpha, dim=-1).unsqueeze(-1) * r).sum(dim=1)
        if self.kind == "ablation_entropy" and self.entropy_reg > 0:
            self.aux = self.entropy_reg * -(r * torch.log(r + ENTROPY_EPS)).sum()
        return w

    def is_binary(self) -> list[bool]:
        """Per gate: is S(Z) binary (DSelect-k only)."""
        from routelab.gates import smooth_step

        s = smooth_step(self.z.detach(), self.gamma)
        return ((s == 0) | (s == 1)).flatten(1).all(dim=1).tolist()

    def selected(self) -> list[set[int]]:
        """Per gate, the selected experts: nonzero weights, or each selector's argmax (ablations)."""
        with torch.no_grad():
            if self.kind.startswith("ablation"):
                return [set(row.tolist()) for row in self.selectors().argmax(dim=-1)]
            w = self()
        return [set(torch.nonzero(row).flatten().tolist()) for row in w]


@dataclass(frozen=True)
class SyntheticProblem:
    """The data of one repetition and the group MoEs that generated it.

    Attributes:
        x: inputs ``[N, 10]`` (N = ``n_train + n_test``; training points first).
        y: targets ``[N, 16 * GROUPS]``; the tasks of group g are columns 16g..16g+15.
        expert_weight: the generating experts' unit weights ``[GROUPS, 4, 10, 4]`` (group, expert, input, unit).
        expert_bias: their biases ``[GROUPS, 4, 4]`` (group, expert, unit).
        task_weights: beta ``[GROUPS, 16, 4]`` (group, task, expert): each row on the simplex.
    """

    x: torch.Tensor
    y: torch.Tensor
    expert_weight: torch.Tensor
    expert_bias: torch.Tensor
    task_weights: torch.Tensor


def make_problem(seed: int, s: SyntheticSettings) -> SyntheticProblem:
    """The App. C.1 data of repetition ``seed``, with its generating group MoEs.

    Per group: 4 experts f_i(x) = sum_u ReLU(w_iu . x + b_iu) with N(0, 1) weights; task weights
    beta^(t) = softmax(z^(t)) where the draws z^(t) in R^4 of the group's 16 tasks are zero-mean normal
    with correlation 0.8 between any two tasks (per expert coordinate) and variance 1. The softmax puts
    every task's weights on the simplex, so y^(t) = sum_i beta^(t)_i f_i(x) is the convex combination the
    paper describes (see the module docstring for why not the raw normal draws), and >= 0.
    """
    g = torch.Generator().manual_seed(30_000 + seed)
    n = s.n_train + s.n_test
    x = torch.randn(n, P, generator=g)
    cov = torch.full((GROUP_TASKS, GROUP_TASKS), CORR) + (1 - CORR) * torch.eye(GROUP_TASKS)
    chol = torch.linalg.cholesky(cov)
    ys, ws, bs, betas = [], [], [], []
    for _ in range(GROUPS):
        w = torch.randn(4, P, UNITS, generator=g)
        b = torch.randn(4, UNITS, generator=g)
        f = torch.relu(torch.einsum("bi,nio->bno", x, w) + b).sum(-1)          # [N, 4]
        z = chol @ torch.randn(GROUP_TASKS, 4, generator=g)                    # [16 tasks, 4], corr 0.8 across tasks
        beta = torch.softmax(z, dim=-1)                                        # [16, 4], rows on the simplex
        ys.append(f @ beta.T)                                                  # [N, 16]
        ws.append(w)
        bs.append(b)
        betas.append(beta)
    return SyntheticProblem(x, torch.cat(ys, dim=1), torch.stack(ws), torch.stack(bs), torch.stack(betas))


def make_data(seed: int, s: SyntheticSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[N, 10]`` and y ``[N, 128]`` of :func:`make_problem` (tasks of group g are columns 16g..16g+15)."""
    p = make_problem(seed, s)
    return p.x, p.y


def constant_tasks(pred: torch.Tensor, rtol: float = 1e-6) -> int:
    """How many columns (tasks) of ``pred`` ``[N, T]`` are constant over the N points: their range is at most
    ``rtol`` times their largest magnitude (at least 1). A model whose experts all died predicts exactly 0.

    Raises:
        ValueError: when ``pred`` is not a 2-D tensor with at least one row.
    """
    if pred.dim() != 2 or pred.shape[0] == 0:
        raise ValueError(f"pred must be [N, T] predictions with N >= 1, got shape {tuple(pred.shape)}.")
    spread = pred.amax(0) - pred.amin(0)
    return int((spread <= rtol * pred.abs().amax(0).clamp(min=1.0)).sum())


def collapsed(rec: dict[str, Any]) -> bool:
    """Whether a run's record says its model predicts a constant for every task (e.g. 0: all experts dead);
    a record without ``constant_tasks`` (written before it was recorded) counts as not collapsed."""
    return rec.get("constant_tasks") is not None and rec["constant_tasks"] == rec["tasks"]


def random_gate_jaccard(n: int, k: int = K) -> float:
    """E[|A∩B| / |A∪B|] for two independent uniformly random k-subsets of n experts."""
    total = math.comb(n, k)
    return sum(math.comb(k, j) * math.comb(n - k, k - j) / total * j / (2 * k - j)
               for j in range(0, k + 1) if k - j <= n - k)


def _jaccard(sets: list[set[int]], tasks: int) -> tuple[float | None, float | None]:
    rel, unrel = [], []
    for a, b in combinations(range(tasks), 2):
        j = len(sets[a] & sets[b]) / max(1, len(sets[a] | sets[b]))
        (rel if a // GROUP_TASKS == b // GROUP_TASKS else unrel).append(j)
    return (sum(rel) / len(rel) if rel else None, sum(unrel) / len(unrel) if unrel else None)


def train_one(kind: str, tasks: int, seed: int, s: SyntheticSettings,
              data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Train one multi-gate MoE on the first ``tasks`` tasks; the run's JSON record.

    The model is y_t(x) = sum_i w_t,i f_i(x) (MultiGateMoE with identity towers), written as one
    matmul of the experts' outputs ``[B, n]`` with the gate bank's weights ``[T, n]``. The record holds,
    besides the test MSE and the gates' expert sets, ``constant_tasks`` (tasks whose test predictions are
    constant, :func:`constant_tasks`) and ``dead_experts`` (experts whose output is 0 on every test point):
    a run with every task constant has collapsed (:func:`collapsed`).

    Raises:
        RunDiverged: the loss or a parameter became non-finite (the sweep records the run as failed).
    """
    timer = Timer()
    x, y = data
    y = y[:, :tasks]
    x_tr, y_tr, x_te, y_te = x[: s.n_train], y[: s.n_train], x[s.n_train:], y[s.n_train:]
    n = tasks // 4
    g = torch.Generator().manual_seed(40_000 + seed)
    experts = SumOfReLUExperts(n, g)
    ent = s.entropy_reg if kind == "dselect_static" else s.ablation_entropy_reg
    bank = StaticGateBank(kind, tasks, n, min(K, n), gamma=s.gamma, entropy_reg=ent, anneal=s.anneal,
                          generator=g)
    opt = torch.optim.Adam(list(experts.parameters()) + list(bank.parameters()), lr=s.lr)
    params = [(f"experts.{n}", p) for n, p in experts.named_parameters()]
    params += [(f"gates.{n}", p) for n, p in bank.named_parameters()]
    total = s.epochs * steps_per_epoch(s.n_train, s.batch)
    binary_step = None
    for _, step, idx in minibatches(s.n_train, s.batch, s.epochs, g):
        bank.on_step(step, total)
        opt.zero_grad()
        with diverged_on_error(params, step):
            out = experts(x_tr[idx]).squeeze(-1) @ bank().T                    # [B, T]
            loss = ((out - y_tr[idx]) ** 2).mean(0).sum() / tasks + bank.aux / tasks
        check_finite(step, loss=loss)
        loss.backward()
        opt.step()
        if kind == "dselect_static" and binary_step is None and all(bank.is_binary()):
            binary_step = step
    check_finite(total - 1, params=params)
    with torch.no_grad():
        w = bank()
        f = experts(x_te).squeeze(-1)                                            # [N_test, n]
        out = f @ w.T                                                            # [N_test, T]
        mse = float(((out - y_te) ** 2).mean())
        dead = int((f == 0).all(dim=0).sum())
    sets = bank.selected()
    rel, unrel = _jaccard(sets, tasks)
    binary = bank.is_binary() if kind == "dselect_static" else None
    return {"gate": kind, "tasks": tasks, "seed": seed, "test_mse": mse,
            "jaccard_related": rel, "jaccard_unrelated": unrel,
            "experts_selected_mean": sum(len(a) for a in sets) / tasks,
            "binary_fraction": (sum(binary) / tasks) if binary else None,
            "binary_step": binary_step, "steps": total,
            "constant_tasks": constant_tasks(out), "dead_experts": dead, "wall_s": timer()}


def run_synthetic(out_dir: Path, s: SyntheticSettings) -> Path:
    """Run (or resume) the sweep of ``s`` and write report.md, figure and results.csv."""
    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "runs.jsonl"
    done = completed_keys(path, ("gate", "tasks", "seed"))
    stamp = CommitStamp("dselect-synthetic")  # the commit on every record, a warning when resuming another's
    recorded = read_jsonl(path)
    timer = Timer()
    for seed in range(s.reps):
        data = None
        for tasks in s.tasks:
            for kind in GATES:
                if (kind, tasks, seed) in done:
                    continue
                if data is None:
                    data = make_data(seed, s)
                label = f"dselect-synthetic rep {seed + 1}/{s.reps} T={tasks} {kind}"
                stamp.before_training(recorded)
                rec = train_or_fail(lambda: train_one(kind, tasks, seed, s, data),
                                    {"gate": kind, "tasks": tasks, "seed": seed},
                                    on_fail=lambda why: log(f"{label}: FAILED, {why}"))
                append_jsonl_atomic(path, stamp(rec))
                if not is_failed(rec):
                    log(f"{label}: test MSE {rec['test_mse']:.3f}, J related {rec['jaccard_related']}, "
                        f"{rec['wall_s']:.0f}s")
    # The runs of this plan only: a quick report after a full run into the same directory reports
    # the quick form's runs, not every recorded one.
    records = [r for r in read_jsonl(path) if r["seed"] < s.reps and r["tasks"] in s.tasks and r["gate"] in GATES]
    ok, failed = split_failed(records)
    return add_failures_to_report(write_report(out_dir, ok, s, timer()), failed, len(records),
                                  ("gate", "tasks", "seed"))


def _figure(out_dir: Path, records: list[dict[str, Any]], s: SyntheticSettings) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for kind in GATES:
        for ax, key in zip(axes, ("test_mse", "jaccard_related", "jaccard_unrelated")):
            xs, ms, ses = [], [], []
            for t in s.tasks:
                stat = mean_se(r[key] for r in records if r["gate"] == kind and r["tasks"] == t
                               and r[key] is not None)
                if stat.n:
                    xs.append(t)
                    ms.append(stat.mean)
                    ses.append(stat.se or 0)
            if xs:
                ax.errorbar(xs, ms, yerr=ses, marker="o", capsize=3, label=GATE_LABELS[kind])
    for ax in axes[1:]:
        ax.plot(list(s.tasks), [random_gate_jaccard(t // 4) for t in s.tasks], "k--", label="random gate")
    for ax, title in zip(axes, ("test MSE", "Jaccard, related tasks (higher is better)",
                                "Jaccard, unrelated tasks (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("number of tasks")
        ax.set_title(title)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "fig_c5.png", dpi=110)
    plt.close(fig)
    return "fig_c5.png"


def _collapsed_note(gone: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[str]:
    """The report's lines on collapsed runs (``gone``, left out of every statistic) and on runs some of whose
    tasks (not all) predict a constant (kept)."""
    rule = ("a run *collapses* when every task's test predictions are constant (its experts died: the model "
            "predicts 0 whatever x, so every gate gets the MSE of predicting 0)")
    some = [r for r in runs if r.get("constant_tasks") and not collapsed(r)]
    lines = []
    if gone:
        lines += [f"**Collapsed runs** ({rule}): left out of the table above, the figure and the claims; a claim's "
                  "seed-paired comparison then pairs the other repetitions.", "",
                  md_table(["gate", "tasks", "repetition", "test MSE (= predicting 0)", "dead experts"],
                           [[GATE_LABELS[r["gate"]], r["tasks"], r["seed"] + 1, f"{r['test_mse']:.3f}",
                             f"{r['dead_experts']} of {r['tasks'] // 4}"] for r in gone]), ""]
    else:
        known = sum(r.get("constant_tasks") is not None for r in runs)
        lines += [f"No run collapsed ({rule}; checked on {known} of {len(runs)} runs)." if known else
                  "Collapsed runs could not be checked: these records predate the `constant_tasks` field.", ""]
    if some:
        lines += [f"{len(some)} run(s) kept with some tasks' predictions constant: "
                  + ", ".join(f"{GATE_LABELS[r['gate']]} T = {r['tasks']} repetition {r['seed'] + 1} "
                              f"({r['constant_tasks']} of {r['tasks']} tasks)" for r in some) + ".", ""]
    return lines


def _set_size_caveat(records: list[dict[str, Any]], s: SyntheticSettings) -> list[str]:
    """The report's caveat on the sizes of the expert sets the Jaccard claims compare (from the table's columns)."""
    sizes = [mean_se(r["experts_selected_mean"] for r in records if r["gate"] == "dselect_static"
                     and r["tasks"] == t).mean for t in s.tasks]
    binary = [mean_se(r["binary_fraction"] for r in records if r["gate"] == "dselect_static" and r["tasks"] == t
                      and r["binary_fraction"] is not None).mean for t in s.tasks]
    sizes, binary = [x for x in sizes if x == x], [x for x in binary if x == x]
    if not sizes:
        return []
    what = f"{min(sizes):.2f}–{max(sizes):.2f} on average per T" if len(sizes) > 1 else f"{sizes[0]:.2f} on average"
    why = ""
    if binary:
        why = (f" At the end of training {min(binary):.0%}–{max(binary):.0%} of its gates (per T) have a binary "
               "S(Z): a gate whose S(Z) is not binary gives nonzero weight to more than one expert per selector and "
               "can select more than k (the paper, tuning, keeps only binary solutions), and selectors that end on "
               "the same expert select fewer.")
    return ["Caveat: the paper says both DSelect-k and Top-k select 4 experts per task; here Top-k selects 4 and "
            f"DSelect-k {what} (the column above).{why} The Jaccard comparisons therefore compare sets of different "
            "sizes: a smaller set shares fewer experts with other tasks by that alone, a larger one more.", ""]


def _below(stat: Stat, bound: float) -> str:
    """Holds when the upper end of ``stat``'s 95 % Student-t interval (:func:`.kit.stats.spread_bound`; its
    mean alone for one run) is below ``bound``."""
    if stat.n == 0:
        return NOT_MEASURED
    return HOLDS if stat.mean + spread_bound(stat) < bound else NOT_HOLD


def _verdict(hits: int, against: int, missing: int, total: int, extra: bool = True) -> str:
    """The verdict of a claim "a beats b at every T" from its per-T sides (each T: the seed-paired difference
    beyond its 95 % t interval in the claim's direction (a hit), against it, or within it (a tie)).

    Symmetric in the evidence: not measured when some T has no paired repetition; does not hold when some T
    goes against the claim; holds when every T is a hit (and ``extra``, a further condition of the claim);
    partly when some T are hits and none goes against; inconclusive when every T is a tie (no difference
    beyond the seed spread either way).
    """
    if missing or not total:
        return NOT_MEASURED
    if against:
        return NOT_HOLD
    if hits == total:
        return HOLDS if extra else PARTLY
    if hits:
        return PARTLY
    return f"{INCONCLUSIVE} (a tie at every T: within the 95 % t interval of the seed-paired difference)"


def write_report(out_dir: Path, records: list[dict[str, Any]], s: SyntheticSettings, wall: float) -> Path:
    """Tables, claims, figure and CSV from the recorded runs.

    A collapsed run (:func:`collapsed`: constant predictions for every task) stays in results.csv (its
    ``constant_tasks`` column says so) and is listed in the report, but is left out of every statistic:
    the table's means, the figure and the claims (whose seed-paired comparisons then pair the other
    repetitions only).
    """
    cols = ("gate", "tasks", "seed", "test_mse", "jaccard_related", "jaccard_unrelated",
            "experts_selected_mean", "binary_fraction", "constant_tasks", "dead_experts", "steps", "wall_s")
    write_csv(out_dir / "results.csv", [{"constant_tasks": None, "dead_experts": None, **r} for r in records], cols)
    gone = [r for r in records if collapsed(r)]
    all_runs, records = records, [r for r in records if not collapsed(r)]
    fig = _figure(out_dir, records, s) if records else None

    def cell(kind: str, t: int, key: str, digits: int = 3) -> str:
        return mean_se(r[key] for r in records if r["gate"] == kind and r["tasks"] == t
                            and r[key] is not None).fmt(digits)

    rows = []
    for kind in GATES:
        for t in s.tasks:
            n = sum(1 for r in records if r["gate"] == kind and r["tasks"] == t)
            n_gone = sum(1 for r in gone if r["gate"] == kind and r["tasks"] == t)
            if n or n_gone:
                rows.append([GATE_LABELS[kind], t, n, n_gone, cell(kind, t, "test_mse"),
                             cell(kind, t, "jaccard_related"), cell(kind, t, "jaccard_unrelated"),
                             cell(kind, t, "experts_selected_mean", 2),
                             cell(kind, t, "binary_fraction", 2) if kind == "dselect_static" else "—"])
    rand = [[t, f"{random_gate_jaccard(t // 4):.3f}"] for t in s.tasks]

    def m(kind: str, t: int, key: str) -> float:
        return mean_se(r[key] for r in records if r["gate"] == kind and r["tasks"] == t and r[key] is not None).mean

    def by_seed(kind: str, t: int, key: str) -> dict[int, float | None]:
        return {r["seed"]: r[key] for r in records if r["gate"] == kind and r["tasks"] == t}

    def side(a: str, b: str, t: int, key: str) -> int | None:
        """-1 / +1: a's value below / above b's beyond the 95 % t interval of the seed-paired difference; 0: a tie;
        None: no repetition measured both (e.g. every run of the cell failed)."""
        return beyond_spread(paired_difference(by_seed(a, t, key), by_seed(b, t, key)))

    def count(sides: list[int | None], want: int) -> tuple[int, int, int]:
        """(how many are ``want``, how many the opposite, how many unmeasured)."""
        return (sum(x == want for x in sides), sum(x == -want for x in sides), sum(x is None for x in sides))

    def counted(hits: int, against: int, missing: int, total: int, what: str, other: str) -> str:
        text = f"{what} at {hits}/{total} T, {other} at {against}, tied at {total - hits - against - missing}"
        return text + (f", not measured at {missing}" if missing else "")

    spread_note = (" (each T: the seed-paired difference beyond its 95 % Student-t interval, t(0.975, n − 1) s.e. "
                   "over n repetitions; within it, a tie)")
    claims = []
    tmax = max((t for t in s.tasks if any(r["tasks"] == t for r in records)), default=None)
    if tmax is not None:
        d_mse, t_mse = m("dselect_static", tmax, "test_mse"), m("topk_static", tmax, "test_mse")
        mse = count([side("dselect_static", "topk_static", t, "test_mse") for t in s.tasks], -1)
        imp = (t_mse - d_mse) / t_mse if t_mse == t_mse and t_mse else float("nan")  # > 0: DSelect-k lower
        how = "lower" if imp >= 0 else "higher"
        claims.append(Claim(
            text="DSelect-k has lower test MSE than Top-k at every T, over 40% lower at T = 128.",
            criterion="lower at every T and ≥ 40% lower at the largest T: holds; lower at some T and higher at "
                      "none: partly; higher at any T: does not hold; a tie at every T: inconclusive" + spread_note,
            measured=counted(*mse, len(s.tasks), "lower", "higher")
            + f"; at T = {tmax}: DSelect-k {d_mse:.3f} vs Top-k {t_mse:.3f} (DSelect-k {abs(imp):.1%} {how})",
            verdict=_verdict(*mse, len(s.tasks), extra=imp >= 0.4)))
        d_rel, t_rel = m("dselect_static", tmax, "jaccard_related"), m("topk_static", tmax, "jaccard_related")
        rel = count([side("dselect_static", "topk_static", t, "jaccard_related") for t in s.tasks], 1)
        claims.append(Claim(
            text="DSelect-k's related tasks share more experts than Top-k's (76% higher Jaccard at T = 128).",
            criterion="higher at every T: holds; at some T and lower at none: partly; lower at any T: does not "
                      "hold; a tie at every T: inconclusive" + spread_note,
            measured=counted(*rel, len(s.tasks), "higher", "lower") + f"; at T = {tmax}: {d_rel:.3f} vs {t_rel:.3f}",
            verdict=_verdict(*rel, len(s.tasks))))
        multi = [t for t in s.tasks if t > GROUP_TASKS]
        unrel = count([side("dselect_static", "topk_static", t, "jaccard_unrelated") for t in multi], -1)
        claims.append(Claim(
            text="DSelect-k's unrelated tasks share fewer experts than Top-k's.",
            criterion="lower at every T > 16: holds; at some and higher at none: partly; higher at any: does not "
                      "hold; a tie at every T > 16: inconclusive" + spread_note,
            measured=counted(*unrel, len(multi), "lower", "higher").replace(" T,", " T > 16,", 1),
            verdict=_verdict(*unrel, len(multi))))
        both = []
        for t in s.tasks:
            pair = [side("dselect_static", abl, t, "test_mse") for abl in ("ablation_annealing", "ablation_entropy")]
            both.append(None if None in pair else (-1 if pair == [-1, -1] else (1 if 1 in pair else 0)))
        abl = count(both, -1)
        claims.append(Claim(text="DSelect-k beats both softmax-selector ablations (binary encoding helps).",
                            criterion="lower MSE than both at every T: holds; at some T and higher than neither "
                                      "at any: partly; higher than one at any T: does not hold; otherwise (no T "
                                      "lower than both, none higher): inconclusive" + spread_note,
                            measured=counted(*abl, len(s.tasks), "lower than both", "higher than one"),
                            verdict=_verdict(*abl, len(s.tasks))))
        ent = mean_se(r["experts_selected_mean"] for r in records
                      if r["gate"] == "ablation_entropy" and r["tasks"] == tmax)
        claims.append(Claim(text="Ablation (entropy) ends up with fewer than k = 4 distinct experts (often 2).",
                            criterion="the upper end of the 95 % t interval of the mean distinct argmax experts "
                                      "(mean + t(0.975, n − 1) s.e.) < 4 at the largest T: holds",
                            measured=f"{ent.fmt(2)} at T = {tmax}",
                            verdict=_below(ent, 4.0)))
    lines = [
        "# DSelect-k on synthetic multi-task data (Hazimeh et al. 2021, App. C.1, Fig. C.5)",
        "",
        f"""**{f'QUICK form: {s.reps} repetition(s) of the full run (same data, T and training length).' if s.quick
               else 'Full run (scaled down to a 1-core CPU budget, see Setup).'}**""",
        "",
        "- Wall time of the last invocation (runs already recorded are not re-run): "
        f"{wall:.0f} s (training recorded in runs.jsonl: "
        f"{sum(r['wall_s'] for r in all_runs):.0f} s over {len(all_runs)} runs).",
        f"- {software_line(torch.get_num_threads(), runs=all_runs)}, CPU.",
        "",
        "## Setup",
        "",
        "- Data as App. C.1 (groups of 16 tasks, T/16 groups: 8 at T = 128, since the paper's '4 groups' cannot "
        "give 16/32/64/128 tasks with 16 tasks and 4 experts per group; group MoEs of 4 experts = sums of 4 ReLU "
        "units with N(0, 1) weights); x ~ N(0, I_10). **Scaled down:** "
        f"{s.n_train} training and {s.n_test} test points (paper: 100,000 / 20,000 / 20,000), no validation set "
        "and no tuning.",
        "- **Task weights depart from the paper's literal recipe.** App. C.1 says each task's output is \"a convex "
        "combination of the 4 experts\" (so that the fitted MoE, with experts of the same form, is not "
        "mis-specified), and also that the task weights are drawn from a zero-mean multivariate normal with "
        f"correlation {CORR} between tasks. The two contradict: normal weights are negative about half the time and "
        "do not sum to 1, so the targets take both signs, while this model (experts = sums of ReLUs, convex gates) "
        "predicts only values ≥ 0 (an earlier version of this experiment used the raw normal weights: 34–53 % of "
        "its targets were negative, and most of its test MSE was the floor no nonnegative predictor can go below). "
        "Here the convex combination wins: each task's weights are the softmax of a normal draw whose coordinates "
        f"are correlated {CORR} between the 16 tasks of a group (`make_problem`), so every target is ≥ 0, the "
        "generating MoE is in the fitted model's family, and the tasks of a group get similar weights.",
        f"- Model: multi-gate MoE with T/4 trainable experts of the same form, one static gate per task, k = 4 "
        "(the T gates of a run are evaluated together, with stacked parameters, through the library's functional "
        "gate cores; see `StaticGateBank`); "
        f"Adam lr {s.lr}, batch {s.batch}, {s.epochs} epochs (paper: tuned lr, 25–100 epochs).",
        f"- Fixed hyperparameters, not tuned here: DSelect-k γ = {s.gamma} (the official code's default; the "
        "paper's grid is {5, 10, 15}, and γ = 10 never became binary here, below), entropy "
        f"{s.entropy_reg}; Ablation (annealing): softmax(β/T), T annealed log-linearly {s.anneal[0]} → {s.anneal[1]} "
        "(the paper anneals from s in {1e-6 … 1e-2} down to 1e-16: not its schedule); "
        f"Ablation (entropy): coefficient {s.ablation_entropy_reg}.",
        "- Selected experts: nonzero weights (DSelect-k, Top-k); for the softmax ablations, which never give exact "
        "zeros, the argmax expert of each selector (the paper's heuristic).",
        f"- {s.reps} repetitions (new data and initialisation each; paper: 100).",
        "",
        "## Results (mean ± standard error over repetitions)",
        "",
        md_table(["gate", "tasks", "reps", "collapsed (left out)", "test MSE", "Jaccard related ↑",
                  "Jaccard unrelated ↓", "experts selected per task", "binary S(Z) fraction"], rows),
        "",
        *_collapsed_note(gone, all_runs),
        "Random gate (4 of T/4 experts uniformly at random), expected Jaccard index:",
        "",
        md_table(["tasks", "E[Jaccard]"], rand),
        "",
        "Paper (Fig. C.5, read from the text): DSelect-k beats Top-k in MSE and in both Jaccard indices at every T, "
        "with > 40% lower MSE and 76% higher related-task Jaccard at T = 128; both ablations do worse than DSelect-k.",
        "",
        *_set_size_caveat(records, s),
    ]
    prelim_all = [r for r in read_jsonl(out_dir / "runs_gamma10.jsonl") if r["gate"] == "dselect_static"]
    prelim = [r for r in prelim_all if not collapsed(r)]
    if prelim:
        prow = []
        for t in s.tasks:
            rs = [r for r in prelim if r["tasks"] == t]
            if rs:
                prow.append([t, len(rs), mean_se(r["test_mse"] for r in rs).fmt(3),
                             mean_se(r["binary_fraction"] for r in rs).fmt(2),
                             mean_se(r["experts_selected_mean"] for r in rs).fmt(2)])
        never = all(not r["binary_fraction"] for r in prelim)
        outcome = ("S(Z) did not become binary for any gate within the training budget here, so DSelect-k stayed a "
                   "dense gate; the main run therefore uses the official default γ = 1." if never else
                   "S(Z) became binary for only the fraction of the gates in the table below; the main run uses the "
                   "official default γ = 1.")
        left_out = len(prelim_all) - len(prelim)
        lines += ["### Preliminary run: DSelect-k with γ = 10 (from the paper's grid {5, 10, 15})", "",
                  "Recorded in `runs_gamma10.jsonl` (same data seeds and training; the other gates' rows there match "
                  f"the main run's settings). With γ = 10, {outcome}"
                  + (f" {left_out} collapsed run(s) left out." if left_out else ""), "",
                  md_table(["tasks", "runs", "test MSE", "binary S(Z) fraction", "experts selected per task"],
                           prow), ""]
    claims = single_seed(claims, s.reps)  # a one-seed (quick) run's verdicts say so
    if claims:
        lines += ["## Claims", "", claims_markdown(claims), ""]
    if fig:
        lines += [f"![Fig. C.5]({fig})", ""]
    write_claims_json(out_dir, claims, experiment="dselect-synthetic", paper=common.PAPER, quick=s.quick)
    return atomic_write_text(out_dir / "report.md", "\n".join(lines))


EXPERIMENT = Experiment(
    "dselect-synthetic",
    "Hazimeh et al. 2021 App. C.1: synthetic multi-task MoE, 16-128 tasks, MSE and Jaccard (Fig. C.5)",
    run_synthetic,
    FULL,
    QUICK,
    quick_seconds=27,  # measured 2026-11-25 on this project's 2-core machine
)
"""The registered experiment (``routelab reproduce dselect-synthetic``)."""
