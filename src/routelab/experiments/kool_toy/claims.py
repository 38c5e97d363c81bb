"""The paper's claims as explicit, testable criteria over the run records.

Everything here is a pure function of the records (dicts as written to ``runs.jsonl``) and of
the marginals check, so the criteria can be tested on synthetic tables.

Definitions (stated in the report). The paper gives one number, the success threshold "MSE < 0.02
after 10K steps" (Sec. 3), and plots the final MSE of each seed per τ (Fig. 2, 3); it states no rule
for when a (method, τ) *works*, nor for when one method is *better* than another. The reproduction's
choices:

* a run **succeeds** when its final MSE is below 0.02 (Sec. 3). The *primary* MSE is the expected
  MSE under the router, the quantity the paper trains and thresholds ("the MSE under sampling of the
  experts", Sec. 3); the MSE of the most probable expert (the paper's test-time rule, Sec. 1) is the
  second view (:data:`METRICS`), and a verdict that changes with it says so;
* a (configuration, method, tau) cell is **solved** when at least :data:`SOLVED_FRACTION` (80 %) of
  its seeds succeed (8 of 10). Every verdict is recomputed at each fraction of
  :data:`SENSITIVITY_FRACTIONS` (0.5 to 0.9): one that changes with it is *fragile*, and a fragile
  "holds" or "does not hold" is lowered to "partly" (:func:`evaluate_claims`);
* a comparison ("A succeeds more often than B") is Fisher's exact test on the two success counts,
  pooled over the cells the claim names (:func:`fisher_p`), one-sided at the 5 % level
  (``1 - kit.stats.CONFIDENCE``); success counts pooled over τ do not depend on the solved fraction;
* a claim that a configuration *fails* is *not measured* only when the comparison has no power: its test
  is not significant (nor, where the claim has one, its per-τ test), the configuration solves no cell, and
  the reference it is compared with does not learn: fewer than :data:`MIN_REFERENCE_SUCCESSES` successful
  runs and no solved cell (a model that learns nothing anywhere supports no claim of failure; a significant
  test or a reference that solves a cell is judged, :func:`_learns`);
* a verdict is *fragile* when its judged outcomes (holds / partly / does not hold) differ between solved
  fractions; a fraction where the claim is not measured is named but is no change of verdict;
* **low** tau means tau < 1, **high** tau means tau > 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ...estimators import METHODS
from ..kit.claims import HOLDS, NOT_HOLD, NOT_MEASURED, PARTLY, Claim, verdict_of
from ..kit.stats import CONFIDENCE
from ..kit.store import is_failed
from .model import SUCCESS_MSE

__all__ = [
    "ALPHA",
    "CAPPED_IW_METHODS",
    "GM_METHODS",
    "METHOD_LABELS",
    "METRICS",
    "MIN_REFERENCE_SUCCESSES",
    "PRIMARY_METRIC",
    "SENSITIVITY_FRACTIONS",
    "SOLVED_FRACTION",
    "Sensitivity",
    "SuccessTable",
    "evaluate_claims",
    "fisher_p",
    "gradient_summary",
    "is_success",
    "judge_claims",
    "sensitivity",
    "success_table",
]

SOLVED_FRACTION = 0.8
"""The primary fraction of a cell's seeds that must succeed for the cell to count as solved (8 of 10)."""
SENSITIVITY_FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9)
"""The solved fractions every verdict is recomputed at; a verdict that differs among them is fragile."""
METRICS = {"mse": "expected MSE", "argmax_mse": "argmax MSE"}
"""The record fields a run's success can be read from, with their names in the report."""
PRIMARY_METRIC = "mse"
"""The field that decides success in the verdicts: the expected MSE under the router, which the paper
trains and thresholds (Sec. 3); ``argmax_mse`` (the test-time rule of Sec. 1) is the second view."""
MIN_REFERENCE_SUCCESSES = 10
"""Successful runs (one cell's worth of seeds) with which the reference configuration of a "fails" claim
learns even without a solved cell (:func:`_learns`); a claim whose reference does not learn and whose test is
not significant is *not measured*."""
ALPHA = round(1.0 - CONFIDENCE, 10)
"""The level of the one-sided Fisher exact tests (0.05)."""
GM_METHODS = ("gumbel_matching", "gumbel_matching_iw", "gumbel_matching_sh")
CAPPED_IW_METHODS = ("sample_skip_iw", "gumbel_matching_iw", "gumbel_matching_sh")
METHOD_LABELS = {
    "sample": "Sample",
    "sample_skip": "Sample Skip",
    "sample_skip_iw": "Sample Skip IW",
    "gumbel_matching": "Gumbel-Matching",
    "gumbel_matching_iw": "Gumbel-Matching IW",
    "gumbel_matching_sh": "Gumbel-Matching SH",
}


def tau_str(t: float) -> str:
    """A temperature as printed in tables (``0.2154``, ``1``, ``10``)."""
    return f"{t:g}"


def is_success(mse: float, threshold: float = SUCCESS_MSE) -> bool:
    """The paper's success criterion: final MSE < 0.02 (a NaN MSE is a failure)."""
    return bool(mse < threshold)  # NaN < x is False


def fisher_p(a: tuple[int, int], b: tuple[int, int], alternative: str = "greater") -> float:
    """The p-value of Fisher's exact test comparing two success counts (``scipy.stats.fisher_exact``).

    Args:
        a, b: ``(successes, runs)`` of the two groups.
        alternative: ``"greater"`` (a's success rate above b's), ``"less"`` or ``"two-sided"``.

    Returns:
        The p-value; ``nan`` when either group has no run (nothing to compare).

    Raises:
        ValueError: when a count is negative or above its number of runs, or ``alternative`` is not one of
            the three.
    """
    if alternative not in ("greater", "less", "two-sided"):
        raise ValueError(f"alternative must be 'greater', 'less' or 'two-sided', got {alternative!r}.")
    for name, (s, n) in (("a", a), ("b", b)):
        if not 0 <= s <= n:
            raise ValueError(f"{name} must be (successes, runs) with 0 <= successes <= runs, got {(s, n)!r}.")
    if a[1] == 0 or b[1] == 0:
        return float("nan")
    from scipy.stats import fisher_exact  # here: scipy.stats is slow to import and most callers need none

    return float(fisher_exact([[a[0], a[1] - a[0]], [b[0], b[1] - b[0]]], alternative=alternative).pvalue)


