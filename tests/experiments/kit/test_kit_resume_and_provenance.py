"""Resume and provenance of the kit's router sweep, and the ``--jobs`` limit of ``run_side_by_side``.

Written against mutants that survived the kit's own tests (review s42_mut_kit: SO6, RS5, RS7, RS9, RS11, PV5,
PV6, JB1). The oracle in each test is counted by hand, never recomputed by the code under test:

* which runs the ``train`` callback was called for (a list the fake ``train`` appends to);
* the commits a fake ``git_commit`` returned, and when;
* the worker processes' own clock readings at launch and at the end of each call.

``git_commit`` is replaced by a constant in every sweep here, so the tests do not depend on the checkout they
run in (or on git being installed).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from routelab.experiments.kit import provenance
from routelab.experiments.kit.jobs import run_side_by_side
from routelab.experiments.kit.provenance import COMMIT, CommitStamp
from routelab.experiments.kit.router_sweep import missing_runs_markdown, recorded_runs, train_router_seeds
from routelab.experiments.kit.store import append_jsonl_atomic, missing_keys

#: A settings key whose insertion order is not its sorted order, like the dict that moe-routers' and
#: lm-routers' settings keys are (fields in declaration order).
UNSORTED_KEY = {"epochs": 1, "batch_size": 8}


@pytest.fixture(autouse=True)
def fixed_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every invocation runs at one known commit, whatever checkout the tests run from."""
    monkeypatch.setattr(provenance, "git_commit", lambda: "c0ffee0")


class Trainer:
    """A fake ``train`` callback that records which ``(router, seed)`` runs it was asked to train."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, router: str, seed: int, data: Any, say: Any) -> dict[str, Any]:
        self.calls.append((router, seed))
        return {"router": router, "seed": seed, "acc": 0.5}


def _sweep(out_dir: Path, train: Any, *, key: Any = "k", routers=("a", "b"), seeds=(0,), data: Any = None,
           fingerprint: Any = None):
    return train_router_seeds("t", out_dir, key=key, routers=list(routers), seeds=list(seeds), threads=1,
                              load_data=lambda: data, train=train, summary=lambda r: "ok", progress=False,
                              fingerprint=fingerprint)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------ SO6: dict keys compare as dicts


def test_a_dict_key_is_found_whatever_the_order_of_its_items(tmp_path: Path) -> None:
    """store: "JSON lists in keys become tuples" and dicts are compared as their sorted items (``_freeze``).

    ``append_jsonl_atomic`` writes with ``sort_keys=True``, so the record reads back as
    ``{"batch_size": 8, "epochs": 1}``; a key given as ``{"epochs": 1, "batch_size": 8}`` is the same JSON
    object (JSON objects are unordered) and the run is done: nothing is missing.
    """
    path = tmp_path / "runs.jsonl"
    append_jsonl_atomic(path, {"seed": 0, "settings": dict(UNSORTED_KEY)})
    assert list(json.loads(path.read_text())["settings"]) == ["batch_size", "epochs"]  # stored sorted
    assert missing_keys([(0, dict(UNSORTED_KEY)), (1, dict(UNSORTED_KEY))], path, ("seed", "settings")) == [
        (1, UNSORTED_KEY)]


def test_a_second_invocation_with_an_unsorted_dict_key_trains_nothing(tmp_path: Path) -> None:
    """router_sweep: "a rerun resumes after the last finished run". The plan is 2 routers x 2 seeds = 4 runs;
    the first invocation trains all 4, the second (same settings) none of them, and the directory then holds
    each run once (a run recorded twice would be refused by ``recorded_runs``)."""
    first, second = Trainer(), Trainer()
    assert _sweep(tmp_path, first, key=UNSORTED_KEY, seeds=(0, 1)).resumed == 0
    assert _sweep(tmp_path, second, key=UNSORTED_KEY, seeds=(0, 1)).resumed == 4
    assert len(first.calls) == 4 and second.calls == []
    runs = recorded_runs(tmp_path, key={"batch_size": 8, "epochs": 1}, routers=["a", "b"], seeds=[0, 1])
    assert runs.total == 4 and len(_lines(tmp_path / "runs.jsonl")) == 4


# ------------------------------------------------------------------------ RS7: SweepResult.resumed


def test_resumed_counts_the_planned_runs_that_were_already_recorded(tmp_path: Path) -> None:
    """``SweepResult.resumed``: "how many planned runs were already recorded (so not trained again)", i.e. the
    plan's size minus the ``train`` calls. Expected values, by hand:

    * 2 routers x seed [0] into an empty directory: 2 planned, 2 trained, 0 recorded before;
    * the same routers x seeds [0, 1, 2]: 6 planned, the 2 of seed 0 recorded, 4 trained;
    * the same again: 6 planned, all 6 recorded, none trained.
    """
    for seeds, trained, resumed in (((0,), 2, 0), ((0, 1, 2), 4, 2), ((0, 1, 2), 0, 6)):
        train = Trainer()
        result = _sweep(tmp_path, train, seeds=seeds)
        assert (len(train.calls), result.resumed) == (trained, resumed), \
            f"seeds {seeds}: expected {trained} trained and {resumed} resumed"
    assert len(_lines(tmp_path / "runs.jsonl")) == 6


# ------------------------------------------------------------------------ RS5 / RS11: settings stay apart


def test_the_report_lists_only_the_invocations_of_its_own_settings(tmp_path: Path) -> None:
    """``RecordedRuns.invocations``: "the invocations.jsonl records of the invocations that trained these
    settings". A quick run (key "quick", 1 run) and a full run (key "full", 2 runs) into one directory: the
    full report's provenance must name the full invocation only (``store.settings_key``: "a quick run and a
    full run into one directory stay apart")."""
    _sweep(tmp_path, Trainer(), key="quick", routers=("a",))
    _sweep(tmp_path, Trainer(), key="full", routers=("a", "b"))
    assert len(_lines(tmp_path / "invocations.jsonl")) == 2
    full = recorded_runs(tmp_path, key="full", routers=["a", "b"], seeds=[0])
    assert [(i["settings"], i["trained"]) for i in full.invocations] == [("full", 2)]
    quick = recorded_runs(tmp_path, key="quick", routers=["a"], seeds=[0])
    assert [(i["settings"], i["trained"]) for i in quick.invocations] == [("quick", 1)]


