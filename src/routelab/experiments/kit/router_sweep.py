"""The (router, seed) training loop shared by the experiments that compare routers run by run.

:func:`train_router_seeds` trains every ``(router, seed)`` run of a sweep that ``runs.jsonl`` does
not hold yet under the same settings key, one after the other, appending each finished run's record
atomically (a rerun resumes after the last finished run), recording a diverged run as failed
(:func:`.divergence.train_or_fail`) and each invocation that trained something in
``invocations.jsonl`` (start time, wall time, machine load). Every record holds the commit of the code
that trained it (:data:`.provenance.COMMIT`); resuming runs recorded at another commit warns
(:class:`.provenance.CommitStamp`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from .data_stamp import DataStamp, check_one_data
from .divergence import train_or_fail
from .provenance import COMMIT, CommitStamp, commit_label, load_average
from .store import ResultsFileError, append_jsonl_atomic, is_failed, missing_keys, read_jsonl, split_failed

__all__ = ["RecordedRuns", "SweepResult", "check_distinct", "figures_markdown", "invocations_markdown",
           "missing_runs_markdown", "recorded_runs", "train_router_seeds"]

#: ``train(router, seed, data, say)``: one run's record; ``say(msg)`` prints a progress line.
TrainRun = Callable[[str, int, Any, Callable[[str], None]], dict[str, Any]]


@dataclass(frozen=True)
class SweepResult:
    """What :func:`train_router_seeds` did: the invocation's wall time and how many planned runs were
    already recorded (so not trained again)."""

    wall_s: float
    resumed: int


def check_distinct(name: str, values: Sequence[Any]) -> None:
    """A ValueError naming ``name`` when ``values`` repeats an item: a sweep trains every
    ``(router, seed)`` once, and a run recorded twice is refused as two invocations' writes."""
    seen: set[Any] = set()
    twice = [v for v in values if v in seen or seen.add(v)]
    if twice:
        raise ValueError(f"{name} names {twice[0]!r} more than once ({tuple(values)}); give each once")


def _normal_key(key: Any) -> Any:
    """``key`` as it reads back from a record (a JSON round trip: tuples become lists), so that a key is
    compared in the form it is stored in.

    Raises:
        TypeError: when ``key`` is not JSON-serialisable (naming the argument and the fix).
    """
    try:
        return json.loads(json.dumps(key))
    except (TypeError, ValueError) as err:
        raise TypeError(f"key must be JSON-serialisable (it is stored in every record), got {key!r}: {err}; "
                        "build it from numbers, strings, lists and dicts (e.g. dataclasses.asdict of the "
                        "settings).") from None


def train_router_seeds(
    name: str,
    out_dir: Path,
    *,
    key: Any,
    routers: Sequence[str],
    seeds: Sequence[int],
    threads: int,
    load_data: Callable[[], Any],
    train: TrainRun,
    summary: Callable[[dict[str, Any]], str],
    progress: bool = True,
    fingerprint: Callable[[Any], str] | None = None,
) -> SweepResult:
    """Train the ``(router, seed)`` runs missing from ``out_dir/runs.jsonl`` (seed-major order).

    Args:
        name: the experiment's name (progress lines).
        out_dir: holds ``runs.jsonl`` and ``invocations.jsonl`` (created if needed).
        key: the settings key stored with every record (JSON: a tuple is stored, and compared, as a list); a
            record with another key is not reused.
        routers, seeds: the sweep.
        threads: torch threads while training (restored afterwards).
        load_data: called once, only when something is trained; its result is passed to ``train``.
        train: trains one run and returns its record.
        summary: the progress line of a finished run, from its record.
        progress: print progress lines on stderr.
        fingerprint: the fingerprint of the loaded data (``fingerprint(load_data())``), for data built
            outside the code (:mod:`.data_stamp`): stamped on every new record, and the recorded runs being
            resumed must carry the same.

    Returns:
        :class:`SweepResult`. Every record gets ``settings`` (the key), ``threads``, ``run_s`` and ``commit``
        (:func:`.provenance.git_commit` at the start; the invocation record too).

    Raises:
        ResultsFileError: (with ``fingerprint``) the recorded runs it would resume trained on other data.

    Warns:
        RuntimeWarning: when it trains runs next to recorded ones of another commit (naming both), or (with
            ``fingerprint``) next to recorded runs that carry no data fingerprint.
    """
    key = _normal_key(key)
    stamp = CommitStamp(name)
    t_start = time.perf_counter()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_start = load_average()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_path = out_dir / "runs.jsonl"
    check_distinct("routers", routers)
    check_distinct("seeds", seeds)
    plan = [(r, s) for s in seeds for r in routers]
    pending = [(r, s) for r, s, _ in missing_keys([(r, s, key) for r, s in plan], runs_path,
                                                  ("router", "seed", "settings"))]
    resumed: list[dict[str, Any]] = []
    if pending and len(pending) < len(plan):
        planned = set(plan)
        resumed = [r for r in read_jsonl(runs_path) if (r.get("router"), r.get("seed")) in planned
                   and r.get("settings") == key]
        stamp.before_training(resumed)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    trained, finished = 0, False
    data_stamp: DataStamp | None = None
    try:
        data = load_data() if pending else None
        if pending and fingerprint is not None:
            data_stamp = DataStamp(name, fingerprint(data), runs_path)
            data_stamp.check(resumed)
        for i, (router, seed) in enumerate(pending, 1):
            t_run = time.perf_counter()

            def say(msg: str, router: str = router, seed: int = seed, i: int = i) -> None:
                if progress:
                    print(f"{name} [{i}/{len(pending)}] {router} seed {seed} "
                          f"({time.perf_counter() - t_start:.0f} s): {msg}", file=sys.stderr, flush=True)

            record = train_or_fail(lambda: train(router, seed, data, say), {"router": router, "seed": seed},
                                   on_fail=lambda why: say(f"FAILED, {why}"))
            record["settings"] = key
            stamp(record)
            if data_stamp is not None:
                data_stamp(record)
            record["threads"] = torch.get_num_threads()
            record["run_s"] = round(time.perf_counter() - t_run, 1)
            append_jsonl_atomic(runs_path, record)
            trained += 1
            if not is_failed(record):
                say(summary(record))
        finished = True
    finally:
        torch.set_num_threads(old_threads)
        # Also when interrupted (Ctrl-C, an exception):
        # the runs it did train are in runs.jsonl, and the report's provenance line must name it.
        if trained:
            invocation = {"started": started, "wall_s": round(time.perf_counter() - t_start, 1),
                          "trained": trained, "settings": key, "load_start": load_start,
                          "load_end": load_average(), "threads": threads, COMMIT: stamp.commit}
            if data_stamp is not None:
                data_stamp(invocation)
            if not finished:
                invocation["interrupted"] = True
            append_jsonl_atomic(out_dir / "invocations.jsonl", invocation)
    wall_s = time.perf_counter() - t_start
    return SweepResult(wall_s=wall_s, resumed=len(plan) - len(pending))


