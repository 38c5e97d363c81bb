"""A paper's claims checked on routelab's measurements: the :class:`Claim` record, the verdicts,
and the claims table of a report.

Every experiment states each claim with the criterion that decides it, computes what it measured
from its run records, and prints them with :func:`claims_markdown`, so a reader sees why each
verdict was reached. Its report step also writes them machine-readable, with :func:`write_claims_json`
(``claims.json``: one object per claim), which :func:`read_claims_json` reads back; the combined report's
scoreboard (:mod:`.scoreboard`) is built from those files. :func:`claims_from_markdown` reads the claims
back from a report's claims table, for a committed report whose run records are not kept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .store import atomic_write_text
from .tables import md_table, md_uncell

__all__ = [
    "CLAIMS_FILE",
    "HOLDS",
    "INCONCLUSIVE",
    "NOT_HOLD",
    "NOT_MEASURED",
    "PARTLY",
    "Claim",
    "ClaimsFile",
    "claims_from_markdown",
    "claims_markdown",
    "count_verdicts",
    "read_claims_json",
    "single_seed",
    "verdict_of",
    "write_claims_json",
]

CLAIMS_FILE = "claims.json"
"""The name of the machine-readable claims file an experiment's report step writes next to its report."""

_FORMAT = 1
"""The version of the ``claims.json`` format (``"format"`` key)."""

# A number starts a word: not the digits of an identifier ("top2", "top1_switch") nor the "-1" of a name
# ("top-1", "MAE-7"); a sign counts where no digit precedes it ("0.0-99.9" is a range of two numbers).
# Thousands separators join: a comma followed by exactly three digits is inside a number ("60,000", "1,234.5"),
# any other comma separates two ("1, 2", "1,2", "1,2345").
_NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z_][-−])(?:(?<![\d.])[-+−])?"
                     r"(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d*)?|\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")

HOLDS, PARTLY, NOT_HOLD, NOT_MEASURED = "holds", "partly", "does not hold", "not measured"
#: A comparison whose difference lies within its seed spread: neither side shown (every experiment's word for it).
INCONCLUSIVE = "inconclusive"
"""The verdicts. A verdict may add a qualifier in parentheses, e.g. ``"partly (within the 95 % t interval)"``."""