def test_extending_a_run_is_not_refused_for_the_data_of_other_settings(tmp_path: Path) -> None:
    """``fingerprint``: "the recorded runs being resumed must carry the same" fingerprint, and the runs being
    resumed are those "under the same settings key". A quick run on text-1 shares the directory with a full
    run on text-2; extending the full run to seeds [0, 1] on text-2 resumes only the full run's seed 0, so it
    must train exactly (a, 1) and not be refused because of the quick run's text-1 record."""
    _sweep(tmp_path, Trainer(), key="quick", routers=("a",), data="text-1", fingerprint=lambda d: d)
    _sweep(tmp_path, Trainer(), key="full", routers=("a",), data="text-2", fingerprint=lambda d: d)
    extend = Trainer()
    _sweep(tmp_path, extend, key="full", routers=("a",), seeds=(0, 1), data="text-2", fingerprint=lambda d: d)
    assert extend.calls == [("a", 1)]
    full = recorded_runs(tmp_path, key="full", routers=["a"], seeds=[0, 1])
    assert full.total == 2 and {r["data"] for r in full.ok} == {"text-2"}


def test_extending_a_run_does_not_warn_about_the_commit_of_other_settings(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit warning is about "recorded runs it resumes" (``warn_other_commits``), i.e. runs of the same
    settings key. The quick run was trained at commit aaaaaaa, the full run at bbbbbbb; extending the full
    run at bbbbbbb resumes only bbbbbbb runs, so no RuntimeWarning may name aaaaaaa."""
    monkeypatch.setattr(provenance, "git_commit", lambda: "aaaaaaa")
    _sweep(tmp_path, Trainer(), key="quick", routers=("a",))
    monkeypatch.setattr(provenance, "git_commit", lambda: "bbbbbbb")
    _sweep(tmp_path, Trainer(), key="full", routers=("a",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _sweep(tmp_path, Trainer(), key="full", routers=("a",), seeds=(0, 1))
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []


# ------------------------------------------------------------------------ RS9: missing_runs_markdown


def _named_runs(lines: list[str]) -> set[str]:
    """The runs a ``missing_runs_markdown`` section names: its last line, after the colon, split at commas."""
    return {part.strip() for part in lines[-1].split(": ", 1)[1].rstrip(".").split(",")}


def test_the_runs_not_yet_run_are_the_planned_ones_without_a_record() -> None:
    """``missing_runs_markdown``: "Report lines naming the planned (router, seed) runs without a record (none:
    no lines)". Plan a, b x 0, 1; recorded a0, b0, a1 (and c0, not planned): only "b seed 1" is missing."""
    records = [{"router": "a", "seed": 0}, {"router": "b", "seed": 0}, {"router": "a", "seed": 1},
               {"router": "c", "seed": 0}]
    lines = missing_runs_markdown(["a", "b"], [0, 1], records)
    assert _named_runs(lines) == {"b seed 1"}
    assert any(line.startswith("## ") for line in lines)  # a section of its own
    assert _named_runs(missing_runs_markdown(["a", "b"], [0, 1], [])) == {
        "a seed 0", "b seed 0", "a seed 1", "b seed 1"}
    assert missing_runs_markdown(["a", "b"], [0, 1], records[:3] + [{"router": "b", "seed": 1}]) == []


