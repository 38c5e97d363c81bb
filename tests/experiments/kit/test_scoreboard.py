"""The scoreboard that opens ``routelab reproduce``'s report: every claim of every experiment, this run's verdict
beside the committed full run's (read from docs/<experiment>/claims.json), missing entries shown as such."""

from __future__ import annotations

from pathlib import Path

from routelab.experiments.kit.claims import (
    CLAIMS_FILE,
    HOLDS,
    NOT_HOLD,
    PARTLY,
    Claim,
    read_claims_json,
    write_claims_json,
)
from routelab.experiments.kit.scoreboard import DASH, scoreboard_markdown, scoreboard_rows
from routelab.experiments.registry import BUILTIN

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _write(d: Path, claims: list[Claim], paper: str = "A et al. 2020", quick: bool = False) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "report.md").write_text("# report\n", encoding="utf-8")
    write_claims_json(d, claims, experiment=d.name, paper=paper, quick=quick)


def _table_rows(markdown: str) -> list[list[str]]:
    """The body rows of the scoreboard table, as cells."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines[2:]]


def test_scoreboard_lists_every_claim_of_every_experiment() -> None:
    """Against the experiments' own claim lists (their committed claims.json): one row per claim, in order, the
    full-run column equal to the claim's verdict."""
    names = [e.name for e in BUILTIN]
    rows = scoreboard_rows(names, DOCS, docs_dir=DOCS)
    expected = [(n, c.text, c.verdict, cf.paper) for n in names
                for cf in [read_claims_json(DOCS / n / CLAIMS_FILE)] for c in cf.claims]
    assert len(expected) >= 7
    assert [(r.experiment, r.claim, r.full_verdict, r.paper) for r in rows] == expected
    assert all(r.run_verdict == r.full_verdict and r.link == f"{r.experiment}/report.md" for r in rows)
    table = _table_rows(scoreboard_markdown(names, DOCS, quick=False, docs_dir=DOCS))
    assert len(table) == len(expected)
    for cells, (name, text, verdict, _) in zip(table, expected, strict=True):
        assert cells[4] == f"[{name}]({name}/report.md)"
        assert _shows(cells[1], text) and _shows(cells[3], verdict) and _shows(cells[2], verdict)


def _shows(cell: str, full: str) -> bool:
    """``cell`` is ``full`` on one line, or its beginning cut at a word and marked with "…"."""
    line, cell = " ".join(full.split()), cell.replace("\\|", "|")
    return cell == line or (cell.endswith("…") and len(cell) < len(line) and line.startswith(cell[:-1]))


def test_full_run_column_reads_the_committed_claims_json(tmp_path: Path) -> None:
    out, docs = tmp_path / "out", tmp_path / "docs"
    a = Claim(text="A beats B.", measured="1.0 vs 2.0", verdict=HOLDS)
    b = Claim(text="B is sparse.", measured="3 experts", verdict=NOT_HOLD)
    only_full = Claim(text="C only in the full run.", measured="x", verdict=PARTLY)
    _write(out / "exp", [a, b], quick=True)
    _write(docs / "exp", [replace_verdict(a, f"{PARTLY} (within 2 s.e.)"), only_full])
    rows = scoreboard_rows(["exp"], out, docs_dir=docs)
    got = [(r.claim, r.run_verdict, r.full_verdict) for r in rows]
    assert got[0] == ("A beats B.", HOLDS, f"{PARTLY} (within 2 s.e.)")
    assert got[1][:2] == ("B is sparse.", NOT_HOLD) and got[1][2].startswith(DASH)
    assert "not in the committed full run" in got[1][2]
    assert got[2][0] == "C only in the full run." and got[2][2] == PARTLY and "not in this run" in got[2][1]
    text = scoreboard_markdown(["exp"], out, quick=True, docs_dir=docs)
    assert text.startswith("## Scoreboard") and "quick verdict" in text
    assert "quick verdict" not in scoreboard_markdown(["exp"], out, quick=False, docs_dir=docs)


def replace_verdict(c: Claim, verdict: str) -> Claim:
    return Claim(text=c.text, criterion=c.criterion, measured=c.measured, verdict=verdict, paper=c.paper, id=c.id)


