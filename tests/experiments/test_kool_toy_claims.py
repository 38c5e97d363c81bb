"""How the kool-toy claims are judged: exact tests on success counts, the solved-threshold sensitivity, the
two MSE metrics, and claims of failure on a model that learns nothing (a review's findings F1, F2, F4, F5).

Synthetic records only (no training): each cell's successes are set by hand, so every expected verdict
follows from the stated criteria by counting.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from scipy.stats import fisher_exact

import routelab.experiments.kool_toy as kt
from routelab.experiments.kit.claims import HOLDS, NOT_HOLD, NOT_MEASURED, PARTLY, Claim
from routelab.experiments.kit.store import read_jsonl
from routelab.experiments.kool_toy import claims as cl
from routelab.experiments.kool_toy.model import CONFIGS
from routelab.experiments.kool_toy.report import deviations_markdown, render_report

METHODS = ("sample", "sample_skip", "sample_skip_iw", "gumbel_matching", "gumbel_matching_iw", "gumbel_matching_sh")
TAUS = (0.01, 0.1, 0.4642, 1.0, 2.154, 10.0)
LOW, HIGH = (0.01, 0.1, 0.4642), (1.0, 2.154, 10.0)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "kool-toy"


def cells(config: str, successes: dict[str, dict[float, int]], *, seeds: int = 10,
          argmax: dict[str, dict[float, int]] | None = None) -> list[dict]:
    """Records of every (method, τ, seed) of ``config``: ``successes[method][tau]`` seeds have MSE 0.005, the
    others 0.3; ``argmax`` sets the argmax MSE's successes the same way (default: as the MSE's)."""
    argmax = successes if argmax is None else argmax
    out = []
    for m in METHODS:
        for t in TAUS:
            k, k_arg = successes.get(m, {}).get(t, 0), argmax.get(m, {}).get(t, 0)
            for s in range(seeds):
                out.append({"config": config, "method": m, "tau": t, "seed": s, "mse": 0.005 if s < k else 0.3,
                            "argmax_mse": 0.005 if s < k_arg else 0.3, "iw_max": 2.0, "iw_mean": 1.0})
    return out


def at(taus: tuple[float, ...], k: int) -> dict[float, int]:
    return dict.fromkeys(taus, k)


def verdicts(records: list[dict]) -> dict[int, str]:
    return {i: c.verdict for i, c in enumerate(cl.evaluate_claims(records, None), 1)}


# ----------------------------------------------------------------------------- Fisher's exact test


def _hypergeometric_p(a: tuple[int, int], b: tuple[int, int], alternative: str) -> float:
    """Fisher's exact p by brute force: the hypergeometric probabilities of every table with the same margins."""
    (sa, na), (sb, nb) = a, b
    total, ones = na + nb, sa + sb

    def prob(x: int) -> float:
        return math.comb(na, x) * math.comb(nb, ones - x) / math.comb(total, ones)

    support = range(max(0, ones - nb), min(na, ones) + 1)
    if alternative == "greater":
        return sum(prob(x) for x in support if x >= sa)
    if alternative == "less":
        return sum(prob(x) for x in support if x <= sa)
    observed = prob(sa)
    return sum(prob(x) for x in support if prob(x) <= observed * (1 + 1e-7))


@pytest.mark.parametrize("a, b", [((9, 10), (7, 10)), ((37, 130), (9, 130)), ((37, 130), (60, 130)),
                                  ((3, 3), (0, 3)), ((0, 780), (13, 780)), ((21, 40), (33, 40))])
@pytest.mark.parametrize("alternative", ["greater", "less", "two-sided"])
def test_fisher_p_is_the_hypergeometric_tail(a, b, alternative) -> None:
    got = cl.fisher_p(a, b, alternative)
    assert got == pytest.approx(_hypergeometric_p(a, b, alternative), rel=1e-9, abs=1e-15)
    table = [[a[0], a[1] - a[0]], [b[0], b[1] - b[0]]]
    assert got == pytest.approx(fisher_exact(table, alternative=alternative).pvalue, rel=1e-12)


def test_fisher_p_known_values_and_bad_input() -> None:
    assert cl.fisher_p((3, 3), (0, 3)) == pytest.approx(1 / 20)  # 1 / C(6, 3)
    assert cl.fisher_p((9, 10), (7, 10), "two-sided") == pytest.approx(0.5820, abs=1e-4)  # the review's best cells
    assert math.isnan(cl.fisher_p((0, 0), (3, 10)))
    with pytest.raises(ValueError, match="successes <= runs"):
        cl.fisher_p((11, 10), (3, 10))
    with pytest.raises(ValueError, match="alternative"):
        cl.fisher_p((1, 10), (3, 10), "bigger")
    assert cl.ALPHA == pytest.approx(0.05)