def _below(p: float) -> bool:
    """Whether a p-value rejects at :data:`ALPHA` (``nan``: nothing was compared, no)."""
    return bool(p < ALPHA)


def _p_str(p: float) -> str:
    return "n/a" if math.isnan(p) else (f"{p:.2g}" if p >= 1e-4 else "< 1e-4")


def _count(c: tuple[int, int]) -> str:
    return f"{c[0]}/{c[1]}"


# ----------------------------------------------------------------------------- tables


@dataclass
class SuccessTable:
    """Successes per (config, method, tau) cell.

    Attributes:
        cells: ``{(config, method, tau): (successes, seeds)}``; a seed whose run failed
            (diverged) counts as a seed without success.
        failed: ``{(config, method, tau): failed runs}`` for the cells with any.
        solved_fraction: the fraction of a cell's seeds that must succeed for it to be solved.
        metric: the record field success was read from (a key of :data:`METRICS`).
    """

    cells: dict[tuple[str, str, float], tuple[int, int]] = field(default_factory=dict)
    failed: dict[tuple[str, str, float], int] = field(default_factory=dict)
    solved_fraction: float = SOLVED_FRACTION
    metric: str = PRIMARY_METRIC

    def rate(self, config: str, method: str, tau: float) -> float | None:
        c = self.cells.get((config, method, tau))
        return None if c is None or c[1] == 0 else c[0] / c[1]

    def solved(self, config: str, method: str, tau: float) -> bool:
        r = self.rate(config, method, tau)
        return r is not None and r >= self.solved_fraction - 1e-12

    def at_fraction(self, solved_fraction: float) -> SuccessTable:
        """The same counts with another solved fraction (in (0, 1])."""
        _check_fraction(solved_fraction)
        return dataclasses.replace(self, solved_fraction=solved_fraction)

    def has(self, config: str) -> bool:
        return any(c == config for c, _, _ in self.cells)

    def taus(self, config: str | None = None) -> list[float]:
        return sorted({t for c, _, t in self.cells if config is None or c == config})

    def methods(self, config: str) -> list[str]:
        present = {m for c, m, _ in self.cells if c == config}
        return [m for m in METHODS if m in present]

    def solved_cells(self, config: str) -> list[tuple[str, float]]:
        return [(m, t) for (c, m, t) in sorted(self.cells) if c == config and self.solved(c, m, t)]

    def n_cells(self, config: str) -> int:
        return sum(1 for c, _, _ in self.cells if c == config)

    def pooled(self, config: str, methods: Collection[str] | None = None,
               where: Callable[[float], bool] | None = None) -> tuple[int, int]:
        """``(successes, runs)`` of ``config`` summed over its cells of ``methods`` (all: ``None``) at the τ
        where ``where(tau)`` is true (all: ``None``); ``(0, 0)`` when there is none."""
        s = n = 0
        for (c, m, t), (k, runs) in self.cells.items():
            if c == config and (methods is None or m in methods) and (where is None or where(t)):
                s, n = s + k, n + runs
        return s, n


def _check_fraction(solved_fraction: float) -> None:
    if not 0.0 < solved_fraction <= 1.0:
        raise ValueError(f"solved_fraction must be in (0, 1], e.g. 0.8 for 8 of 10 seeds; got {solved_fraction!r}.")


