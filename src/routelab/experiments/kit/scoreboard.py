"""The scoreboard that opens the combined report of ``routelab reproduce``: every claim of every
experiment on one screen, with this run's verdict beside the committed full run's.

Both come from the ``claims.json`` files the experiments' report steps write
(:func:`~.claims.write_claims_json`): this run's from ``DIR/<experiment>/claims.json``, the committed
full run's from ``docs/<experiment>/claims.json`` of the source checkout routelab runs from
(:func:`committed_dir`). A claim is paired across the two by :attr:`~.claims.Claim.key`; a claim
found on one side only, an experiment that did not run, and a missing committed run are rows with
"—" and the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .claims import CLAIMS_FILE, NOT_MEASURED, SINGLE_SEED, Claim, ClaimsFile, read_claims_json
from .tables import md_cell, md_table

__all__ = ["ScoreRow", "agreement", "committed_dir", "scoreboard_markdown", "scoreboard_rows"]

DASH = "—"
CLAIM_CHARS = 72
"""The longest claim text shown in the scoreboard (longer ones are cut at a word, with "…")."""
VERDICT_CHARS = 48
"""The longest verdict shown in the scoreboard (its qualifier cut like a claim's text)."""


def committed_dir() -> Path | None:
    """``docs/`` of the source checkout this routelab runs from (``src/routelab/...`` -> ``<root>/docs``),
    or ``None`` when there is none (routelab installed from a wheel: the committed runs are not shipped)."""
    root = Path(__file__).resolve().parents[4]
    docs = root / "docs"
    return docs if (root / "pyproject.toml").is_file() and docs.is_dir() else None


@dataclass(frozen=True)
class ScoreRow:
    """One scoreboard row.

    Attributes:
        experiment: the experiment's name.
        paper: the paper the claim is from.
        claim: the claim's text (full; :func:`scoreboard_markdown` shortens it).
        run_verdict: this run's verdict, or "— (why)".
        full_verdict: the committed full run's verdict, or "— (why)".
        link: the detailed report, relative to the combined report's directory ("" when none).
    """

    experiment: str
    paper: str
    claim: str
    run_verdict: str
    full_verdict: str
    link: str


def _load(path: Path) -> tuple[ClaimsFile | None, str]:
    """``(file, "")``, or ``(None, why not)``."""
    if not path.is_file():
        return None, "no claims.json"
    try:
        return read_claims_json(path), ""
    except (OSError, ValueError) as err:
        return None, f"unreadable claims.json: {' '.join(str(err).split())[:160]}"


def scoreboard_rows(names: Sequence[str], out_dir: Path, *, docs_dir: Path | None,
                    not_run: Mapping[str, str] | None = None) -> list[ScoreRow]:
    """The rows of the scoreboard of experiments ``names`` run into ``out_dir``.

    Args:
        names: the experiments, in the order shown.
        out_dir: the ``--out`` directory of this run (``out_dir/<name>/claims.json``).
        docs_dir: the committed full runs (``docs_dir/<name>/claims.json``); ``None`` when there are none.
        not_run: experiments that did not run in this invocation, with why (their ``claims.json`` in
            ``out_dir``, if any, is not this run's and is not read).
    """
    not_run = dict(not_run or {})
    rows: list[ScoreRow] = []
    for name in names:
        if name in not_run:
            run, run_why = None, f"not run: {not_run[name]}"
        else:
            run, run_why = _load(out_dir / name / CLAIMS_FILE)
            if run is None:
                run_why = "its report wrote no claims.json" if run_why == "no claims.json" else run_why
        if docs_dir is None:
            full, full_why = None, "no committed runs here (docs/ of a source checkout not found)"
        else:
            full, full_why = _load(docs_dir / name / CLAIMS_FILE)
            if full is None:
                full_why = (f"no committed full run (docs/{name}/{CLAIMS_FILE} not found)"
                            if full_why == "no claims.json" else full_why)
        report = out_dir / name / (run.report if run else "report.md")
        link = f"{name}/{run.report if run else 'report.md'}" if name not in not_run and report.is_file() else ""
        paper = (run.paper if run else "") or (full.paper if full else "")
        run_claims: list[Claim] = list(run.claims) if run else []
        full_claims: dict[str, Claim] = {c.key: c for c in full.claims} if full else {}
        if not run_claims and not full_claims:
            rows.append(ScoreRow(name, paper, DASH, f"{DASH} ({run_why or 'no claims'})",
                                 f"{DASH} ({full_why or 'no claims'})", link))
            continue
        for c in run_claims:
            f = full_claims.pop(c.key, None)
            fv = f.verdict if f else f"{DASH} ({full_why or 'not in the committed full run'})"
            rows.append(ScoreRow(name, paper, c.text, c.verdict, fv, link))
        for f in full_claims.values():
            rv = f"{DASH} ({run_why or 'not in this run'})"
            rows.append(ScoreRow(name, paper, f.text, rv, f.verdict, link))
    return rows


def _outcome(verdict: str) -> str | None:
    """A verdict's outcome (its qualifier dropped), or ``None`` when it judges nothing ("—", not measured)."""
    outcome = verdict.split(" (")[0].strip()
    return None if outcome.startswith(DASH) or outcome == NOT_MEASURED else outcome


def agreement(rows: Sequence[ScoreRow]) -> dict[str, tuple[int, int]]:
    """Per experiment (in row order): ``(same, both)``, the claims that this run and the committed full
    run both judged (a verdict other than "—" or not measured), and how many of them have the same
    outcome (``"partly (within the 95 % t interval)"`` and ``"partly"`` are the same)."""
    counts: dict[str, tuple[int, int]] = {}
    for r in rows:
        same, both = counts.get(r.experiment, (0, 0))
        a, b = _outcome(r.run_verdict), _outcome(r.full_verdict)
        if a is not None and b is not None:
            same, both = same + (a == b), both + 1
        counts[r.experiment] = (same, both)
    return counts


def _short(text: str, limit: int = CLAIM_CHARS) -> str:
    """``text`` on one line, cut at a word to at most ``limit`` characters (with "…")."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line
    cut = line[: limit - 1].rsplit(" ", 1)[0]
    return cut + "…"


def _cell(text: str) -> str:
    """A markdown table cell: one line, ``|`` escaped (:func:`.tables.md_cell`)."""
    return md_cell(text)


def _verdict(text: str) -> str:
    """A verdict cell: the verdict, its qualifier (or a "—" reason) cut to :data:`VERDICT_CHARS`."""
    return _cell(_short(text, VERDICT_CHARS))


def scoreboard_markdown(names: Sequence[str], out_dir: Path, *, quick: bool, docs_dir: Path | None,
                        not_run: Mapping[str, str] | None = None) -> str:
    """The scoreboard section (a ``## Scoreboard`` heading, one line on how to read it, the table):
    columns paper, claim (short), this run's verdict (headed *quick verdict* when ``quick``), the committed
    full run's verdict, and the detailed report (a link named by the experiment). Arguments as
    :func:`scoreboard_rows`."""
    rows = scoreboard_rows(names, out_dir, docs_dir=docs_dir, not_run=not_run)
    run_col = "quick verdict (this run, --quick)" if quick else "verdict (this run, full)"
    table = md_table(
        ["paper", "claim (short)", run_col, "committed full run (docs/)", "details"],
        [[_cell(r.paper) or DASH, _cell(_short(r.claim)), _verdict(r.run_verdict), _verdict(r.full_verdict),
          f"[{r.experiment}]({r.link})" if r.link else r.experiment] for r in rows])
    note = ("Quick verdicts come from the quick form (fewer runs, shorter training) and can differ from the full "
            "run's; the committed full run's verdicts are read from docs/<experiment>/claims.json. "
            if quick else
            "This run's verdicts beside the committed full run's (docs/<experiment>/claims.json). ")
    counts = agreement(rows)
    same, both = (sum(v[i] for v in counts.values()) for i in (0, 1))
    one_seed = sum(1 for r in rows if SINGLE_SEED in r.run_verdict and _outcome(r.run_verdict) is not None
                   and _outcome(r.full_verdict) is not None)
    agree = (f"**Same outcome as the committed full run on {same} of the {both} claims both judged** ("
             + ", ".join(f"{name} {a}/{b}" for name, (a, b) in counts.items()) + "); a claim one side does not "
             "judge (\"—\", not measured) is not counted."
             + (f" {one_seed} of the {both} were judged on one seed in this run (marked \"{SINGLE_SEED}\"): the "
                "sign of one comparison, not a test against a seed spread." if one_seed else "")) if both else ""
    return "\n".join(["## Scoreboard", "", note + f"{len(rows)} claims; each experiment's details below, and "
                      "each verdict's criterion and evidence in its report's Claims section.", "", agree, "",
                      table, ""])