# ----------------------------------------------------------------------------- F4: learning nothing


def test_a_model_that_learns_nothing_supports_no_claim_of_failure() -> None:
    """Every run at MSE 0.3: claims 5 and 8 read "holds" and 7 "partly" before the fix (no cell solved was
    taken as support). Now every claim of failure has no reference that learns: not measured."""
    records = [r for c in CONFIGS for r in cells(c, {})]
    v = verdicts(records)
    assert v[5] == v[7] == v[8] == v[2] == NOT_MEASURED, v
    assert HOLDS not in v.values()
    measured = {i: c.measured for i, c in enumerate(cl.evaluate_claims(records, None), 1)}
    assert "fewer than 10" in measured[5] and "fewer than 10" in measured[8]


def test_a_solved_cell_refutes_a_failure_whatever_the_reference() -> None:
    """The reference only matters when the configuration said to fail solves nothing."""
    records = [r for c in CONFIGS for r in cells(c, {"sample": at(HIGH, 10)} if c == "reinforce_balance0.1" else {})]
    claim8 = cl.evaluate_claims(records, None)[7]
    assert claim8.outcome == NOT_HOLD and "only (a) measured" in claim8.verdict


# ----------------------------------------------------------------------------- F1: exact tests, sensitivity


def test_claim_3_follows_the_pooled_counts_not_the_solved_cells() -> None:
    """Sample Skip IW solves τ ≥ 1 (9/10) and nothing else; GM IW and GM SH succeed 7/10 at every τ, solving no
    cell at 8 of 10 but succeeding more often pooled (42/60 against 27/60). Before the fix: "holds" (fewer
    solved cells); now GM IW and GM SH are not less effective: only the biased GM is (0/60, p < 0.05)."""
    gm = at(TAUS, 7)
    records = cells("reinforce", {"sample": at(HIGH, 9), "sample_skip_iw": at(HIGH, 9), "gumbel_matching_iw": gm,
                                  "gumbel_matching_sh": gm})
    for r in records:  # the attribution (b) holds: large GM IW weights at high τ
        if r["method"] == "gumbel_matching_iw":
            r["iw_max"] = 100.0
    claim = cl.evaluate_claims(records, None)[2]
    assert claim.verdict == PARTLY, claim
    assert "Sample Skip IW 27/60" in claim.measured and "Gumbel-Matching IW 42/60" in claim.measured
    assert cl.fisher_p((27, 60), (42, 60)) > 0.05 and cl.fisher_p((27, 60), (0, 60)) < 0.05


def test_claim_8_with_half_of_reinforce_succeeding_is_not_holds() -> None:
    """With balance 0.1, REINFORCE's Sample and Sample Skip IW still succeed in 6 and 5 of 10 seeds at every
    τ ≥ 1 (the review's 21/40 and 22/40). At 8 of 10 no cell is solved, which alone made it "holds" before the
    fix; at 5 or 6 of 10 those cells are solved, so the verdict is fragile and reads partly."""
    works = {m: at(HIGH, 10) for m in ("sample", "sample_skip", "sample_skip_iw")}
    records = (cells("reinforce", works) + cells("reinforce_balance0.1", {"sample": at(HIGH, 6),
                                                                           "sample_skip_iw": at(HIGH, 5)})
               + cells("gating", {"gumbel_matching_iw": at(LOW, 10)}) + cells("gating_balance0.1", {}))
    claim = cl.evaluate_claims(records, None)[7]
    assert claim.outcome == PARTLY, claim.verdict
    raw = {f: cl.judge_claims(records, None, solved_fraction=f)[7].outcome for f in cl.SENSITIVITY_FRACTIONS}
    assert raw == {0.5: PARTLY, 0.6: PARTLY, 0.7: HOLDS, 0.8: HOLDS, 0.9: HOLDS}
    assert claim.verdict.startswith("partly (fragile, lowered from holds: by the solved fraction, partly at "
                                    "0.5–0.6, holds at 0.7–0.9"), claim.verdict
    assert "Sample 18/30 (30/30)" in claim.measured  # at τ ≥ 1, with the loss (without)


def test_the_solved_threshold_is_a_parameter_of_the_table() -> None:
    records = cells("c", {"sample": {1.0: 6}})
    t = cl.success_table(records)
    assert t.cells[("c", "sample", 1.0)] == (6, 10) and not t.solved("c", "sample", 1.0)
    assert t.at_fraction(0.6).solved("c", "sample", 1.0) and not t.at_fraction(0.7).solved("c", "sample", 1.0)
    assert t.pooled("c", ["sample"]) == (6, 60) and t.pooled("c", None, lambda x: x > 1) == (0, 120)
    with pytest.raises(ValueError, match="solved_fraction"):
        cl.success_table(records, solved_fraction=0.0)
    with pytest.raises(ValueError, match="metric"):
        cl.success_table(records, metric="loss")