def success_table(records: Iterable[Mapping], *, metric: str = PRIMARY_METRIC,
                  solved_fraction: float = SOLVED_FRACTION) -> SuccessTable:
    """Count successes per (config, method, tau) from run records (``metric`` decides success).

    A failed run (diverged: ``status == "failed"``, no MSE) did not solve the task: it counts
    as a seed without success, and in :attr:`SuccessTable.failed`.

    Args:
        records: the run records.
        metric: the record field read (a key of :data:`METRICS`: ``"mse"`` or ``"argmax_mse"``).
        solved_fraction: see :attr:`SuccessTable.solved_fraction`.

    Raises:
        ValueError: for an unknown ``metric``, a ``solved_fraction`` outside (0, 1], or a finished run
            without the ``metric`` field (records of an older version: read them with ``metric="mse"``).
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}.")
    _check_fraction(solved_fraction)
    cells: dict[tuple[str, str, float], list[int]] = defaultdict(lambda: [0, 0])
    failed: dict[tuple[str, str, float], int] = defaultdict(int)
    for r in records:
        key = (r["config"], r["method"], float(r["tau"]))
        cell = cells[key]
        if is_failed(r):
            failed[key] += 1
        else:
            if metric not in r:
                raise ValueError(f"run {key} seed {r.get('seed')} has no {metric!r}; read these records with "
                                 "metric='mse'.")
            cell[0] += int(is_success(float(r[metric])))
        cell[1] += 1
    return SuccessTable({k: (v[0], v[1]) for k, v in cells.items()}, dict(failed), solved_fraction, metric)


# ----------------------------------------------------------------------------- claims


def _cells_str(cells: Sequence[tuple[str, float]]) -> str:
    if not cells:
        return "none"
    by_m: dict[str, list[str]] = defaultdict(list)
    for m, t in cells:
        by_m[m].append(tau_str(t))
    # ", " and not ",": the claims' number reader takes "1,100" for one thousand one hundred
    return "; ".join(f"{METHOD_LABELS.get(m, m)} at τ={', '.join(ts)}" for m, ts in by_m.items())


def _verdict_of(parts: Mapping[str, bool | None]) -> str:
    """Verdict over the measured sub-criteria (``None`` = not measured), saying which were."""
    measured = {k: v for k, v in parts.items() if v is not None}
    if not measured:
        return NOT_MEASURED
    v = verdict_of(list(measured.values()))
    if len(measured) < len(parts):
        v += f" (only {', '.join(f'({k})' for k in measured)} measured)"
    return v


def _gaps(table: SuccessTable, configs: Sequence[str]) -> str:
    """A note naming the methods with no results in each configuration (e.g. a skipped chunk)."""
    notes = []
    for c in configs:
        if table.has(c):
            absent = [METHOD_LABELS[m] for m in METHODS if m not in table.methods(c)]
            if absent:
                notes.append(f"{c}: {', '.join(absent)} not run")
    return f" [{'; '.join(notes)}]" if notes else ""


def _missing(table: SuccessTable, configs: Sequence[str], text: str, criterion: str) -> Claim | None:
    absent = [c for c in configs if not table.has(c)]
    if absent:
        return Claim(text=text, criterion=criterion, measured=f"configuration(s) {', '.join(absent)} not run",
                     verdict=NOT_MEASURED)
    return None


def _unrun_methods(table: SuccessTable, cfg: str, methods: Sequence[str], text: str, criterion: str) -> Claim | None:
    """A not-measured claim when one of ``methods`` has no result at any τ of ``cfg`` (a method that did
    not run is no evidence, not a success rate of 0), else None."""
    absent = [m for m in methods if all(table.rate(cfg, m, t) is None for t in table.taus(cfg))]
    if absent:
        return Claim(text=text, criterion=criterion, measured=f"{cfg}: method(s) {', '.join(absent)} not run",
                     verdict=NOT_MEASURED)
    return None


def _learns(table: SuccessTable, config: str, methods: Collection[str] | None = None) -> bool:
    """Whether ``config`` (over ``methods``; all: ``None``) learns enough for a failure beside it to mean
    something: at least :data:`MIN_REFERENCE_SUCCESSES` successful runs pooled over τ, or a solved cell."""
    return (table.pooled(config, methods)[0] >= MIN_REFERENCE_SUCCESSES
            or any(methods is None or m in methods for m, _ in table.solved_cells(config)))


def _no_power(reference: str, count: tuple[int, int], failing: str, tested: bool = True) -> str:
    """Why a "fails" claim is not measured: ``failing`` fails, but so does ``reference`` (``count``: its
    ``(successes, runs)``), and (``tested``: the claim has a test) no test is significant."""
    return (f"not measured: the reference {reference} succeeds in only {_count(count)} runs (fewer than "
            f"{MIN_REFERENCE_SUCCESSES}) and solves no cell{', and no test is significant' if tested else ''}, so "
            f"{failing} failing here says nothing")


def _high(t: float) -> bool:
    return t > 1 + 1e-9


def _low(t: float) -> bool:
    return t < 1 - 1e-9


def _rate_gaps(table: SuccessTable, cfg: str, a: str, b: str) -> list[float]:
    """``rate(a) - rate(b)`` at every τ of ``cfg`` where both methods have results."""
    pairs = [(table.rate(cfg, a, t), table.rate(cfg, b, t)) for t in table.taus(cfg)]
    return [x - y for x, y in pairs if x is not None and y is not None]


def _per_tau_p(table: SuccessTable, cfg: str, a: str, b: str, alternative: str) -> dict[float, float]:
    """Fisher's exact p of method ``a`` against ``b`` at every τ of ``cfg`` where both have results."""
    out = {}
    for t in table.taus(cfg):
        ca, cb = table.cells.get((cfg, a, t)), table.cells.get((cfg, b, t))
        if ca is not None and cb is not None:
            out[t] = fisher_p(ca, cb, alternative)
    return out


def skip_iw_matches_sample(table: SuccessTable) -> Claim:
    """Claim 1 of the report (its text, criterion and verdict below)."""
    text = "Sample Skip IW matches Sample, both solving the task for τ ≥ 1 (Fig. 2b)."
    crit = (
        "REINFORCE: (a) Sample and Sample Skip IW both solve every τ ≥ 1; (b) their success counts do not "
        "differ: Fisher's exact test (two-sided) p ≥ 0.05 pooled over τ and at every τ (with 10 seeds a "
        "τ's gap must reach about 0.5 to be significant, so (b) only rules out a clear mismatch). holds: "
        "(a) and (b); partly: (a) without (b), or (b) with at least one τ ≥ 1 solved by both; does not "
        "hold: otherwise."
    )
    cfg = "reinforce"
    if (m := _missing(table, [cfg], text, crit) or _unrun_methods(table, cfg, ["sample", "sample_skip_iw"], text,
                                                                   crit)):
        return m
    high = [t for t in table.taus(cfg) if t >= 1 - 1e-9]
    s_ok = [t for t in high if table.solved(cfg, "sample", t)]
    k_ok = [t for t in high if table.solved(cfg, "sample_skip_iw", t)]
    gaps = [abs(g) for g in _rate_gaps(table, cfg, "sample", "sample_skip_iw")]
    per_tau = _per_tau_p(table, cfg, "sample", "sample_skip_iw", "two-sided")
    ps, pk = table.pooled(cfg, ["sample"]), table.pooled(cfg, ["sample_skip_iw"])
    p_pool = fisher_p(ps, pk, "two-sided")
    a = bool(high) and len(s_ok) == len(high) and len(k_ok) == len(high)
    b = not _below(p_pool) and not any(_below(p) for p in per_tau.values())
    t_min = min(per_tau, key=lambda t: per_tau[t]) if per_tau else None
    measured = (
        f"τ ≥ 1 solved by Sample: {len(s_ok)}/{len(high)}, by Sample Skip IW: {len(k_ok)}/{len(high)}; "
        f"successful runs pooled over τ: Sample {_count(ps)}, Sample Skip IW {_count(pk)} (Fisher p "
        f"{_p_str(p_pool)}); smallest per-τ p {_p_str(per_tau[t_min]) if t_min is not None else 'n/a'}"
        + (f" at τ={tau_str(t_min)}" if t_min is not None else "")
        + f"; largest success-rate gap {max(gaps) if gaps else float('nan'):.1f}"
    )
    both = set(s_ok) & set(k_ok)
    verdict = HOLDS if a and b else (PARTLY if a or (b and both) else NOT_HOLD)
    return Claim(text=text, criterion=crit, measured=measured, verdict=verdict)


