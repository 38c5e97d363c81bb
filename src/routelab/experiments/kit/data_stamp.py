"""Which data a run trained on: a fingerprint on every run record, and a refusal to mix two.

An experiment that trains on data built outside routelab's code (the parallel Bible text comes from
Debian packages through a parser) can see that data change between two invocations into one results
directory: another parser version, other packages. Its recorded runs then measured something else than
the runs it would add, and a report over both would mix them silently (the code commit on every record,
:mod:`.provenance`, does not show it: the text is not in the repository). So every record carries the
fingerprint of its data under :data:`DATA`, and resuming runs of another fingerprint is an error.

Usage::

    stamp = DataStamp("mae", pairs_fingerprint(pairs), out_dir / "runs.jsonl")
    stamp.check(recorded)                      # before training next to recorded runs
    append_jsonl_atomic(path, stamp(record))   # record[DATA] = stamp.fingerprint
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .store import ResultsFileError

__all__ = ["DATA", "DataStamp", "check_one_data", "data_label"]

DATA = "data"
"""The field of a run record that holds the fingerprint of the data it trained on (absent in records written
before routelab stamped one)."""


def data_label(records: Iterable[Mapping[str, Any]]) -> str:
    """The data of ``records`` for a report: ``"data abc123 (27 runs)"``, with the unstamped ones counted
    apart (``"data fingerprint not recorded (3 runs)"``)."""
    counts = Counter(str(r[DATA]) if r.get(DATA) is not None else None for r in records)
    parts = [f"data {fp} ({n} run{'s' if n != 1 else ''})" for fp, n in sorted(
        ((fp, n) for fp, n in counts.items() if fp is not None), key=lambda kv: -kv[1])]
    if counts.get(None):
        n = counts[None]
        parts.append(f"data fingerprint not recorded ({n} run{'s' if n != 1 else ''})")
    return ", ".join(parts) if parts else "no runs recorded"


def check_one_data(records: Iterable[Mapping[str, Any]], path: Path) -> None:
    """Refuse ``records`` (the runs one report is about to be written from, read from ``path``) that were
    trained on two or more different data.

    Raises:
        ResultsFileError: naming the fingerprints and the fix.
    """
    fps = Counter(r[DATA] for r in records if r.get(DATA) is not None)
    if len(fps) > 1:
        listed = ", ".join(f"{fp} ({n} runs)" for fp, n in fps.most_common())
        raise ResultsFileError(
            f"{path} holds runs trained on {len(fps)} different data ({listed}): one report cannot compare them; "
            "rerun with `--fresh` (moves these results aside) or delete the runs of the old data", path)


class DataStamp:
    """The data of one invocation of an experiment: stamps its fingerprint on every record the invocation
    writes, and refuses to resume runs recorded on other data.

    Attributes:
        where: the experiment, for messages.
        fingerprint: the data's fingerprint (e.g. :func:`routelab.data.parallel_text.pairs_fingerprint`).
        path: the results file the runs are recorded in (named in errors).
    """

    def __init__(self, where: str, fingerprint: str, path: Path) -> None:
        self.where = where
        self.fingerprint = fingerprint
        self.path = Path(path)

    def check(self, recorded: Iterable[Mapping[str, Any]]) -> None:
        """Before training next to ``recorded`` (the runs this invocation resumes and reports with its own).

        Raises:
            ResultsFileError: some of ``recorded`` trained on other data (the message names both
                fingerprints and the fix).

        Warns:
            RuntimeWarning: some of ``recorded`` carry no fingerprint (written before routelab stamped one):
                they are reused, but whether they trained on this data cannot be checked.
        """
        recorded = list(recorded)
        other = Counter(r[DATA] for r in recorded if r.get(DATA) is not None and r[DATA] != self.fingerprint)
        if other:
            listed = ", ".join(f"{fp} ({n} runs)" for fp, n in other.most_common())
            raise ResultsFileError(
                f"{self.where}: {self.path} holds runs trained on other data ({listed}) than this invocation's "
                f"({self.fingerprint}): the text changed since (another parser or other packages), and a report "
                "over both would mix them; rerun with `--fresh` (moves these results aside) or pass another "
                "--out directory", self.path)
        unstamped = sum(1 for r in recorded if r.get(DATA) is None)
        if unstamped:
            warnings.warn(
                f"{self.where}: {unstamped} recorded run(s) in {self.path} carry no data fingerprint (recorded "
                f"before routelab stamped one): they are reused as if trained on this invocation's data "
                f"({self.fingerprint}), which cannot be checked; rerun with `--fresh` to retrain them.",
                RuntimeWarning, stacklevel=2)

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with :data:`DATA` set to :attr:`fingerprint` (in place; returned for chaining)."""
        record[DATA] = self.fingerprint
        return record
