"""kit.router_sweep: records read back under their settings, a run recorded twice refused."""

from __future__ import annotations

import json

import pytest

from routelab.experiments.kit.router_sweep import recorded_runs
from routelab.experiments.kit.store import ResultsFileError


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_records_of_the_plan_and_settings_are_read_in_plan_order(tmp_path):
    _write(tmp_path / "runs.jsonl", [
        {"router": "b", "seed": 0, "settings": "k", "loss": 2.0},
        {"router": "a", "seed": 1, "settings": "k", "loss": 1.5},
        {"router": "a", "seed": 0, "settings": "other", "loss": 9.0},  # another sweep's: not used
        {"router": "a", "seed": 0, "settings": "k", "loss": 1.0},
        {"router": "c", "seed": 0, "settings": "k", "loss": 3.0},  # not in the plan
    ])
    runs = recorded_runs(tmp_path, key="k", routers=["a", "b"], seeds=[0, 1])
    assert [(r["router"], r["seed"], r["loss"]) for r in runs.ok] == [("a", 0, 1.0), ("a", 1, 1.5), ("b", 0, 2.0)]


def test_a_run_recorded_twice_is_refused(tmp_path):
    """Two invocations into one directory (before the CLI's lock) recorded runs twice: counting both
    would narrow the seed spread that the claims are judged against."""
    record = {"router": "a", "seed": 0, "settings": "k", "loss": 1.0}
    _write(tmp_path / "runs.jsonl", [record, {**record, "loss": 1.1}])
    with pytest.raises(ResultsFileError, match="records router 'a' seed 0 twice"):
        recorded_runs(tmp_path, key="k", routers=["a"], seeds=[0])