def gradient_summary(gradients: Sequence[Mapping] | None) -> str:
    """One sentence on claim 2's mechanism from :func:`.gradients.gradient_check` rows ("" if none)."""
    if not gradients:
        return ""

    def span(key: str) -> str:
        v = [float(r[key]) for r in gradients]
        return f"{min(v):.3f}–{max(v):.3f} (median {float(np.median(v)):.3f})"

    taus = sorted({float(r["tau"]) for r in gradients})
    return (
        f"; expected REINFORCE gradient at the initial parameters ({len({r['seed'] for r in gradients})} seeds × "
        f"τ = {', '.join(tau_str(t) for t in taus)}; {gradients[0]['copies']} draws per method): Sample Skip vs "
        f"Sample, cosine {span('cos_skip_all')}, norm ratio {span('ratio_skip_all')}; router (a, c) alone: cosine "
        f"{span('cos_skip_router')}, norm ratio {span('ratio_skip_router')} (control, Sample Skip IW: cosine "
        f"{span('cos_iw_all')}, ratio {span('ratio_iw_all')})"
    )


def skip_without_iw_falls_behind(table: SuccessTable, gradients: Sequence[Mapping] | None = None) -> Claim:
    """Claim 2 of the report (its text, criterion and verdict below). ``gradients``: the rows of
    the expected-gradient check (:mod:`.gradients`), quoted as the mechanism."""
    text = "Sample Skip (no IW correction) does not match Sample (Fig. 2b)."
    crit = (
        "REINFORCE, Sample succeeds more often than Sample Skip by Fisher's exact test (one-sided, p < 0.05): "
        f"(a) pooled over τ; (b) at some τ. holds: both; partly: one; does not hold: neither; not measured when "
        f"neither test is significant and neither method solves a cell or succeeds in {MIN_REFERENCE_SUCCESSES} "
        "runs (nothing learns)."
    )
    cfg = "reinforce"
    if (m := _missing(table, [cfg], text, crit) or _unrun_methods(table, cfg, ["sample", "sample_skip"], text, crit)):
        return m
    ps, pk = table.pooled(cfg, ["sample"]), table.pooled(cfg, ["sample_skip"])
    p_pool = fisher_p(ps, pk)
    per_tau = _per_tau_p(table, cfg, "sample", "sample_skip", "greater")
    gaps = _rate_gaps(table, cfg, "sample", "sample_skip")
    t_min = min(per_tau, key=lambda t: per_tau[t]) if per_tau else None
    measured = (
        f"successful runs pooled over τ: Sample {_count(ps)}, Sample Skip {_count(pk)} (Fisher one-sided p "
        f"{_p_str(p_pool)}); smallest per-τ p {_p_str(per_tau[t_min]) if t_min is not None else 'n/a'}"
        + (f" at τ={tau_str(t_min)}" if t_min is not None else "")
        + f"; success-rate gap Sample − Sample Skip per τ: {', '.join(f'{g:+.1f}' for g in gaps)}"
        + gradient_summary(gradients)
    )
    a, b = _below(p_pool), any(_below(p) for p in per_tau.values())
    if not (a or b) and not _learns(table, cfg, ["sample"]) and not _learns(table, cfg, ["sample_skip"]):
        return Claim(text=text, criterion=crit, measured=f"{_no_power('Sample', ps, 'Sample Skip')}; {measured}",
                     verdict=NOT_MEASURED)
    return Claim(text=text, criterion=crit, measured=measured, verdict=verdict_of([a, b]))


def gumbel_matching_less_effective(table: SuccessTable, records: Sequence[Mapping]) -> Claim:
    """Claim 3 of the report (its text, criterion and verdict below)."""
    text = (
        "The Gumbel-Matching estimators are less effective than Sample Skip IW, because of the "
        "variance of their importance weights (Fig. 2b)."
    )
    crit = (
        "REINFORCE: (a) pooled over τ, Sample Skip IW succeeds more often than each of Gumbel-Matching, GM IW "
        "and GM SH (Fisher's exact test, one-sided p < 0.05); (b) evidence for the attribution: at high τ "
        "(> 1) the median largest importance weight of GM IW is at least twice that of Sample Skip IW. "
        "holds: (a) for all three and (b); partly: (a) for some, or for all three without (b); does not "
        "hold: (a) for none. The paper's mechanism (a higher τ avoids large weights) predicts the GM "
        "estimators to do worse at low τ than at high τ: the counts by τ band are given."
    )
    cfg = "reinforce"
    if (m := _missing(table, [cfg], text, crit) or _unrun_methods(table, cfg, ["sample_skip_iw"], text, crit)):
        return m
    skip = table.pooled(cfg, ["sample_skip_iw"])
    gms = [m for m in GM_METHODS if m in table.methods(cfg)]
    p = {m: fisher_p(skip, table.pooled(cfg, [m])) for m in gms}
    less = [m for m in gms if _below(p[m])]
    hi: dict[str, list[float]] = defaultdict(list)
    lo: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["config"] == cfg and not is_failed(r) and "iw_max" in r:
            t = float(r["tau"])
            if _high(t):
                hi[r["method"]].append(float(r["iw_max"]))
            elif _low(t):
                lo[r["method"]].append(float(r["iw_max"]))

    def med(d: Mapping[str, list[float]], m: str) -> float:
        return float(np.median(d[m])) if d.get(m) else float("nan")

    gm_w, sk_w = med(hi, "gumbel_matching_iw"), med(hi, "sample_skip_iw")
    b = math.isfinite(gm_w) and math.isfinite(sk_w) and gm_w >= 2 * sk_w
    bands = "; ".join(
        f"{METHOD_LABELS[m]} {_count(table.pooled(cfg, [m], _low))} at τ < 1, {_count(table.pooled(cfg, [m], _high))} "
        f"at τ > 1" for m in ("sample_skip_iw", *gms))
    reversed_ = [METHOD_LABELS[m] for m in gms if m != "gumbel_matching" and _rate(table.pooled(cfg, [m], _low))
                 > _rate(table.pooled(cfg, [m], _high))]
    measured = (
        f"successful runs pooled over τ: Sample Skip IW {_count(skip)}, "
        + ", ".join(f"{METHOD_LABELS[m]} {_count(table.pooled(cfg, [m]))} (p {_p_str(p[m])})" for m in gms)
        + f"; by τ band: {bands}"
        + (f" ({', '.join(reversed_)} succeed more often at low τ than at high τ: the opposite of the "
           "mechanism's prediction)" if reversed_ else "")
        + f"; median largest weight at τ > 1: GM IW {gm_w:.3g} vs Sample Skip IW {sk_w:.3g}, at τ < 1: GM IW "
        f"{med(lo, 'gumbel_matching_iw'):.3g} vs Sample Skip IW {med(lo, 'sample_skip_iw'):.3g}"
        + _gaps(table, [cfg])
    )
    if not gms:
        verdict = NOT_MEASURED
    elif len(less) == len(gms) and b:
        verdict = HOLDS
    elif less:
        verdict = PARTLY
    else:
        verdict = NOT_HOLD
    return Claim(text=text, criterion=crit, measured=measured, verdict=verdict)