def test_missing_docs_entry_is_shown_as_such(tmp_path: Path) -> None:
    out, docs = tmp_path / "out", tmp_path / "docs"
    _write(out / "exp", [Claim(text="A beats B.", measured="1", verdict=HOLDS)])
    docs.mkdir()
    (row,) = scoreboard_rows(["exp"], out, docs_dir=docs)
    assert row.run_verdict == HOLDS
    assert row.full_verdict == f"{DASH} (no committed full run (docs/exp/{CLAIMS_FILE} not found))"
    (row,) = scoreboard_rows(["exp"], out, docs_dir=None)
    assert row.full_verdict.startswith(DASH) and "docs/" in row.full_verdict
    (docs / "exp").mkdir()
    (docs / "exp" / CLAIMS_FILE).write_text("[]", encoding="utf-8")
    (row,) = scoreboard_rows(["exp"], out, docs_dir=docs)
    assert row.full_verdict.startswith(f"{DASH} (unreadable claims.json")


def test_experiment_that_did_not_run_keeps_its_committed_rows(tmp_path: Path) -> None:
    out, docs = tmp_path / "out", tmp_path / "docs"
    _write(out / "exp", [Claim(text="stale", measured="1", verdict=HOLDS)])  # an earlier invocation's: ignored
    _write(docs / "exp", [Claim(text="A beats B.", measured="1", verdict=NOT_HOLD)])
    (row,) = scoreboard_rows(["exp"], out, docs_dir=docs, not_run={"exp": "skipped: data"})
    assert (row.claim, row.full_verdict, row.link) == ("A beats B.", NOT_HOLD, "")
    assert row.run_verdict == f"{DASH} (not run: skipped: data)"
    (row,) = scoreboard_rows(["new"], out, docs_dir=docs, not_run={"new": "failed: boom"})
    assert row.claim == DASH and "failed: boom" in row.run_verdict and "not found" in row.full_verdict


def test_agreement_counts_claims_both_runs_judged_by_outcome(tmp_path: Path) -> None:
    from routelab.experiments.kit.claims import NOT_MEASURED
    from routelab.experiments.kit.scoreboard import agreement

    out, docs = tmp_path / "out", tmp_path / "docs"
    mk = lambda text, verdict: Claim(text=text, measured="1", verdict=verdict)  # noqa: E731
    _write(out / "e1", [mk("c1", f"{PARTLY} (within 2 s.e.)"), mk("c2", HOLDS), mk("c3", NOT_MEASURED),
                        mk("c4", f"{NOT_MEASURED} (quick form: 4 of 124 steps)")], quick=True)
    _write(docs / "e1", [mk("c1", PARTLY), mk("c2", NOT_HOLD), mk("c3", HOLDS), mk("c4", HOLDS), mk("c5", HOLDS)])
    _write(out / "e2", [mk("d1", NOT_HOLD)], quick=True)
    rows = scoreboard_rows(["e1", "e2"], out, docs_dir=docs)
    # e1: c1 same outcome (qualifier ignored), c2 differs, c3/c4 not measured, c5 not in this run;
    # e2: d1 is not in the (missing) committed run
    assert agreement(rows) == {"e1": (1, 2), "e2": (0, 0)}
    text = scoreboard_markdown(["e1", "e2"], out, quick=True, docs_dir=docs)
    assert "**Same outcome as the committed full run on 1 of the 2 claims both judged** (e1 1/2, e2 0/0)" in text


def test_the_agreement_says_how_many_run_verdicts_are_one_seed_signs(tmp_path: Path) -> None:
    """Review: a quick form's one-seed verdicts (the sign of one comparison) counted as judged agreement
    with the full run's tests, unmarked. The sentence now says how many they are."""
    from routelab.experiments.kit.claims import SINGLE_SEED, single_seed

    out, docs = tmp_path / "out", tmp_path / "docs"
    mk = lambda text, verdict: Claim(text=text, measured="1", verdict=verdict)  # noqa: E731
    _write(out / "e", single_seed([mk("c1", HOLDS), mk("c2", NOT_HOLD)], 1), quick=True)
    _write(docs / "e", [mk("c1", HOLDS), mk("c2", HOLDS)])
    text = scoreboard_markdown(["e"], out, quick=True, docs_dir=docs)
    assert "on 1 of the 2 claims both judged" in text
    assert f"2 of the 2 were judged on one seed in this run (marked \"{SINGLE_SEED}\")" in text
    _write(out / "e", [mk("c1", HOLDS), mk("c2", NOT_HOLD)], quick=True)  # a run with a spread: no such sentence
    assert "judged on one seed" not in scoreboard_markdown(["e"], out, quick=True, docs_dir=docs)
