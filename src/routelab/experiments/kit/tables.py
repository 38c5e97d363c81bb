"""Tables of results: markdown tables for the reports and the cells of ``results.csv``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["csv_cell", "md_cell", "md_table", "md_uncell"]


def md_cell(value: Any) -> str:
    """``str(value)`` as one markdown table cell: on one line, ``|`` escaped as ``\\|`` (an unescaped
    ``|`` ends the cell, even inside bold or a code span: a verdict such as ``|mean difference| ...``
    was cut at its first ``|``)."""
    return " ".join(str(value).split()).replace("\\|", "|").replace("|", "\\|")


def md_uncell(cell: str) -> str:
    """The text of a cell :func:`md_cell` wrote (``\\|`` back to ``|``)."""
    return cell.replace("\\|", "|")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table: a header row, the separator row, one row per item of ``rows``.

    Args:
        headers: the column headers.
        rows: the cells of each row (each printed by :func:`md_cell`: ``str()``, one line, ``|``
            escaped).
        align: the separator row without its leading ``|`` (e.g. ``"---|---:|"`` to right-align
            the second column); default ``---`` for every column.
    """
    lines = ["| " + " | ".join(md_cell(h) for h in headers) + " |", "|" + (align or "---|" * len(headers))]
    lines += ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def csv_cell(value: Any) -> str:
    """One results.csv cell: empty for ``None``, 6 significant digits for floats, else ``str``."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