@dataclass(frozen=True, kw_only=True)
class Claim:
    """One claim of a paper, the criterion that decides it, what was measured and the verdict
    (built with keywords only).

    Attributes:
        text: the claim, as the paper makes it (with where, when that is short).
        criterion: how the verdict follows from the measurements ("" when the report states one rule
            for all its claims).
        measured: what routelab measured, in numbers.
        verdict: :data:`HOLDS`, :data:`PARTLY`, :data:`NOT_HOLD`, :data:`NOT_MEASURED` (or another
            word, such as ``"inconclusive"``), optionally followed by a qualifier in parentheses.
        paper: the paper's side when it is not in ``text``: where it makes the claim, or the
            numbers it reports.
        id: a short identifier, stable across runs of the experiment (quick and full), by which the
            scoreboard pairs a run's claim with the committed full run's; "" (default) means
            :attr:`key`'s slug of ``text``.
    """

    text: str
    criterion: str = ""
    measured: str
    verdict: str
    paper: str = ""
    id: str = ""

    @property
    def outcome(self) -> str:
        """The verdict without its qualifier (``"partly (within the 95 % t interval)"`` -> ``"partly"``)."""
        return self.verdict.split(" (")[0]

    @property
    def key(self) -> str:
        """:attr:`id`, or when it is empty a slug of ``text`` (lower-case words joined by ``-``, at
        most 80 characters): what pairs the same claim in two runs."""
        if self.id:
            return self.id
        slug = "-".join(re.findall(r"[a-z0-9]+", self.text.lower()))
        return slug[:80].rstrip("-") or "claim"

    @property
    def numbers(self) -> list[float]:
        """The numbers in :attr:`measured`, in order (``"1.5 of 4, 40 %"`` -> ``[1.5, 4.0, 40.0]``; a thousands
        separator joins: ``"60,000 images"`` -> ``[60000.0]``)."""
        return [float(m.replace("\u2212", "-").replace(",", "")) for m in _NUMBER.findall(self.measured)]

    def to_json(self, paper_name: str = "") -> dict[str, Any]:
        """One ``claims.json`` object: ``id``, ``paper`` (``paper_name``: which paper), ``text``,
        ``verdict``, ``outcome``, ``criterion``, ``measured`` (the evidence, in words), ``numbers``
        (the evidence's numbers, :attr:`numbers`) and ``paper_says`` (:attr:`paper`)."""
        return {"id": self.key, "paper": paper_name, "text": self.text, "verdict": self.verdict,
                "outcome": self.outcome, "criterion": self.criterion, "measured": self.measured,
                "numbers": self.numbers, "paper_says": self.paper}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Claim:
        """The claim of a :meth:`to_json` object (``numbers`` and ``outcome`` are derived, not read).

        Raises:
            ValueError: when ``obj`` lacks ``text``, ``measured`` or ``verdict``, or one is not a string.
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"a claims.json claim must be a JSON object, got {type(obj).__name__}.")
        fields = {}
        for name, src, required in (("text", "text", True), ("measured", "measured", True),
                                    ("verdict", "verdict", True), ("criterion", "criterion", False),
                                    ("paper", "paper_says", False), ("id", "id", False)):
            value = obj.get(src, None if required else "")
            if not isinstance(value, str):
                raise ValueError(f"a claims.json claim needs a string {src!r}, got {value!r}; rewrite the file "
                                 "with write_claims_json (rerun the experiment's report step).")
            fields[name] = value
        return cls(**fields)


def verdict_of(parts: Sequence[bool]) -> str:
    """The verdict of a claim made of several sub-criteria: :data:`HOLDS` when all hold,
    :data:`PARTLY` when some do, :data:`NOT_HOLD` when none does."""
    if all(parts):
        return HOLDS
    if any(parts):
        return PARTLY
    return NOT_HOLD


#: The qualifier :func:`single_seed` adds to a verdict judged on one seed.
SINGLE_SEED = "1 seed: no seed spread to judge against"


def single_seed(claims: Sequence[Claim], seeds: int) -> list[Claim]:
    """``claims`` with :data:`SINGLE_SEED` added to every verdict reached on fewer than two seeds.

    A criterion "beyond the 95 % t interval of the seed-paired difference" has no standard error on one seed:
    its verdict is then the sign of one comparison, which a reader must see (a quick run's holds
    and does-not-holds are not a full run's). ``not measured`` is left as it is.
    """
    if seeds >= 2:
        return list(claims)
    out = []
    for c in claims:
        if c.outcome == NOT_MEASURED:
            out.append(c)
            continue
        head, _, rest = c.verdict.partition(" (")
        qualifier = f"({SINGLE_SEED}; {rest}" if rest else f"({SINGLE_SEED})"
        out.append(Claim(text=c.text, criterion=c.criterion, measured=c.measured, verdict=f"{head} {qualifier}",
                         paper=c.paper, id=c.id))
    return out


def count_verdicts(claims: Sequence[Claim]) -> str:
    """``"N claims checked: a hold, b hold partly, c do not hold, d not measured"`` by outcome, with
    ``", e inconclusive"`` where some are (another outcome is counted in N only)."""
    n = {v: sum(c.outcome == v for c in claims) for v in (HOLDS, PARTLY, NOT_HOLD, NOT_MEASURED, INCONCLUSIVE)}
    return (f"{len(claims)} claims checked: {n[HOLDS]} hold, {n[PARTLY]} hold partly, {n[NOT_HOLD]} do not hold, "
            f"{n[NOT_MEASURED]} not measured" + (f", {n[INCONCLUSIVE]} inconclusive" if n[INCONCLUSIVE] else ""))


def claims_markdown(claims: Sequence[Claim]) -> str:
    """The claims table of a report: number, claim, the paper's side (if any claim has one),
    criterion (if any), measured, verdict in bold."""
    paper = any(c.paper for c in claims)
    criterion = any(c.criterion for c in claims)
    headers = ["#", "claim (paper)", *(["paper"] if paper else []), *(["criterion"] if criterion else []),
               "measured", "verdict"]
    rows = [[str(i), c.text, *([c.paper] if paper else []), *([c.criterion] if criterion else []), c.measured,
             f"**{c.verdict}**"] for i, c in enumerate(claims, 1)]
    return md_table(headers, rows)


@dataclass(frozen=True, kw_only=True)
class ClaimsFile:
    """The contents of one ``claims.json``.

    Attributes:
        experiment: the experiment's registered name.
        paper: the paper (or papers) whose claims these are, short (``"Kool et al. 2021"``).
        quick: whether the run was the quick form.
        claims: the claims, in the report's order.
        report: the detailed report, relative to the file's directory.
    """

    experiment: str
    paper: str
    quick: bool
    claims: tuple[Claim, ...]
    report: str = "report.md"


def write_claims_json(out_dir: Path, claims: Sequence[Claim], *, experiment: str, paper: str, quick: bool,
                      report: str = "report.md") -> Path:
    """Write ``out_dir/claims.json``: the experiment, its paper, whether quick, and one object per claim
    (:meth:`Claim.to_json`). Atomic; returns the path.

    Raises:
        TypeError: when an item of ``claims`` is not a :class:`Claim`.
        ValueError: when two claims have the same :attr:`Claim.key` (give them distinct ``id`` values).
    """
    bad = [type(c).__name__ for c in claims if not isinstance(c, Claim)]
    if bad:
        raise TypeError(f"claims must be Claim objects (routelab.experiments.kit.claims), got {', '.join(bad)}.")
    keys = [c.key for c in claims]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"claims of {experiment} share the key(s) {dup}; give each claim a distinct id=.")
    doc = {"format": _FORMAT, "experiment": experiment, "paper": paper, "quick": bool(quick), "report": report,
           "claims": [c.to_json(paper) for c in claims]}
    return atomic_write_text(Path(out_dir) / CLAIMS_FILE, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def read_claims_json(path: Path) -> ClaimsFile:
    """Read a file written by :func:`write_claims_json`.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when it is not such a file (the message names the file and the fix).
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); rerun the experiment's report step to rewrite it.") \
            from None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not isinstance(doc.get("claims"), list) or type(fmt) is not int or fmt != _FORMAT:
        raise ValueError(f"{path} is not a claims.json of format {_FORMAT} (an object with a 'claims' list); "
                         "rerun the experiment's report step to rewrite it.")
    try:
        claims = tuple(Claim.from_json(c) for c in doc["claims"])
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return ClaimsFile(experiment=str(doc.get("experiment", "")), paper=str(doc.get("paper", "")),
                      quick=bool(doc.get("quick", False)), claims=claims, report=str(doc.get("report", "report.md")))


