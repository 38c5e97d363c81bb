"""The kool-toy claims on the edges of their sub-criteria (``kool_toy/claims.py``).

``test_kool_toy_claims.py`` judges each claim on a paper-like table and on its opposite; these tests put one
sub-criterion at a time on its boundary, or make it the only one that decides the verdict, so that a rule
read with the wrong threshold, the wrong τ band, the wrong direction or the wrong set of methods changes the
verdict. Every expected verdict is worked out by hand from the criterion text that the claim prints (quoted
in each docstring) and from the definitions in the module docstring of ``claims.py``: a run succeeds with MSE
< 0.02, a cell is solved when ≥ 80 % of its seeds succeed, low τ is τ < 1 and high τ is τ > 1, a reference
*learns* with ≥ 10 successful runs or a solved cell. The Fisher p-values the cases rely on are far from 0.05
and are stated (computed with ``scipy.stats.fisher_exact``, independent of the code under test).

Synthetic records only, no training: each case runs in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from routelab.experiments.kit.claims import HOLDS, NOT_HOLD, NOT_MEASURED, PARTLY
from routelab.experiments.kool_toy import claims as cl

METHODS = ("sample", "sample_skip", "sample_skip_iw", "gumbel_matching", "gumbel_matching_iw", "gumbel_matching_sh")
TAUS = (0.01, 0.1, 0.4642, 1.0, 2.154, 10.0)
LOW, HIGH = (0.01, 0.1, 0.4642), (2.154, 10.0)  # τ = 1 is neither (module docstring: low τ < 1, high τ > 1)
GOOD, BAD = 0.005, 0.3  # an MSE below / above the success threshold 0.02
SEEDS = 10

Weight = float | Callable[[float], float]


def cells(config: str, successes: Mapping[str, Mapping[float, int]], *, iw_max: Mapping[str, Weight] | None = None,
          failed: Mapping[str, Mapping[float, int]] | None = None) -> list[dict]:
    """Records of every (method, τ, seed) of ``config`` with 10 seeds.

    ``successes[method][tau]`` seeds have MSE 0.005 (success), the other finished seeds 0.3 (failure);
    ``failed[method][tau]`` of the last seeds are failed (diverged) runs; ``iw_max[method]`` is the largest
    importance weight of the method's runs (a number, or a function of τ; default 2).
    """
    out = []
    for m in METHODS:
        for t in TAUS:
            k = successes.get(m, {}).get(t, 0)
            n_failed = (failed or {}).get(m, {}).get(t, 0)
            w = (iw_max or {}).get(m, 2.0)
            for s in range(SEEDS):
                if s >= SEEDS - n_failed:
                    out.append({"config": config, "method": m, "tau": t, "seed": s, "status": "failed"})
                    continue
                mse = GOOD if s < k else BAD
                out.append({"config": config, "method": m, "tau": t, "seed": s, "mse": mse, "argmax_mse": mse,
                            "iw_max": w(t) if callable(w) else w, "iw_mean": 1.0})
    return out


def at(taus: tuple[float, ...], k: int) -> dict[float, int]:
    return dict.fromkeys(taus, k)


def everything(config: str) -> list[dict]:
    """``config`` with every method solving every τ (10/10)."""
    return cells(config, {m: at(TAUS, SEEDS) for m in METHODS})


def claim(records: list[dict], number: int, marginals: list[dict] | None = None) -> str:
    """The verdict of claim ``number`` (numbered from 1, as in the report) at the primary metric and fraction."""
    return cl.judge_claims(records, marginals)[number - 1].verdict


# ----------------------------------------------------------------------------- success table


def test_a_failed_run_counts_as_a_seed_without_success() -> None:
    """``success_table``: "a seed whose run failed (diverged) counts as a seed without success". 7 successes and
    3 failed runs of 10 seeds are the cell (7, 10): a rate of 0.7, not solved at 80 % but solved at 70 %. Were
    the failed runs left out of the seeds the cell would read (7, 7), solved."""
    recs = [{"config": "reinforce", "method": "sample", "tau": 1.0, "seed": s, "mse": GOOD, "argmax_mse": GOOD}
            for s in range(7)]
    recs += [{"config": "reinforce", "method": "sample", "tau": 1.0, "seed": s, "status": "failed"}
             for s in range(7, 10)]
    table = cl.success_table(recs)
    key = ("reinforce", "sample", 1.0)
    assert table.cells == {key: (7, 10)}
    assert table.failed == {key: 3}
    assert table.rate(*key) == pytest.approx(0.7)
    assert not table.solved(*key)
    assert table.at_fraction(0.7).solved(*key)


def test_failed_runs_make_a_paper_like_cell_unsolved() -> None:
    """The same rule through a claim: Sample and Sample Skip IW succeed in 7 of 10 seeds at every τ ≥ 1 and the
    other 3 seeds diverged. Claim 1 (a) "both solve every τ ≥ 1" then fails (7/10 < 80 %); (b) holds (identical
    counts, p = 1) but with no τ ≥ 1 solved by both, so "partly: ... (b) with at least one τ ≥ 1 solved by both"
    does not apply: does not hold. Counting only the finished runs would make every cell 7/7, solved: holds."""
    runs = {m: at((1.0, *HIGH), 7) for m in ("sample", "sample_skip_iw")}
    recs = cells("reinforce", runs, failed={m: at((1.0, *HIGH), 3) for m in runs})
    assert claim(recs, 1) == NOT_HOLD


# ----------------------------------------------------------------------------- claim 1


def test_claim1_b_needs_every_single_tau_to_agree() -> None:
    """Claim 1 (b): "their success counts do not differ: Fisher's exact test (two-sided) p ≥ 0.05 pooled over τ
    **and at every τ**". Both methods solve every τ ≥ 1 ((a) holds) and tie pooled over τ (40/60 each, p = 1),
    but at τ = 0.01 Sample has 10/10 against Sample Skip IW's 0/10 (two-sided p ≈ 1.1e-5; the reverse at
    τ = 0.1). (b) fails, and (a) without (b) is partly, not holds."""
    s = {**at((1.0, *HIGH), 10), 0.01: 10, 0.1: 0}
    k = {**at((1.0, *HIGH), 10), 0.01: 0, 0.1: 10}
    assert claim(cells("reinforce", {"sample": s, "sample_skip_iw": k}), 1) == PARTLY


def test_claim1_b_alone_is_partly_only_with_a_high_tau_solved_by_both() -> None:
    """Claim 1: "partly: (a) without (b), or (b) with at least one τ ≥ 1 solved by both". Both methods succeed
    3/10 at every τ: (b) holds (identical counts), (a) does not, and no τ ≥ 1 is solved by either, so the claim
    does not hold. With both also solving τ = 10 (10/10) the same (b) does have a τ ≥ 1 solved by both: partly."""
    assert claim(cells("reinforce", {"sample": at(TAUS, 3), "sample_skip_iw": at(TAUS, 3)}), 1) == NOT_HOLD
    both_at_10 = {**at(TAUS, 3), 10.0: 10}
    assert claim(cells("reinforce", {"sample": both_at_10, "sample_skip_iw": both_at_10}), 1) == PARTLY


# ----------------------------------------------------------------------------- claim 2


def test_claim2_per_tau_test_is_one_sided() -> None:
    """Claim 2 (b): "Sample succeeds more often than Sample Skip by Fisher's exact test (**one-sided**, p < 0.05)
    ... at some τ". Here Sample Skip is the one ahead: it solves τ = 0.01 (10/10) where Sample has 0/10; both
    solve τ ≥ 1. The one-sided p at τ = 0.01 is 1 and pooled (30/60 against 40/60) p ≈ 0.98, so neither (a) nor
    (b) holds. Sample learns (it solves cells), so the claim is judged: does not hold (a two-sided per-τ test
    would find τ = 0.01 significant and say partly)."""
    recs = cells("reinforce", {"sample": at((1.0, *HIGH), 10), "sample_skip": {**at((1.0, *HIGH), 10), 0.01: 10}})
    assert claim(recs, 2) == NOT_HOLD


def test_claim2_is_measured_when_either_method_learns() -> None:
    """Claim 2 is "not measured when neither test is significant and **neither** method solves a cell or succeeds
    in 10 runs". Sample never succeeds; Sample Skip succeeds in 2 seeds at each of the 6 τ (12 runs, no solved
    cell): no test is significant (one-sided p = 1), but Sample Skip learns, so the claim is judged and does not
    hold. With 9 runs of Sample Skip (fewer than 10) and no solved cell, nothing learns: not measured."""
    assert claim(cells("reinforce", {"sample_skip": at(TAUS, 2)}), 2) == NOT_HOLD
    nine = {**at(TAUS[:4], 2), 2.154: 1}
    assert claim(cells("reinforce", {"sample_skip": nine}), 2) == NOT_MEASURED


# ----------------------------------------------------------------------------- claim 3

SKIP_IW_SOLVES = {"sample_skip_iw": at(TAUS, 10)}  # 60/60 against 0/60 for each GM method: p ≈ 1e-35, (a) for all


def test_claim3_b_needs_at_least_twice_the_weight() -> None:
    """Claim 3 (b): "at high τ (> 1) the median largest importance weight of GM IW is **at least twice** that of
    Sample Skip IW". Sample Skip IW succeeds everywhere and no Gumbel-Matching estimator does, so (a) holds for
    all three. With GM IW's largest weight 3 against Sample Skip IW's 2 (1.5 times) (b) fails: partly. At
    exactly twice (4 against 2) (b) holds: holds."""
    recs = cells("reinforce", SKIP_IW_SOLVES, iw_max={"gumbel_matching_iw": 3.0, "sample_skip_iw": 2.0})
    assert claim(recs, 3) == PARTLY
    recs = cells("reinforce", SKIP_IW_SOLVES, iw_max={"gumbel_matching_iw": 4.0, "sample_skip_iw": 2.0})
    assert claim(recs, 3) == HOLDS


def test_claim3_b_reads_the_weights_at_high_tau_only() -> None:
    """Claim 3 (b) compares the weights "at high τ (> 1)". (a) holds for all three as above. GM IW has weight 3 at
    τ > 1 (1.5 times Sample Skip IW's 2) and 100 elsewhere: (b) fails, partly. The mirror image, 100 at τ > 1 and
    3 elsewhere: (b) holds, holds. τ = 1 is not high: weight 100 at τ = 1 alone (3 at every other τ) still fails."""
    high_small = {"gumbel_matching_iw": lambda t: 3.0 if t > 1 else 100.0}
    assert claim(cells("reinforce", SKIP_IW_SOLVES, iw_max=high_small), 3) == PARTLY
    high_large = {"gumbel_matching_iw": lambda t: 100.0 if t > 1 else 3.0}
    assert claim(cells("reinforce", SKIP_IW_SOLVES, iw_max=high_large), 3) == HOLDS
    at_one = {"gumbel_matching_iw": lambda t: 100.0 if t == 1.0 else 3.0}
    assert claim(cells("reinforce", SKIP_IW_SOLVES, iw_max=at_one), 3) == PARTLY


# ----------------------------------------------------------------------------- claim 4


def gating_claim4(successes: Mapping[str, Mapping[float, int]]) -> list[dict]:
    """Claim 4's four configurations: balance 0.01 (``gating``) with ``successes``, the others learn nothing.
    Then (a) holds whenever 0.01 solves a cell: 0 and 0.1 solve none, and ≥ 30/360 against 0/360 gives a
    one-sided Fisher p < 1e-9 for both comparisons."""
    return (cells("gating", successes) + cells("gating_balance0", {}) + cells("gating_balance0.03", {})
            + cells("gating_balance0.1", {}))


def test_claim4_b_needs_80_percent_of_the_successes() -> None:
    """Claim 4 (b): "**≥ 80 %** of the successful runs with 0.01/0.03 are a capacity-respecting importance-weighted
    method (Sample Skip IW, GM IW, GM SH) at τ < 1". (a) holds (see :func:`gating_claim4`). With Sample Skip IW
    solving the three low τ (30 runs) and Sample solving τ = 2.154 and 10 (20 runs), 30/50 = 60 %: (b) fails,
    partly. With GM IW solving τ = 0.01 in place of Sample at τ = 2.154, 40 of the 50 successes are capped IW
    at low τ, exactly 80 %: holds."""
    sixty = {"sample_skip_iw": at(LOW, 10), "sample": at(HIGH, 10)}
    assert claim(gating_claim4(sixty), 4) == PARTLY
    eighty = {"sample_skip_iw": at(LOW, 10), "gumbel_matching_iw": {0.01: 10}, "sample": {10.0: 10}}
    assert claim(gating_claim4(eighty), 4) == HOLDS


def test_claim4_b_counts_capped_methods_at_low_tau_only() -> None:
    """Claim 4 (b) counts the capped IW methods "at τ < 1". When gating succeeds only with Sample Skip IW at
    τ ≥ 1 (1, 2.154, 10: 30 runs), none of its successes is at τ < 1: (b) fails ((a) holds), partly. The same
    runs at τ < 1 make (b) hold: holds."""
    assert claim(gating_claim4({"sample_skip_iw": at((1.0, *HIGH), 10)}), 4) == PARTLY
    assert claim(gating_claim4({"sample_skip_iw": at(LOW, 10)}), 4) == HOLDS


# ----------------------------------------------------------------------------- claim 5


def test_claim5_reference_learns_from_exactly_ten_successes() -> None:
    """Claim 5 is "not measured when (a)'s test is not significant, neither solves a cell and gating with importance
    weights succeeds in **fewer than 10** runs" (``MIN_REFERENCE_SUCCESSES``: "≥ 10"). Gating with IW succeeds in
    exactly 10 runs (2 seeds at each of 5 τ, no solved cell), without IW in 5 (one-sided p ≈ 0.15, not
    significant): judged, (a) fails and (b) "solves no cell" holds, partly. With 9 runs with IW: not measured."""
    five = (0.01, 0.1, 0.4642, 1.0, 2.154)
    without = cells("gating_no_iw", {"sample": at(five, 1)})
    assert claim(cells("gating", {"sample": at(five, 2)}) + without, 5) == PARTLY
    nine = {**at(five[:4], 2), 2.154: 1}
    assert claim(cells("gating", {"sample": nine}) + without, 5) == NOT_MEASURED


# ----------------------------------------------------------------------------- claim 6


def test_claim6_a_needs_all_sinkhorn_cells_at_high_tau() -> None:
    """Claim 6 (a): "REINFORCE+Sinkhorn solves ≥ 1 cell, **all** at τ > 1, and ... REINFORCE without Sinkhorn
    succeeds more often" (here 360/360 against 20/360). With Sinkhorn solving τ = 0.01 and τ = 10, not all its
    cells are high: (a) fails, and (b) is not measured (no gating configurations): "does not hold (only (a)
    measured)". Solving τ = 2.154 and 10 instead: "holds (only (a) measured)". Solving τ = 1 alone: τ = 1 is not
    high, does not hold."""
    base = everything("reinforce")
    mixed = cells("reinforce_sinkhorn", {"sample": {0.01: 10, 10.0: 10}})
    assert claim(base + mixed, 6) == "does not hold (only (a) measured)"
    high = cells("reinforce_sinkhorn", {"sample": at(HIGH, 10)})
    assert claim(base + high, 6) == "holds (only (a) measured)"
    one = cells("reinforce_sinkhorn", {"sample": {1.0: 10}})
    assert claim(base + one, 6) == "does not hold (only (a) measured)"


# ----------------------------------------------------------------------------- claim 7


def test_claim7_a_ignores_the_gumbel_matching_methods() -> None:
    """Claim 7 (a): "REINFORCE without IW: a **non-Gumbel-Matching** method solves some τ < 1 and none solves a
    τ > 1". Without IW, Sample solves the low τ and GM IW the high τ: (a) holds (GM IW is not a
    non-Gumbel-Matching method), (b) "the Gumbel-Matching methods without IW solve no cell" fails, and (c) fails
    (gating without IW solves the low τ with Sample). One part of three: partly. Were GM IW counted in (a), no
    part would hold."""
    recs = (everything("reinforce") + cells("reinforce_no_iw", {"sample": at(LOW, 10), "gumbel_matching_iw":
                                                                 at(HIGH, 10)})
            + everything("gating") + cells("gating_no_iw", {"sample": at(LOW, 10)}))
    assert claim(recs, 7) == PARTLY


# ----------------------------------------------------------------------------- claim 9


def marginal_rows(mean_abs_diff: float, unbalanced: float) -> list[dict]:
    """Rows of the marginals check for n = 4 and 8 with the given mean differences (numbers chosen exact in binary)."""
    return [{"n": n, "matrices": 4, "samples": 1000, "max_abs_diff": 2 * mean_abs_diff, "mean_abs_diff": mean_abs_diff,
             "mean_se": 0.001, "max_se": 0.001, "se_of_max": 0.001, "mean_abs_diff_unbalanced": unbalanced}
            for n in (4, 8)]


def test_claim9_needs_at_most_a_quarter_of_the_softmax_gap() -> None:
    """Claim 9: "the mean absolute difference between the Gumbel-Matching and the Sinkhorn marginals is ≤ 0.02
    **and at most a quarter** of the mean absolute difference between the Gumbel-Matching marginals and the
    unbalanced softmax". 0.01 against a softmax gap of 0.02 (a half) does not hold although 0.01 ≤ 0.02;
    0.015625 against 0.0625 (exactly a quarter, both exact binary fractions) holds; 0.015625 against a gap a
    hair below 0.0625 does not."""
    assert claim([], 9, marginal_rows(0.01, 0.02)) == NOT_HOLD
    assert claim([], 9, marginal_rows(0.015625, 0.0625)) == HOLDS
    assert claim([], 9, marginal_rows(0.015625, 0.0625 - 1e-9)) == NOT_HOLD


# ----------------------------------------------------------------------------- sensitivity


def test_argmax_metric_is_judged_only_when_every_finished_run_has_it() -> None:
    """``Sensitivity.missing_metrics``: "the metrics of METRICS that some finished run lacks (not judged)". One
    finished record without ``argmax_mse`` (as written by an older version) leaves the argmax MSE unjudged, and
    says so; failed runs, which carry no MSE at all, do not count as lacking it."""
    recs = cells("reinforce", {"sample": at(TAUS, 10), "sample_skip_iw": at(TAUS, 10)},
                 failed={"sample_skip": {0.01: 2}})
    full = cl.sensitivity(recs, None)
    assert full.missing_metrics == ()
    assert {m for m, _ in full.outcomes} == {"mse", "argmax_mse"}
    del recs[0]["argmax_mse"]
    assert "status" not in recs[0]
    partial = cl.sensitivity(recs, None)
    assert partial.missing_metrics == ("argmax_mse",)
    assert {m for m, _ in partial.outcomes} == {"mse"}
    assert [c.outcome for c in partial.claims] == [c.outcome for c in full.claims]
