"""The failed-runs section of a report: how many runs diverged, which, and why.

Reports compute their statistics on the finished runs (:func:`routelab.experiments.kit.store.split_failed`)
and add this section, so that a failed run is never silently missing from an average.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .store import atomic_write_text

__all__ = ["add_failures_to_report", "failures_markdown", "with_failures_section"]


def failures_markdown(failed: Sequence[Mapping[str, Any]], total: int, fields: Sequence[str],
                      *, heading: str = "## Failed runs", limit: int = 30) -> str:
    """A report section on the failed runs: how many, which, and why ("" when none failed).

    Args:
        failed: the failed records.
        total: the number of runs recorded (finished + failed), for "F of N".
        fields: the key fields that name a run (e.g. ``("gate", "lr", "seed")``).
        heading: the section heading.
        limit: list at most this many runs one by one (the reasons are always counted).
    """
    if not failed:
        return ""
    lines = [heading, "",
             f"**{len(failed)} of {total} runs failed** (their loss or parameters became non-finite). "
             "They are left out of every average, median and figure; where a table counts successes per "
             "seed, a failed run counts as a seed without success and is marked *failed*. A rerun does not "
             "retry them (training is deterministic); delete their lines from the results file, or rerun "
             "with `--fresh`, to retry them.", ""]
    kinds = Counter(str(r.get("reason", "")).split(":", 1)[-1].strip().split(" (then:")[0] for r in failed)
    if len(kinds) > 1:
        lines += ["Reasons (without the step):", ""]
        lines += [f"- {n} x {k}" for k, n in kinds.most_common()]
        lines.append("")
    for r in list(failed)[:limit]:
        name = ", ".join(f"{f}={r.get(f)}" for f in fields)
        lines.append(f"- {name}: {r.get('reason', 'no reason recorded')}")
    if len(failed) > limit:
        lines.append(f"- ... and {len(failed) - limit} more (see the results file).")
    lines.append("")
    return "\n".join(lines)


def with_failures_section(text: str, failed: Sequence[Mapping[str, Any]], total: int,
                          fields: Sequence[str]) -> str:
    """``text`` (a report) with :func:`failures_markdown` inserted before its first ``## `` section
    (appended when it has none); ``text`` unchanged when nothing failed."""
    section = failures_markdown(failed, total, fields)
    if not section:
        return text
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    return "\n".join(lines[:at] + section.split("\n") + lines[at:])


def add_failures_to_report(report: Path, failed: Sequence[Mapping[str, Any]], total: int,
                           fields: Sequence[str]) -> Path:
    """Rewrite the report file ``report`` with the failed-runs section (see :func:`with_failures_section`)."""
    if failed:
        atomic_write_text(report, with_failures_section(report.read_text(encoding="utf-8"), failed, total, fields))
    return report