def _rate(count: tuple[int, int]) -> float:
    return count[0] / count[1] if count[1] else float("nan")


def gating_needs_a_small_balance_loss(table: SuccessTable) -> Claim:
    """Claim 4 of the report (its text, criterion and verdict below)."""
    text = (
        "Differentiable gating succeeds only with a balance loss of 0.01–0.03, and with balanced "
        "sampling with importance weights at low τ (Sec. 3.1, Fig. 2c)."
    )
    crit = (
        "(a) gating solves no cell with balance weight 0 or 0.1 and at least one with 0.01 or 0.03, and, "
        "pooled over methods and τ, succeeds more often with 0.01/0.03 than with 0 and than with 0.1 "
        "(Fisher's exact test, one-sided p < 0.05 each); (b) ≥ 80 % of the successful runs with 0.01/0.03 "
        "are a capacity-respecting importance-weighted method (Sample Skip IW, GM IW, GM SH) at τ < 1 "
        f"(not measured with fewer than {MIN_REFERENCE_SUCCESSES} successful runs). holds: (a) and (b); "
        "partly: one; does not hold: neither."
    )
    cfgs = ["gating_balance0", "gating", "gating_balance0.03", "gating_balance0.1"]
    if (m := _missing(table, cfgs, text, crit)):
        return m
    n = {c: len(table.solved_cells(c)) for c in cfgs}
    pool = {c: table.pooled(c) for c in cfgs}
    good = (pool["gating"][0] + pool["gating_balance0.03"][0], pool["gating"][1] + pool["gating_balance0.03"][1])
    p0, p1 = fisher_p(good, pool["gating_balance0"]), fisher_p(good, pool["gating_balance0.1"])
    a = (n["gating_balance0"] == 0 and n["gating_balance0.1"] == 0 and (n["gating"] + n["gating_balance0.03"]) > 0
         and _below(p0) and _below(p1))
    fits = sum(table.pooled(c, CAPPED_IW_METHODS, _low)[0] for c in ("gating", "gating_balance0.03"))
    b = (fits >= 0.8 * good[0]) if good[0] >= MIN_REFERENCE_SUCCESSES else None
    measured = (
        f"solved cells by balance weight: 0 → {n['gating_balance0']}, 0.01 → {n['gating']}, "
        f"0.03 → {n['gating_balance0.03']}, 0.1 → {n['gating_balance0.1']}; successful runs: 0 → "
        f"{_count(pool['gating_balance0'])}, 0.01 → {_count(pool['gating'])}, 0.03 → "
        f"{_count(pool['gating_balance0.03'])}, 0.1 → {_count(pool['gating_balance0.1'])} (0.01/0.03 against 0: "
        f"p {_p_str(p0)}; against 0.1: p {_p_str(p1)}); of the {good[0]} successful runs with 0.01/0.03, {fits} "
        f"are a capped IW method at τ < 1; solved with 0.01: {_cells_str(table.solved_cells('gating'))}; with 0.03: "
        f"{_cells_str(table.solved_cells('gating_balance0.03'))}"
        + _gaps(table, cfgs)
    )
    return Claim(text=text, criterion=crit, measured=measured, verdict=_verdict_of({"a": a, "b": b}))


def _fails_against(table: SuccessTable, cfg: str, ref: str, methods: Collection[str] | None = None) -> \
        tuple[bool | None, str]:
    """Whether ``cfg`` fails where ``ref`` learns (over ``methods``; all: ``None``): it solves no cell and, pooled
    over τ, succeeds less often than ``ref`` (Fisher's exact test, one-sided p < 0.05); ``None`` (not measured)
    when the comparison has no power: ``cfg`` solves nothing, the test is not significant and ``ref`` does not
    learn (:func:`_learns`). A solved cell refutes the failure whatever ``ref`` does. Returns the answer and its
    evidence."""
    c, r = table.pooled(cfg, methods), table.pooled(ref, methods)
    solved = [(m, t) for m, t in table.solved_cells(cfg) if methods is None or m in methods]
    p = fisher_p(r, c)
    text = (f"{cfg}: {_count(c)} successful runs vs {_count(r)} in {ref} (Fisher p {_p_str(p)}), solved cells: "
            f"{_cells_str(solved)}")
    if not solved and not _below(p) and not _learns(table, ref, methods):
        return None, f"{cfg}: {_no_power(ref, r, cfg)}"
    return not solved and _below(p), text


