"""A paper's claims checked on routelab's measurements: the :class:`Claim` record, the verdicts,
and the claims table of a report.

Every experiment states each claim with the criterion that decides it, computes what it measured
from its run records, and prints them with :func:`claims_markdown`, so a reader sees why each
verdict was reached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tables import md_table

__all__ = ["HOLDS", "NOT_HOLD", "NOT_MEASURED", "PARTLY", "Claim", "claims_markdown", "verdict_of"]

HOLDS, PARTLY, NOT_HOLD, NOT_MEASURED = "holds", "partly", "does not hold", "not measured"
"""The verdicts. A verdict may add a qualifier in parentheses, e.g. ``"partly (within 2 s.e.)"``."""


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
    """

    text: str
    criterion: str = ""
    measured: str
    verdict: str
    paper: str = ""

    @property
    def outcome(self) -> str:
        """The verdict without its qualifier (``"partly (within 2 s.e.)"`` -> ``"partly"``)."""
        return self.verdict.split(" (")[0]


def verdict_of(parts: Sequence[bool]) -> str:
    """The verdict of a claim made of several sub-criteria: :data:`HOLDS` when all hold,
    :data:`PARTLY` when some do, :data:`NOT_HOLD` when none does."""
    if all(parts):
        return HOLDS
    if any(parts):
        return PARTLY
    return NOT_HOLD


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