def test_claim_1_at_the_edge_of_the_threshold_is_fragile() -> None:
    """Sample 7/10 at τ = 1 (as in the committed run): claim 1 holds at 0.5-0.7 and is partly at 0.8-0.9."""
    records = cells("reinforce", {"sample": {1.0: 7, 2.154: 9, 10.0: 9}, "sample_skip_iw": at(HIGH, 9)})
    assert "fragile" in cl.evaluate_claims(records, None)[0].verdict
    sens = cl.sensitivity(records, None)
    assert [sens.outcomes[("mse", f)][0] for f in cl.SENSITIVITY_FRACTIONS] == [HOLDS] * 3 + [PARTLY] * 2
    assert sens.claims[0].verdict == "partly (fragile: by the solved fraction, holds at 0.5–0.7, partly at 0.8–0.9)"
    assert 1 in sens.fragile()


# ----------------------------------------------------------------------------- F2: the two MSEs


def test_a_verdict_that_the_argmax_mse_changes_says_so() -> None:
    """Gating without IW fails by the expected MSE but, by the argmax MSE, solves cells as often as with IW:
    claim 5 holds and names the argmax view's does not hold."""
    records = (cells("gating", {"gumbel_matching_iw": at(LOW, 10)})
               + cells("gating_no_iw", {}, argmax={"gumbel_matching_iw": at(LOW, 10)}))
    assert cl.evaluate_claims(records, None)[4].verdict == \
        "holds (metric-dependent: does not hold under the argmax MSE)"
    sens = cl.sensitivity(records, None)
    assert sens.outcomes[("mse", 0.8)][4] == HOLDS and sens.outcomes[("argmax_mse", 0.8)][4] == NOT_HOLD
    assert sens.claims[4].verdict == "holds (metric-dependent: does not hold under the argmax MSE)"
    assert sens.metric_dependent() == [5] and sens.missing_metrics == ()
    assert cl.success_table(records, metric="argmax_mse").pooled("gating_no_iw") == (30, 360)


def test_records_without_the_argmax_mse_are_judged_by_the_expected_mse_only() -> None:
    records = cells("gating", {"gumbel_matching_iw": at(LOW, 10)}) + cells("gating_no_iw", {})
    for r in records:
        del r["argmax_mse"]
    sens = cl.sensitivity(records, None)
    assert sens.missing_metrics == ("argmax_mse",) and {m for m, _ in sens.outcomes} == {"mse"}
    assert sens.claims[4].verdict == HOLDS
    with pytest.raises(ValueError, match="argmax_mse"):
        cl.success_table(records, metric="argmax_mse")


# ----------------------------------------------------------------------------- the report (F1, F2, F5)


def test_report_gives_the_sensitivity_and_the_deviations_from_the_paper() -> None:
    records = read_jsonl(DOCS / "runs.jsonl")
    text = render_report(kt.FULL, records, marginals=None, errors=(), wall_s=None, n_planned=len(records))
    assert "## Deviations from the paper" in text and "### How the verdicts depend on the solved threshold" in text
    assert "| **expected MSE, 0.8** |" in text and "| argmax MSE, 0.5 |" in text
    # F1: the committed run's claim 3 and 8 are not "holds" (pooled counts, fragile)
    claims = cl.evaluate_claims(records, None)
    assert claims[2].outcome == PARTLY and claims[7].outcome == PARTLY
    assert "Sample Skip IW 37/130" in claims[2].measured and "Gumbel-Matching IW 60/130" in claims[2].measured
    assert "Sample 21/40 (33/40)" in claims[7].measured
    # F5: the App. E claim never run is said to be untested
    dev = deviations_markdown(kt.FULL, cl.sensitivity(records, None))
    assert "REINFORCE with balance loss 0.01" in dev and "**not tested**" in dev


# ----------------------------------------------------------------------------- a second review: F1, F2, F7


def _one_sided(a: tuple[int, int], b: tuple[int, int]) -> float:
    """scipy's one-sided Fisher p that ``a`` succeeds more often than ``b`` (the oracle of the tests below)."""
    return float(fisher_exact([[a[0], a[1] - a[0]], [b[0], b[1] - b[0]]], alternative="greater").pvalue)