def gating_fails_without_iw(table: SuccessTable) -> Claim:
    """Claim 5 of the report (its text, criterion and verdict below)."""
    text = "Without importance weights, differentiable gating fails (App. E, Fig. 3 bottom right)."
    crit = (
        "gating (balance 0.01) without importance weights: (a) succeeds less often than with them, pooled over "
        "methods and τ (Fisher's exact test, one-sided p < 0.05); (b) solves no cell. holds: both; partly: one; "
        "does not hold: neither; not measured when (a)'s test is not significant, neither solves a cell and gating "
        f"with importance weights succeeds in fewer than {MIN_REFERENCE_SUCCESSES} runs (then failing without them "
        "says nothing)."
    )
    if (m := _missing(table, ["gating_no_iw", "gating"], text, crit)):
        return m
    c, r = table.pooled("gating_no_iw"), table.pooled("gating")
    p = fisher_p(r, c)
    cells = table.solved_cells("gating_no_iw")
    measured = (f"successful runs without IW {_count(c)}, with IW {_count(r)} (Fisher p {_p_str(p)}); solved cells "
                f"without IW: {len(cells)} ({_cells_str(cells)}), with IW: {len(table.solved_cells('gating'))}")
    if not cells and not _below(p) and not _learns(table, "gating"):
        return Claim(text=text, criterion=crit, measured=f"{_no_power('gating with IW', r, 'gating without IW')}; "
                     f"{measured}", verdict=NOT_MEASURED)
    return Claim(text=text, criterion=crit, measured=measured, verdict=verdict_of([_below(p), not cells]))


def sinkhorn_helps_at_extreme_tau(table: SuccessTable) -> Claim:
    """Claim 6 of the report (its text, criterion and verdict below)."""
    text = (
        "With REINFORCE, Sinkhorn before sampling works only at high τ (and plain sampling works "
        "better); with gating, Sinkhorn does better than without, at very low τ (App. E, Fig. 3)."
    )
    crit = (
        "(a) REINFORCE+Sinkhorn solves ≥ 1 cell, all at τ > 1, and, pooled over methods and τ, REINFORCE "
        "without Sinkhorn succeeds more often (Fisher's exact test, one-sided p < 0.05); (b) gating+Sinkhorn "
        "succeeds more often than gating without (the same test), and its solved cells are all at τ < 1, "
        "including the lowest τ. holds: (a) and (b); partly: one; does not hold: neither."
    )
    cfgs = ["reinforce", "reinforce_sinkhorn", "gating", "gating_sinkhorn"]
    a = b = None
    notes = []
    if table.has("reinforce_sinkhorn") and table.has("reinforce"):
        rs = table.solved_cells("reinforce_sinkhorn")
        cs, c0 = table.pooled("reinforce_sinkhorn"), table.pooled("reinforce")
        p = fisher_p(c0, cs)
        a = bool(rs) and all(_high(t) for _, t in rs) and _below(p)
        notes.append(f"(a) REINFORCE successful runs with Sinkhorn {_count(cs)} vs without {_count(c0)} (Fisher p "
                     f"{_p_str(p)}); solved cells with Sinkhorn {len(rs)} ({_cells_str(rs)}) vs without "
                     f"{len(table.solved_cells('reinforce'))}")
    else:
        notes.append("(a) not measured: REINFORCE with or without Sinkhorn not run")
    if table.has("gating_sinkhorn") and table.has("gating"):
        gs = table.solved_cells("gating_sinkhorn")
        cs, c0 = table.pooled("gating_sinkhorn"), table.pooled("gating")
        p = fisher_p(cs, c0)
        lowest = min(table.taus("gating_sinkhorn"))
        b = _below(p) and bool(gs) and all(_low(t) for _, t in gs) and any(abs(t - lowest) < 1e-12 for _, t in gs)
        notes.append(f"(b) gating successful runs with Sinkhorn {_count(cs)} vs without {_count(c0)} (Fisher p "
                     f"{_p_str(p)}); solved cells with Sinkhorn {len(gs)} ({_cells_str(gs)}) vs without "
                     f"{len(table.solved_cells('gating'))}")
    else:
        notes.append("(b) not measured: gating with or without Sinkhorn not run")
    return Claim(text=text, criterion=crit, measured="; ".join(notes) + _gaps(table, cfgs),
                 verdict=_verdict_of({"a": a, "b": b}))


def dropping_iw_works_only_for_reinforce_at_low_tau(table: SuccessTable) -> Claim:
    """Claim 7 of the report (its text, criterion and verdict below)."""
    text = (
        "Dropping importance weights works only for REINFORCE at low τ, and not with the "
        "Gumbel-Matching estimators (App. E, Fig. 3 right)."
    )
    crit = (
        "(a) REINFORCE without IW: a non-Gumbel-Matching method solves some τ < 1 and none solves a "
        "τ > 1; (b) the Gumbel-Matching methods without IW solve no cell and succeed less often than with IW "
        "(REINFORCE, pooled over τ; Fisher's exact test, one-sided p < 0.05); (c) gating without IW solves "
        "nothing and succeeds less often than with IW (the same test). A part whose configuration without IW solves "
        "nothing, with a test (if it has one) that is not significant, is judged only where the one with IW it is "
        f"compared with solves a cell or succeeds in ≥ {MIN_REFERENCE_SUCCESSES} runs (REINFORCE for (a), its "
        "Gumbel-Matching methods for (b), gating for (c)). holds: all judged parts; partly: some; does not hold: "
        "none."
    )
    if (m := _missing(table, ["reinforce", "reinforce_no_iw", "gating", "gating_no_iw"], text, crit)):
        return m
    cells = table.solved_cells("reinforce_no_iw")
    non_gm = [(mm, t) for mm, t in cells if mm not in GM_METHODS]
    ref = table.pooled("reinforce")
    a = ((any(_low(t) for _, t in non_gm) and not any(_high(t) for _, t in non_gm))
         if _learns(table, "reinforce") or non_gm else None)
    b, b_text = _fails_against(table, "reinforce_no_iw", "reinforce", GM_METHODS)
    c, c_text = _fails_against(table, "gating_no_iw", "gating")
    measured = (
        f"(a) REINFORCE without IW solves: {_cells_str(cells)}"
        + ("" if a is not None else f" ({_no_power('reinforce', ref, 'reinforce_no_iw', tested=False)})")
        + f"; (b) Gumbel-Matching methods: {b_text}; (c) {c_text}"
        + _gaps(table, ["reinforce_no_iw", "gating_no_iw"])
    )
    return Claim(text=text, criterion=crit, measured=measured, verdict=_verdict_of({"a": a, "b": b, "c": c}))