def _cells(line: str) -> list[str]:
    """The cells of one markdown table row (outer pipes removed, cells stripped, ``\\|`` back to ``|``).
    Cells are split at `` | ``: an escaped pipe (``\\|``) has its backslash, not a blank, before it."""
    return [md_uncell(c.strip()) for c in line.strip().removeprefix("| ").removesuffix(" |").split(" | ")]


def claims_from_markdown(markdown: str) -> list[Claim]:
    """The claims of a report, read back from the table :func:`claims_markdown` printed in it (the first
    table whose header starts ``| # | claim (paper) |``); ``[]`` when there is none.

    For a committed report whose run records are not kept, so that its ``claims.json`` is written by
    :func:`write_claims_json` like every other (the verdict loses its bold, nothing else changes).

    Raises:
        ValueError: when a row of that table does not have the header's number of cells (a ``" | "`` inside
            a cell).
    """
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| # | claim (paper) |")), None)
    if start is None:
        return []
    headers = _cells(lines[start])
    out: list[Claim] = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        if len(cells) != len(headers):
            raise ValueError(f"claims table row has {len(cells)} cells, the header {len(headers)}: {line[:200]!r}")
        row = dict(zip(headers, cells, strict=True))
        verdict = row["verdict"]
        if verdict.startswith("**") and verdict.endswith("**"):
            verdict = verdict[2:-2]
        out.append(Claim(text=row["claim (paper)"], paper=row.get("paper", ""), criterion=row.get("criterion", ""),
                         measured=row["measured"], verdict=verdict))
    return out