def test_a_significant_claim_2_is_judged_though_sample_succeeds_in_fewer_than_10_runs() -> None:
    """Sample 9/10 at τ = 2.154 (a solved cell) and nothing else, Sample Skip never: 9/60 against 0/60 pooled and
    9/10 against 0/10 at that τ both reject at 5 % (scipy), so the claim holds. Before the fix: not measured
    (9 < 10)."""
    records = cells("reinforce", {"sample": {2.154: 9}})
    assert _one_sided((9, 60), (0, 60)) < 0.05 and _one_sided((9, 10), (0, 10)) < 0.05
    claim = cl.evaluate_claims(records, None)[1]
    assert claim.verdict == HOLDS, claim.verdict
    assert "not measured" not in claim.measured


def test_a_significant_failure_is_judged_though_the_reference_succeeds_in_fewer_than_10_runs() -> None:
    """Gating with IW 9/10 at τ = 0.1 (solved), without IW never: 9/360 against 0/360 (scipy p < 0.05) and no
    cell solved without IW, so claim 5 holds, and so does claim 7's part (c). Before the fix both were not
    measured."""
    ref = cells("gating", {"gumbel_matching_iw": {0.1: 9}})
    assert _one_sided((9, 360), (0, 360)) < 0.05
    claims = cl.evaluate_claims(ref + cells("gating_no_iw", {}), None)
    assert claims[4].verdict == HOLDS, claims[4].verdict
    works = cells("reinforce", {"sample": at(LOW, 10)})  # (a): Sample solves τ < 1 without IW too
    claim7 = cl.evaluate_claims(works + cells("reinforce_no_iw", {"sample": at(LOW, 10)}) + ref
                                + cells("gating_no_iw", {}), None)[6]
    assert "(c) gating_no_iw: 0/360 successful runs vs 9/360 in gating" in claim7.measured, claim7.measured
    # (a) holds, (b) has no power (no GM method succeeds with or without IW), (c) holds
    assert claim7.verdict == "holds (only (a), (c) measured)", claim7.verdict


def test_without_power_a_failure_is_not_measured_and_the_text_names_the_failing_group() -> None:
    """Gating with IW succeeds once in each of 4 cells (4/360, no cell solved), without IW never: one-sided
    p = 0.06 (scipy), no power: not measured, and the text says gating *without* IW fails."""
    assert _one_sided((4, 360), (0, 360)) > 0.05
    ref = {"gumbel_matching_iw": {0.01: 1, 0.1: 1}, "sample_skip_iw": {0.01: 1, 0.1: 1}}
    claim = cl.evaluate_claims(cells("gating", ref) + cells("gating_no_iw", {}), None)[4]
    assert claim.verdict == NOT_MEASURED
    assert "reference gating with IW succeeds in only 4/360 runs" in claim.measured
    assert "so gating without IW failing here says nothing" in claim.measured
    claim2 = cl.evaluate_claims(cells("reinforce", {}), None)[1]
    assert claim2.verdict == NOT_MEASURED and "so Sample Skip failing here says nothing" in claim2.measured


def test_not_measured_at_another_fraction_is_not_fragility() -> None:
    """The review's case A: gating with IW 5/10 at τ = 0.1, without IW 8/10 there. Without IW solves that cell
    at fractions ≤ 0.8 (does not hold: it does not fail); at 0.9 it solves nothing, the reference neither, and
    5/360 against 8/360 is no evidence (not measured). No fraction supports the claim, so it does not hold; before
    the fix it read partly (fragile)."""
    records = (cells("gating", {"gumbel_matching_iw": {0.1: 5}})
               + cells("gating_no_iw", {"gumbel_matching_iw": {0.1: 8}}))
    sens = cl.sensitivity(records, None)
    assert {f: sens.outcomes[("mse", f)][4] for f in cl.SENSITIVITY_FRACTIONS} == {
        0.5: NOT_HOLD, 0.6: NOT_HOLD, 0.7: NOT_HOLD, 0.8: NOT_HOLD, 0.9: NOT_MEASURED}
    assert sens.claims[4].verdict == "does not hold (by the solved fraction, does not hold at 0.5–0.8, not " \
                                     "measured at 0.9)"
    assert 5 not in sens.fragile()


def test_tau_lists_are_read_as_separate_numbers() -> None:
    """τ = 1 and 100 written "τ=1,100" read as 1100 (a thousands separator); with ", " they are two numbers."""
    text = cl._cells_str([("sample", 1.0), ("sample", 100.0), ("sample_skip", 2.0), ("sample_skip", 154.0)])
    numbers = Claim(text="t", criterion="c", measured=text, verdict=HOLDS).numbers
    assert numbers == [1.0, 100.0, 2.0, 154.0], (text, numbers)