def strong_balance_loss_fails_every_method(table: SuccessTable) -> Claim:
    """Claim 8 of the report (its text, criterion and verdict below)."""
    text = "A balance loss of 0.1 makes every method fail (App. E)."
    crit = (
        "with balance weight 0.1, (a) REINFORCE and (b) gating each solve no cell and succeed less often "
        "than without the loss (REINFORCE: weight 0; gating: 0.01, the configuration that works), pooled "
        "over methods and τ (Fisher's exact test, one-sided p < 0.05). A part that solves no cell and whose test is "
        "not significant is judged only where the configuration without the loss solves a cell or succeeds in ≥ "
        f"{MIN_REFERENCE_SUCCESSES} runs. holds: both; partly: one; does not hold: neither."
    )
    # (configuration, reference, the τ where the reference works, for the per-method counts)
    pairs = {"a": ("reinforce_balance0.1", "reinforce", "τ ≥ 1", lambda t: t >= 1 - 1e-9),
             "b": ("gating_balance0.1", "gating", "τ < 1", _low)}
    if (m := _missing(table, [c for pair in pairs.values() for c in pair[:2]], text, crit)):
        return m
    parts, notes = {}, []
    for key, (cfg, ref, band, where) in pairs.items():
        parts[key], note = _fails_against(table, cfg, ref)
        per_method = ", ".join(f"{METHOD_LABELS[m]} {_count(table.pooled(cfg, [m], where))} "
                               f"({_count(table.pooled(ref, [m], where))})" for m in table.methods(cfg))
        notes.append(f"({key}) {note}; successful runs at {band} with the loss (without): {per_method}")
    return Claim(text=text, criterion=crit, measured="; ".join(notes) + _gaps(table, [p[0] for p in pairs.values()]),
                 verdict=_verdict_of(parts))


def sinkhorn_marginals_match_gumbel_matching(marginals: Sequence[Mapping] | None) -> Claim:
    """Claim 9 of the report (its text, criterion and verdict below)."""
    text = "Sinkhorn marginals closely approximate the Gumbel-Matching marginals, at least for n ≥ 4 (Sec. 2.3)."
    crit = (
        "for every n ≥ 4, the mean absolute difference between the Gumbel-Matching and the Sinkhorn "
        "marginals is ≤ 0.02 and at most a quarter of the mean absolute difference between the "
        "Gumbel-Matching marginals and the unbalanced softmax (how far balancing moves the marginals). "
        "holds: every n ≥ 4; partly: some n ≥ 4; does not hold: none."
    )
    if not marginals:
        return Claim(text=text, criterion=crit, measured="marginals check not run", verdict=NOT_MEASURED)
    rows = [r for r in marginals if r["n"] >= 4]
    ok = [r["mean_abs_diff"] <= 0.02 and r["mean_abs_diff"] <= 0.25 * r["mean_abs_diff_unbalanced"] for r in rows]
    measured = "; ".join(
        f"n={r['n']}: mean {r['mean_abs_diff']:.4f} (max {r['max_abs_diff']:.3f}, MC s.e. {r['mean_se']:.4f}) vs "
        f"softmax gap {r['mean_abs_diff_unbalanced']:.3f}"
        for r in marginals
    )
    return Claim(text=text, criterion=crit, measured=measured, verdict=verdict_of(ok) if rows else NOT_MEASURED)


def _judge(table: SuccessTable, records: Sequence[Mapping], marginals: Sequence[Mapping] | None,
           gradients: Sequence[Mapping] | None) -> list[Claim]:
    return [
        skip_iw_matches_sample(table),
        skip_without_iw_falls_behind(table, gradients),
        gumbel_matching_less_effective(table, records),
        gating_needs_a_small_balance_loss(table),
        gating_fails_without_iw(table),
        sinkhorn_helps_at_extreme_tau(table),
        dropping_iw_works_only_for_reinforce_at_low_tau(table),
        strong_balance_loss_fails_every_method(table),
        sinkhorn_marginals_match_gumbel_matching(marginals),
    ]


def judge_claims(records: Sequence[Mapping], marginals: Sequence[Mapping] | None,
                 gradients: Sequence[Mapping] | None = None, *, metric: str = PRIMARY_METRIC,
                 solved_fraction: float = SOLVED_FRACTION) -> list[Claim]:
    """The nine claims judged with one success metric and one solved fraction, without the robustness
    qualifiers of :func:`evaluate_claims` (failed runs count as unsuccessful seeds).

    Raises:
        ValueError: see :func:`success_table`.
    """
    return _judge(success_table(records, metric=metric, solved_fraction=solved_fraction), records, marginals,
                  gradients)


