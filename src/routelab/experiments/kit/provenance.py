"""What a result was measured with: routelab's version and commit, the software, the machine's load.

Every report (and the benchmarks' tables) states these facts through the functions here. The code
version of a number is the commit that *trained* it, not the one that wrote the report: every run
record carries it under :data:`COMMIT` (:func:`git_commit`, read once when the invocation starts), a
report lists the commits of its runs with :func:`software_line` (``runs=``), and a sweep resuming
runs recorded at another commit says so with :func:`warn_other_commits`.
"""

from __future__ import annotations

import platform
import re
import subprocess
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import routelab
from routelab.machine import load_average  # re-exported: reports state it too

__all__ = ["COMMIT", "NO_CHECKOUT", "NOT_RECORDED", "CommitStamp", "commit_label", "commit_of_version", "git_commit",
           "load_average", "routelab_version", "software_line", "trained_commits", "warn_other_commits"]

COMMIT = "commit"
"""The field of a run (or invocation) record that holds :func:`git_commit` at the start of the invocation
that trained it (``None`` outside a git checkout)."""

NOT_RECORDED = "commit not recorded"
"""How a report names the code version of a record without a :data:`COMMIT` field (written before
routelab recorded one)."""

NO_CHECKOUT = "no git checkout"
"""How a report names the code version of a record trained outside a git checkout (``commit: null``)."""


def git_commit() -> str | None:
    """The short commit of the routelab checkout, with ``+dirty`` when ``src/`` has changes;
    ``None`` when routelab does not run from a git checkout (or git is missing).

    The imported package must be ``<root>/src/routelab`` and ``<root>`` the top of its git work tree: an
    installed copy of routelab (say in a virtual environment inside some checkout) is no checkout's code,
    even when a git repository encloses it."""
    package = Path(routelab.__file__).resolve().parent
    root = package.parents[1]
    if package != root / "src" / "routelab":
        return None
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        if not top or Path(top).resolve() != root:
            return None
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) if commit else None


def routelab_version() -> str:
    """``"0.1.0 (commit abc1234)"``: the version, and the commit when there is one (read back by
    :func:`commit_of_version`)."""
    commit = git_commit()
    return f"{routelab.__version__} (commit {commit})" if commit else routelab.__version__


def commit_of_version(version: str) -> str | None:
    """The commit a :func:`routelab_version` string names (``"0.1.0 (commit abc1234)"`` -> ``"abc1234"``),
    ``None`` when it names none (written outside a git checkout, or not such a string)."""
    match = re.search(r"\(commit ([^()\s]+)\)", version)
    return match.group(1) if match else None


def software_line(threads: int | None = None, runs: Iterable[Mapping[str, Any]] | None = None) -> str:
    """``"routelab 0.1.0 (commit abc1234), torch 2.5.1, Python 3.11.9, x86_64"``, plus
    ``", N torch thread(s)"`` when ``threads`` is given.

    With ``runs`` (the run records a report's numbers come from), the commit part names the code that
    trained them and, apart, the one writing the report: ``"routelab 0.1.0 (code of the runs: commit abc1234
    (3 runs); report written at commit def5678), torch ..."`` (see :func:`trained_commits`)."""
    import torch

    if runs is None:
        version = routelab_version()
    else:
        now = git_commit()
        version = (f"{routelab.__version__} (code of the runs: {trained_commits(runs)}; report written "
                   f"{f'at commit {now}' if now else 'outside a git checkout'})")
    line = (f"routelab {version}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()}")
    return line if threads is None else f"{line}, {threads} torch thread(s)"


def commit_label(record: Mapping[str, Any]) -> str:
    """The code version of one run record, for a report: ``"commit abc1234"`` (``"+dirty"``: ``src/`` had
    uncommitted changes), :data:`NOT_RECORDED` (no :data:`COMMIT` field) or :data:`NO_CHECKOUT`."""
    if COMMIT not in record:
        return NOT_RECORDED
    commit = record[COMMIT]
    return f"commit {commit}" if commit else NO_CHECKOUT


def trained_commits(records: Iterable[Mapping[str, Any]]) -> str:
    """Which code trained ``records``, with how many runs each (most runs first), e.g.
    ``"commit abc1234 (3 runs)"``, ``"commit not recorded (24 runs)"`` or ``"2 code versions, so not every
    number comes from the same code: commit abc1234 (2 runs), commit def5678 (1 run)"``; ``"no runs
    recorded"`` for none."""
    counts = Counter(commit_label(r) for r in records)
    if not counts:
        return "no runs recorded"
    items = [f"{label} ({n} run{'s' if n != 1 else ''})"
             for label, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    if len(items) == 1:
        return items[0]
    return (f"{len(items)} code versions, so not every number comes from the same code: "
            + ", ".join(items))


def warn_other_commits(records: Iterable[Mapping[str, Any]], commit: str | None, where: str,
                       skip: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """A ``RuntimeWarning`` when a sweep at ``commit`` is about to add runs to ``records`` (the recorded runs
    it resumes) trained at another commit (or at an unrecorded one), naming both: the new numbers then come
    from other code than the old ones. Resuming is not refused (the commits in between may not touch what
    was measured), and the report lists every run's commit; rerunning with ``--fresh`` retrains all at one.

    Args:
        records: the recorded runs being resumed (``[]``: nothing to compare, no warning).
        commit: :func:`git_commit` now.
        where: the experiment (or results file), for the message.
        skip: code versions already warned about (by an earlier call): not named again.

    Returns:
        The code versions (:func:`commit_label`) warned about.
    """
    now = commit_label({COMMIT: commit})
    other = Counter(label for r in records if (label := commit_label(r)) != now and label not in skip)
    if other:
        was = ", ".join(f"{label} ({n} run{'s' if n != 1 else ''})" for label, n in sorted(other.items()))
        warnings.warn(f"{where}: resuming runs recorded at {was}, while this invocation trains at {now}: the "
                      "report will mix numbers from different code (it lists the commit of every run); rerun "
                      "with `--fresh` to retrain them all at this commit.", RuntimeWarning, stacklevel=2)
    return set(other)


class CommitStamp:
    """The code version of one invocation of an experiment: stamps it on every record the invocation writes,
    and warns when the invocation trains next to recorded runs of another code version.

    Usage::

        stamp = CommitStamp("mae")                 # reads git_commit() once, at the start
        ...
        stamp.before_training(recorded)            # about to train a run that is not recorded yet
        append_jsonl_atomic(path, stamp(record))   # record[COMMIT] = stamp.commit

    Attributes:
        commit: :func:`git_commit` when it was built (``None`` outside a git checkout).
        where: the experiment, for the warning.
    """

    def __init__(self, where: str) -> None:
        self.commit = git_commit()
        self.where = where
        self._warned: set[str] = set()

    def before_training(self, recorded: Iterable[Mapping[str, Any]]) -> None:
        """Warn (:func:`warn_other_commits`, each other code version once per invocation) when ``recorded``
        (the runs this invocation resumes and reports with its new ones) come from other code."""
        self._warned |= warn_other_commits(recorded, self.commit, self.where, self._warned)

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with :data:`COMMIT` set to :attr:`commit` (in place; returned for chaining)."""
        record[COMMIT] = self.commit
        return record
