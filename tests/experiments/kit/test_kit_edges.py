"""Edges of the kit's documented contracts that its own tests left open.

Written against mutants that survived the kit's tests (review s42_mut_kit: SB6, ST16, ST8, CL5, CL6, FR1,
RG1). Each test reads its expected value from the docstring it names, counted by hand (or, for the one
Student-t bound, from scipy), not from the code under test.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from scipy import stats as scipy_stats

from routelab.experiments.kit.claims import (
    CLAIMS_FILE,
    HOLDS,
    NOT_HOLD,
    NOT_MEASURED,
    Claim,
    read_claims_json,
    single_seed,
    write_claims_json,
)
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.kit.failed_runs import with_failures_section
from routelab.experiments.kit.scoreboard import scoreboard_markdown
from routelab.experiments.kit.stats import Stat, beyond_spread
from routelab.experiments.kit.store import failed_record
from routelab.experiments.registry import register

# ------------------------------------------------------------------------ SB6: the one-seed sentence


def _claim(text: str, verdict: str) -> Claim:
    return Claim(text=text, measured="1", verdict=verdict)


def test_the_one_seed_count_is_among_the_claims_both_sides_judged(tmp_path: Path) -> None:
    """scoreboard: agreement counts "the claims that this run and the committed full run both judged (a
    verdict other than "—" or not measured)", and the sentence says how many "of the N" were judged on one
    seed. A quick run judges c1, c2, c3 on one seed; the committed full run judges c1 only (c2 "not measured",
    c3 absent). By hand: both judged = {c1}, same outcome = 1, one-seed among them = 1, so "1 of the 1"."""
    out, docs = tmp_path / "out", tmp_path / "docs"
    write_claims_json(out / "e", single_seed([_claim("c1", HOLDS), _claim("c2", HOLDS), _claim("c3", NOT_HOLD)], 1),
                      experiment="e", paper="p", quick=True)
    write_claims_json(docs / "e", [_claim("c1", HOLDS), _claim("c2", NOT_MEASURED)], experiment="e", paper="p",
                      quick=False)
    text = scoreboard_markdown(["e"], out, quick=True, docs_dir=docs)
    assert "Same outcome as the committed full run on 1 of the 1 claims both judged" in text
    assert re.findall(r"(\d+) of the (\d+) were judged on one seed", text) == [("1", "1")]


# ------------------------------------------------------------------------ ST16 / ST8: beyond_spread


@pytest.mark.parametrize("mean", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("se, n", [(None, 1), (1.0, 3)])
def test_a_non_finite_mean_is_not_measured(mean: float, se: float | None, n: int) -> None:
    """``beyond_spread`` returns "``None`` when nothing was measured": a NaN or infinite mean (a diverged
    difference) has no side of 0 to be on, with or without a standard error."""
    assert beyond_spread(Stat(mean, se, n)) is None


def test_a_finite_mean_with_the_same_spread_is_judged() -> None:
    """The contrast to the test above: with the same se = 1 and n = 3, a finite mean is judged against the
    bound t(0.975, 2) * 1 = 4.30 (scipy), so 5.0 is beyond it (+1), -5.0 below (-1) and 4.0 within (0)."""
    bound = scipy_stats.t.ppf(0.975, 2)
    assert 4.0 < bound < 5.0
    assert [beyond_spread(Stat(m, 1.0, 3)) for m in (5.0, -5.0, 4.0)] == [1, -1, 0]


@pytest.mark.parametrize("confidence", [95, 1.0, 0.0, -0.5, math.nan])
@pytest.mark.parametrize("stat", [Stat(0.3, None, 1), Stat(math.nan, None, 0), Stat(math.inf, 1.0, 3)],
                         ids=["one-value", "no-value", "non-finite"])
def test_a_confidence_outside_0_1_is_refused_whatever_the_stat(confidence: float, stat: Stat) -> None:
    """``beyond_spread`` raises "ValueError: when ``confidence`` is not in (0, 1)", also where no t quantile
    is needed to answer (one value: the sign decides; nothing measured). ``confidence=95`` (percent for a
    fraction) must not pass as a verdict."""
    with pytest.raises(ValueError, match="confidence must be in"):
        beyond_spread(stat, confidence=confidence)


# ------------------------------------------------------------------------ CL5 / CL6: read_claims_json


def _write_doc(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / CLAIMS_FILE
    path.write_text(json.dumps(doc))
    return path


def _valid_claim() -> dict[str, Any]:
    return Claim(text="A beats B", measured="0.5 vs 0.4", verdict=HOLDS).to_json("p")


def test_a_file_of_format_1_is_read(tmp_path: Path) -> None:
    """The positive case for the refusals below: format 1 with one valid claim reads back as written."""
    cf = read_claims_json(_write_doc(tmp_path, {"format": 1, "experiment": "e", "claims": [_valid_claim()]}))
    assert [(c.text, c.measured, c.verdict) for c in cf.claims] == [("A beats B", "0.5 vs 0.4", HOLDS)]


@pytest.mark.parametrize("doc", [{"format": 2, "claims": []}, {"claims": []}, {"format": "1", "claims": []},
                                 {"format": True, "claims": []}, {"format": 1.0, "claims": []},
                                 {"format": 1}, [{"format": 1, "claims": []}]],
                         ids=["format-2", "no-format", "format-as-string", "format-true", "format-float",
                              "no-claims", "not-an-object"])
def test_a_file_not_of_format_1_is_refused(tmp_path: Path, doc: Any) -> None:
    """``read_claims_json`` raises ValueError "when it is not such a file": a file written by
    ``write_claims_json`` has ``"format": 1`` (an int) and a ``claims`` list. Another (or no) format is not
    read as format 1."""
    with pytest.raises(ValueError, match="not a claims.json of format 1"):
        read_claims_json(_write_doc(tmp_path, doc))


@pytest.mark.parametrize("field", ["text", "measured", "verdict"])
def test_a_claim_without_a_required_field_is_refused(tmp_path: Path, field: str) -> None:
    """``Claim.from_json`` raises ValueError "when ``obj`` lacks ``text``, ``measured`` or ``verdict``";
    ``read_claims_json`` passes it on naming the file. A missing ``text`` must not read as an empty claim."""
    claim = _valid_claim()
    del claim[field]
    path = _write_doc(tmp_path, {"format": 1, "claims": [claim]})
    with pytest.raises(ValueError, match=re.escape(f"needs a string {field!r}")) as err:
        read_claims_json(path)
    assert str(path) in str(err.value)


# ------------------------------------------------------------------------ FR1: where the failed-runs section goes


REPORT = "# Toy report\n\nWhat was run.\n\n## Results\n\nr\n\n## Claims\n\nc\n"


def _headings(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith("#")]


def test_the_failed_runs_section_goes_before_the_first_section() -> None:
    """``with_failures_section``: the section is "inserted before its first ``## `` section". The report's
    title and introduction stay on top; the failed runs come before Results and Claims, so a reader meets
    them before the averages they are missing from."""
    failed = [failed_record({"router": "a", "seed": 1}, "loss became nan at step 7", 7)]
    text = with_failures_section(REPORT, failed, total=4, fields=("router", "seed"))
    assert _headings(text) == ["# Toy report", "## Failed runs", "## Results", "## Claims"]
    assert text.startswith("# Toy report\n\nWhat was run.\n\n## Failed runs\n")
    assert "**1 of 4 runs failed**" in text and "- router=a, seed=1: loss became nan at step 7" in text


def test_the_failed_runs_section_is_appended_to_a_report_without_sections() -> None:
    """``with_failures_section``: "appended when it has none"; "unchanged when nothing failed"."""
    failed = [failed_record({"seed": 0}, "diverged", None)]
    text = with_failures_section("# Title\n\nBody.", failed, total=1, fields=("seed",))
    assert _headings(text) == ["# Title", "## Failed runs"] and text.startswith("# Title\n\nBody.\n")
    assert with_failures_section(REPORT, [], total=4, fields=("seed",)) == REPORT


# ------------------------------------------------------------------------ RG1: register's quick_seconds


def _toy(quick_seconds: Any) -> Experiment:
    return Experiment("toy-cost", "Toy.", lambda out_dir, settings: out_dir / "report.md", full=None,
                      quick_settings=None, quick_seconds=quick_seconds)


@pytest.mark.parametrize("cost", [math.inf, -math.inf, math.nan, -1, True, "5"])
def test_register_refuses_a_quick_cost_that_is_not_a_finite_number_at_least_0(registry: dict[str, Any],
                                                                              cost: Any) -> None:
    """``register`` raises ValueError when "``quick_seconds`` is not a finite number >= 0" (its CPU seconds,
    by which ``--quick --jobs N`` starts the costliest first), and registers nothing."""
    with pytest.raises(ValueError, match="quick_seconds of 'toy-cost' must be a finite number >= 0"):
        register(_toy(cost))
    assert registry == {}


@pytest.mark.parametrize("cost", [0, 0.0, 12.5, 1e9])
def test_register_accepts_a_finite_quick_cost_at_least_0(registry: dict[str, Any], cost: float) -> None:
    """The boundary of the rule above: 0 ("0 if not known") and any finite positive cost are registered."""
    exp = register(_toy(cost))
    assert registry == {"toy-cost": exp}