@dataclass(frozen=True)
class Sensitivity:
    """The nine claims' verdicts under every success metric and solved fraction, and the final claims.

    Attributes:
        outcomes: ``{(metric, solved fraction): [outcome of claim 1, ..., of claim 9]}`` (verdicts without
            qualifiers) for every metric of :data:`METRICS` the records hold and every fraction of
            :data:`SENSITIVITY_FRACTIONS`.
        claims: the claims as the report gives them (:func:`evaluate_claims`).
        missing_metrics: the metrics of :data:`METRICS` that some finished run lacks (not judged).
    """

    outcomes: dict[tuple[str, float], list[str]]
    claims: list[Claim]
    missing_metrics: tuple[str, ...] = ()

    def fragile(self, metric: str = PRIMARY_METRIC) -> list[int]:
        """The claims (numbered from 1) whose judged outcome under ``metric`` changes with the solved fraction
        (:func:`_changes`: a fraction where a claim is not measured is no change)."""
        rows = [v for (m, _), v in self.outcomes.items() if m == metric]
        return [i + 1 for i in range(len(self.claims)) if _changes(r[i] for r in rows)]

    def metric_dependent(self) -> list[int]:
        """The claims (numbered from 1) whose outcome at :data:`SOLVED_FRACTION` differs between the metrics."""
        rows = [v for (_, f), v in self.outcomes.items() if f == SOLVED_FRACTION]
        return [i + 1 for i in range(len(self.claims)) if len({r[i] for r in rows}) > 1]


def _changes(outcomes: Iterable[str]) -> bool:
    """Whether the judged outcomes among ``outcomes`` differ: holds, partly and does not hold are compared,
    not measured is left out (it is no evidence for or against the claim, so no change of verdict)."""
    return len({o for o in outcomes if o != NOT_MEASURED}) > 1


def _spans(by_fraction: Mapping[float, str]) -> str:
    """``"holds at 0.5–0.7, partly at 0.8–0.9"``: runs of consecutive fractions with the same outcome."""
    groups: list[tuple[str, list[float]]] = []
    for f in sorted(by_fraction):
        if groups and groups[-1][0] == by_fraction[f]:
            groups[-1][1].append(f)
        else:
            groups.append((by_fraction[f], [f]))
    return ", ".join(f"{o} at {fs[0]:g}" + (f"–{fs[-1]:g}" if len(fs) > 1 else "") for o, fs in groups)


def _robust(claim: Claim, by_fraction: Mapping[float, str], others: Mapping[str, tuple[str, bool]]) -> Claim:
    """``claim`` (judged at the primary metric and fraction) with its robustness said in the verdict: a verdict
    whose judged outcome changes with the solved fraction (:func:`_changes`) is fragile, and a fragile holds /
    does not hold becomes partly; fractions where the claim is not measured are named, without lowering it; an
    outcome another metric changes is named. ``others``: ``{metric: (outcome at the primary fraction, whether
    it is fragile)}``."""
    head, _, rest = claim.verdict.partition(" (")
    notes = [rest.removesuffix(")")] if rest else []
    outcome = head
    if _changes(by_fraction.values()):
        if head in (HOLDS, NOT_HOLD):
            outcome = PARTLY
            notes.append(f"fragile, lowered from {head}: by the solved fraction, {_spans(by_fraction)}")
        else:
            notes.append(f"fragile: by the solved fraction, {_spans(by_fraction)}")
    elif len(set(by_fraction.values())) > 1:  # judged the same wherever judged, not measured elsewhere
        notes.append(f"by the solved fraction, {_spans(by_fraction)}")
    for metric, (o, fragile) in others.items():
        if o != head:
            notes.append(f"metric-dependent: {o} under the {METRICS[metric]}" + (" (fragile)" if fragile else ""))
    verdict = outcome + (f" ({'; '.join(notes)})" if notes else "")
    return dataclasses.replace(claim, verdict=verdict)


def sensitivity(records: Sequence[Mapping], marginals: Sequence[Mapping] | None,
                gradients: Sequence[Mapping] | None = None) -> Sensitivity:
    """Judge the nine claims under every metric of :data:`METRICS` the records hold and every solved fraction of
    :data:`SENSITIVITY_FRACTIONS`, and give the final claims: judged with :data:`PRIMARY_METRIC` and
    :data:`SOLVED_FRACTION`, their verdicts qualified by :func:`_robust`."""
    finished = [r for r in records if not is_failed(r)]
    metrics = [m for m in METRICS if m == PRIMARY_METRIC or all(m in r for r in finished)]
    fractions = sorted({*SENSITIVITY_FRACTIONS, SOLVED_FRACTION})
    outcomes: dict[tuple[str, float], list[str]] = {}
    primary: list[Claim] = []
    for metric in metrics:
        table = success_table(records, metric=metric)
        for f in fractions:
            claims = _judge(table.at_fraction(f), records, marginals, gradients)
            outcomes[(metric, f)] = [c.outcome for c in claims]
            if metric == PRIMARY_METRIC and f == SOLVED_FRACTION:
                primary = claims
    final = []
    for i, claim in enumerate(primary):
        by_fraction = {f: outcomes[(PRIMARY_METRIC, f)][i] for f in fractions}
        others = {m: (outcomes[(m, SOLVED_FRACTION)][i], _changes(outcomes[(m, f)][i] for f in fractions))
                  for m in metrics if m != PRIMARY_METRIC}
        final.append(_robust(claim, by_fraction, others))
    return Sensitivity(outcomes, final, tuple(m for m in METRICS if m not in metrics))


def evaluate_claims(records: Sequence[Mapping], marginals: Sequence[Mapping] | None,
                    gradients: Sequence[Mapping] | None = None) -> list[Claim]:
    """The nine claims, in the report's order (claim 1 first), evaluated from the run records
    (failed runs included: they count as unsuccessful seeds), the marginals check and (quoted in
    claim 2) the expected-gradient check.

    Each is judged with the expected MSE (:data:`PRIMARY_METRIC`) and cells solved at :data:`SOLVED_FRACTION`,
    then again at every fraction of :data:`SENSITIVITY_FRACTIONS` and with the argmax MSE where the records
    hold it (:func:`sensitivity`). A verdict whose judged outcome changes with the fraction says "fragile" and
    its holds or does not hold is lowered to partly (a fraction where it is not measured is named, no change);
    one that the argmax MSE changes says "metric-dependent" and what it would be (e.g. ``"partly (fragile,
    lowered from holds: by the solved fraction, partly at 0.5–0.6, holds at 0.7–0.9)"``)."""
    return sensitivity(records, marginals, gradients).claims
