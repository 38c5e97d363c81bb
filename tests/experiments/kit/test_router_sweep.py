"""kit.router_sweep: records read back under their settings, a run recorded twice refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from routelab.experiments.kit.router_sweep import invocations_markdown, recorded_runs, train_router_seeds
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


def _sweep(tmp_path, train):
    return train_router_seeds("t", tmp_path, key="k", routers=["a", "b"], seeds=[0, 1], threads=1,
                              load_data=lambda: None, train=train, summary=lambda r: "ok", progress=False)


def test_an_interrupted_invocation_is_recorded_and_the_resuming_one_too(tmp_path):
    """The report's provenance names every invocation that trained runs, also one stopped midway."""
    calls = []

    def interrupted(router, seed, data, say):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append((router, seed))
        return {"router": router, "seed": seed, "loss": 1.0}

    with pytest.raises(KeyboardInterrupt):
        _sweep(tmp_path, interrupted)
    first = [json.loads(line) for line in (tmp_path / "invocations.jsonl").read_text().splitlines()]
    assert len(first) == 1 and first[0]["trained"] == 2 and first[0]["interrupted"] is True

    resumed = _sweep(tmp_path, lambda router, seed, data, say: {"router": router, "seed": seed, "loss": 2.0})
    assert resumed.resumed == 2
    runs = recorded_runs(tmp_path, key="k", routers=["a", "b"], seeds=[0, 1])
    assert runs.total == 4 and [i["trained"] for i in runs.invocations] == [2, 2]
    assert "interrupted" not in runs.invocations[1]
    line = invocations_markdown(runs.invocations)[0]
    assert line.count("2 runs in") == 2 and line.count("(interrupted)") == 1


def test_an_invocation_that_trains_nothing_is_not_recorded(tmp_path):
    _sweep(tmp_path, lambda router, seed, data, say: {"router": router, "seed": seed, "loss": 1.0})
    _sweep(tmp_path, lambda router, seed, data, say: {"router": router, "seed": seed, "loss": 1.0})
    assert len((tmp_path / "invocations.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("routers, seeds, name", [(["a", "a"], [0], "routers"), (["a"], [0, 1, 0], "seeds")])
def test_a_repeated_router_or_seed_is_refused_before_training(tmp_path, routers, seeds, name):
    """A review: ``--seeds 0 0`` trained (a, 0) twice and left a directory that every later invocation
    refused as "two invocations wrote into one directory?"."""
    trained = []

    def train(router, seed, data, say):
        trained.append((router, seed))
        return {"router": router, "seed": seed, "loss": 1.0}

    with pytest.raises(ValueError, match=f"{name} names .* more than once"):
        train_router_seeds("t", tmp_path, key="k", routers=routers, seeds=seeds, threads=1, load_data=lambda: None,
                           train=train, summary=lambda r: "ok", progress=False)
    assert trained == [] and not (tmp_path / "runs.jsonl").exists()


def test_the_sweeps_settings_refuse_repeats_naming_them():
    from routelab.experiments.lm_routers import QUICK as LM
    from routelab.experiments.mae_translation import QUICK as MT
    from routelab.experiments.mae_translation import check_settings_can_run
    from routelab.experiments.moe_routers import QUICK as MOE

    for settings in (LM, MOE):
        with pytest.raises(ValueError, match="seeds names 0 more than once"):
            dataclasses.replace(settings, seeds=(0, 0)).validate()
        with pytest.raises(ValueError, match="routers names"):
            dataclasses.replace(settings, routers=settings.routers[:1] * 2).validate()
    with pytest.raises(ValueError, match="Settings.seeds names 0"):
        check_settings_can_run(dataclasses.replace(MT, seeds=(0, 0)))


def test_a_settings_key_holding_a_tuple_is_reported_and_not_retrained(tmp_path):
    """A review: a key with a tuple was stored as a JSON list; the resume check froze both sides (done), the
    report compared the raw key (``[200, 8] != (200, 8)``), so 3 trained runs were never reported."""
    trained = []

    def train(router, seed, data, say):
        trained.append((router, seed))
        return {"router": router, "seed": seed, "acc": 0.5}

    key = {"epochs": 1, "eval_batches": (200, 8)}
    for _ in range(2):
        train_router_seeds("t", tmp_path, key=key, routers=["a", "b", "c"], seeds=[0], threads=1,
                           load_data=lambda: None, train=train, summary=lambda r: "ok", progress=False)
    assert len(trained) == 3  # the second invocation resumed all three
    runs = recorded_runs(tmp_path, key=key, routers=["a", "b", "c"], seeds=[0])
    assert runs.total == 3 and len(runs.invocations) == 1
    # the list form of the same key reads the same runs
    assert recorded_runs(tmp_path, key={"epochs": 1, "eval_batches": [200, 8]}, routers=["a", "b", "c"],
                         seeds=[0]).total == 3
    with pytest.raises(TypeError, match="key must be JSON-serialisable"):
        recorded_runs(tmp_path, key={"epochs": object()}, routers=["a"], seeds=[0])


def _fingerprinted(tmp_path, fingerprint, routers=("a", "b")):
    return train_router_seeds("t", tmp_path, key="k", routers=list(routers), seeds=[0], threads=1,
                              load_data=lambda: fingerprint, train=lambda r, s, d, say: {"router": r, "seed": s},
                              summary=lambda r: "ok", progress=False, fingerprint=lambda data: data)


def test_runs_name_their_data_and_resuming_on_other_data_is_refused(tmp_path):
    """A review: resuming lm-routers after the corpus changed reused the old runs and trained the rest on
    the new text, one report over both. Every record now names its data; another fingerprint is refused."""
    _fingerprinted(tmp_path, "text-1", routers=["a"])
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["data"] for r in runs] == ["text-1"]
    with pytest.raises(ResultsFileError, match=r"trained on other data \(text-1 \(1 runs\)\).*text-2"):
        _fingerprinted(tmp_path, "text-2")
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 1  # nothing trained on the new text
    _fingerprinted(tmp_path, "text-1")  # the same text resumes
    assert recorded_runs(tmp_path, key="k", routers=["a", "b"], seeds=[0]).total == 2


def test_unstamped_runs_are_resumed_with_a_warning_and_mixed_data_is_never_reported(tmp_path):
    _write(tmp_path / "runs.jsonl", [{"router": "a", "seed": 0, "settings": "k"}])  # written before stamping
    with pytest.warns(RuntimeWarning, match="1 recorded run.* carry no data fingerprint"):
        _fingerprinted(tmp_path, "text-1")
    _write(tmp_path / "runs.jsonl", [{"router": "a", "seed": 0, "settings": "k", "data": "text-1"},
                                     {"router": "b", "seed": 0, "settings": "k", "data": "text-2"}])
    with pytest.raises(ResultsFileError, match="2 different data"):
        recorded_runs(tmp_path, key="k", routers=["a", "b"], seeds=[0])


def test_data_label_counts_runs_per_fingerprint():
    from routelab.experiments.kit.data_stamp import data_label

    assert data_label([{"data": "x"}, {"data": "x"}, {}]) == "data x (2 runs), data fingerprint not recorded (1 run)"
    assert data_label([]) == "no runs recorded"