@dataclass(frozen=True)
class RecordedRuns:
    """What ``out_dir`` records of one sweep's settings (see :func:`recorded_runs`).

    Attributes:
        ok: the finished runs, ordered router by router, then seed by seed.
        failed: the failed (diverged) runs, in the same order.
        invocations: the ``invocations.jsonl`` records of the invocations that trained these settings.
    """

    ok: list[dict[str, Any]]
    failed: list[dict[str, Any]]
    invocations: list[dict[str, Any]]

    @property
    def total(self) -> int:
        """All recorded runs of the settings, finished or failed."""
        return len(self.ok) + len(self.failed)


def recorded_runs(out_dir: Path, *, key: Any, routers: Sequence[str], seeds: Sequence[int]) -> RecordedRuns:
    """The runs of ``routers`` x ``seeds`` recorded in ``out_dir/runs.jsonl`` under settings ``key`` (the
    ``key`` :func:`train_router_seeds` stored, compared as it reads back from JSON), and the invocations that
    trained them.

    Raises:
        ResultsFileError: a run recorded twice under these settings, or runs trained on different data
            (:mod:`.data_stamp`).
    """
    key = _normal_key(key)
    out_dir = Path(out_dir)
    order = {(r, s): i for i, (r, s) in enumerate((r, s) for r in routers for s in seeds)}
    records = [r for r in read_jsonl(out_dir / "runs.jsonl")
               if (r.get("router"), r.get("seed")) in order and r.get("settings") == key]
    seen: dict[tuple[str, int], int] = {}
    for i, r in enumerate(records):
        first = seen.setdefault((r["router"], r["seed"]), i)
        if first != i:  # counted twice, it would narrow the seed spread the claims are judged against
            raise ResultsFileError(
                f"{out_dir / 'runs.jsonl'} records router {r['router']!r} seed {r['seed']} twice under these "
                "settings (two invocations wrote into one directory?); delete one of the two lines, or rerun "
                "with `--fresh`", out_dir / "runs.jsonl")
    check_one_data(records, out_dir / "runs.jsonl")
    records.sort(key=lambda r: order[(r["router"], r["seed"])])
    ok, failed = split_failed(records)
    invocations = [i for i in read_jsonl(out_dir / "invocations.jsonl") if i.get("settings") == key]
    return RecordedRuns(ok, failed, invocations)


def invocations_markdown(invocations: Sequence[dict[str, Any]]) -> list[str]:
    """A report line listing the invocations that trained runs (``invocations.jsonl``), each with the commit
    it trained at (:func:`.provenance.commit_label`); none: no line."""
    trained = [i for i in invocations if i.get("trained")]
    if not trained:
        return []
    return ["- Invocations that trained runs: " + "; ".join(
        f"{i['started']} ({commit_label(i)}): {i['trained']} runs in {i['wall_s']:.0f} s"
        f"{' (interrupted)' if i.get('interrupted') else ''}, 1-minute load average "
        f"{i['load_start']} at start and {i['load_end']} at the end" for i in trained) + "."]


def figures_markdown(figures: Sequence[str], captions: dict[str, str]) -> list[str]:
    """Report lines: a ``## Figures`` section, each figure file with its caption (none: no lines)."""
    if not figures:
        return []
    lines = ["", "## Figures", ""]
    for f in figures:
        lines += [f"![{captions.get(f, f)}]({f})", "", f"*{captions.get(f, f)}*", ""]
    return lines


def missing_runs_markdown(routers: Sequence[str], seeds: Sequence[int], records: Sequence[dict[str, Any]]) -> list[str]:
    """Report lines naming the planned ``(router, seed)`` runs without a record (none: no lines)."""
    have = {(rec["router"], rec["seed"]) for rec in records}
    missing = [(r, s) for s in seeds for r in routers if (r, s) not in have]
    if not missing:
        return []
    return ["", "## Runs not in these results", "",
            "Not yet run (a rerun of the command trains them and keeps the recorded ones): "
            + ", ".join(f"{r} seed {s}" for r, s in missing) + "."]