# ------------------------------------------------------------------------ PV6 / PV5: CommitStamp


def test_every_record_carries_the_commit_read_when_the_invocation_started(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """provenance: the commit of a record is ``git_commit()`` "read once when the invocation starts" (the code
    that trains is the code imported then). HEAD moves from aaaaaaa to bbbbbbb while the first run trains;
    both runs and the invocation must still say aaaaaaa."""
    head = ["aaaaaaa"]
    monkeypatch.setattr(provenance, "git_commit", lambda: head[0])

    def train(router: str, seed: int, data: Any, say: Any) -> dict[str, Any]:
        head[0] = "bbbbbbb"  # someone commits in the checkout during the sweep
        return {"router": router, "seed": seed}

    _sweep(tmp_path, train)
    assert [r[COMMIT] for r in _lines(tmp_path / "runs.jsonl")] == ["aaaaaaa", "aaaaaaa"]
    assert [i[COMMIT] for i in _lines(tmp_path / "invocations.jsonl")] == ["aaaaaaa"]


def test_each_other_commit_is_warned_about_once_per_invocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CommitStamp.before_training``: "each other code version once per invocation". dselect-synthetic calls
    it once per run it trains: four calls next to the same aaaaaaa runs give one warning; a fifth call whose
    recorded runs add ccccccc warns once more, naming ccccccc and not aaaaaaa again. Counted under the
    "always" filter, so Python's own deduplication of identical warnings cannot hide a repeat."""
    monkeypatch.setattr(provenance, "git_commit", lambda: "bbbbbbb")
    stamp = CommitStamp("exp")
    recorded = [{COMMIT: "aaaaaaa"}] * 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            stamp.before_training(recorded)
        stamp.before_training(recorded + [{COMMIT: "ccccccc"}])
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2
    assert "commit aaaaaaa (3 runs)" in messages[0]
    assert "commit ccccccc (1 run)" in messages[1] and "aaaaaaa" not in messages[1]


# ------------------------------------------------------------------------ JB1: at most `jobs` workers at once


def _timed_call(index: int) -> tuple[int, float, float]:
    """A worker's call: its index and its own ``time.monotonic()`` at the start and at the end.

    ``time.monotonic()`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every process, so the readings of the
    parent and of the workers compare."""
    start = time.monotonic()
    time.sleep(0.1)
    return index, start, time.monotonic()


def test_jobs_1_never_has_two_workers_running_at_once() -> None:
    """``run_side_by_side``: "at most ``jobs`` at a time". A call's interval runs from the moment its worker
    is launched (``on_start``, called in the parent just before the process starts) to the end its worker
    recorded. With ``jobs=1`` the two intervals must not overlap: the second worker is launched only after
    the first call ended. Only the order of the recorded instants is asserted, no duration, so a slow
    machine cannot make it fail. (Two calls: each spawned worker imports torch, seconds on a loaded box.)"""
    launched: dict[int, float] = {}
    out = run_side_by_side([(f"c{i}", _timed_call, (i,)) for i in range(2)], jobs=1,
                           on_start=lambda i: launched.__setitem__(i, time.monotonic()))
    assert [index for index, _, _ in out] == [0, 1]
    intervals = [(launched[index], end) for index, _, end in out]
    for (launch, end), (_, start, _) in zip(intervals, out):
        assert launch <= start <= end  # the worker's own start lies inside its interval
    (_, first_end), (second_launch, _) = intervals
    assert first_end <= second_launch, f"two workers at once with jobs=1: {intervals}"
