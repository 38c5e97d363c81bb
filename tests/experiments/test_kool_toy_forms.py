"""kool-toy: the quick form and the full run are batched differently (other chunks, other sampling noise), so
in one results directory neither resumes from nor reports the other's records (review finding B1)."""

from __future__ import annotations

import csv
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import routelab.experiments.kool_toy as kt
from routelab.experiments.kit.store import read_jsonl
from routelab.experiments.kool_toy.sweep import record_key

DOCS = Path(__file__).resolve().parents[2] / "docs" / "kool-toy"

# TINY of test_kool_toy.py without the side checks; FULL_T splits the signals as the full run, QUICK_T does not
FULL_T = kt.Settings(configs=("reinforce", "gating_sinkhorn"),
                     methods=("sample", "sample_skip_iw", "gumbel_matching_sh"),
                     taus=(0.5, 2.0), seeds=(0,), steps=3, marginal_ns=(), gradient_seeds=(), workers=1)
QUICK_T = replace(FULL_T, split_signals=False, quick=True)


def planned_keys(settings: kt.Settings) -> list[tuple]:
    """Every planned run's identity: its record key with the chunk it is trained in."""
    return [(*r.key, settings.steps, c.name) for c in kt.plan_chunks(settings) for r in c.runs]


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kt, "train_chunk", lambda *a, **k: pytest.fail("a recorded chunk was trained again"))


def _chunks_of(records: list[dict]) -> set[str]:
    return {r["chunk"] for r in records}


def _csv_chunks(out: Path) -> set[str]:
    with open(out / "results.csv", newline="") as f:
        return {row["chunk"] for row in csv.DictReader(f)}


def _cost_rows(report: str) -> set[str]:
    table = report.split("## Cost")[1].split("\n\n`sample`")[0]
    return {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}


def _invocations_line(report: str) -> set[str]:
    """The chunks named in the report's "Invocations that trained chunks" line."""
    line = report.split("Invocations that trained chunks:")[1].split("\n")[0]
    return set(line.split("`")[1::2])


def _run(out: Path, settings: kt.Settings) -> str:
    return kt.run_sweep(out, settings, progress=False, figures=False).read_text()


def test_quick_and_full_forms_in_one_directory_keep_their_own_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick_names = {c.name for c in kt.plan_chunks(QUICK_T)}
    full_names = {c.name for c in kt.plan_chunks(FULL_T)}
    assert quick_names == {"all", "all+sinkhorn"} and not quick_names & full_names
    n = len(planned_keys(FULL_T))
    assert len(planned_keys(QUICK_T)) == n

    quick_first = _run(tmp_path, QUICK_T)
    assert f"Runs recorded: {n} of {n} planned." in quick_first
    # full after quick: every full chunk is trained (before the fix: none, the quick records were taken as done)
    full = _run(tmp_path, FULL_T)
    records = read_jsonl(tmp_path / "runs.jsonl")
    assert len(records) == 2 * n
    assert _chunks_of(records[:n]) == quick_names and _chunks_of(records[n:]) == full_names
    assert f"Runs recorded: {n} of {n} planned; runs.jsonl also holds {n} records of other sweeps" in full
    assert _cost_rows(full) == full_names and "training recorded in runs.jsonl" in full
    inv = read_jsonl(tmp_path / "invocations.jsonl")
    assert [set(i["chunks"]) for i in inv] == [quick_names, full_names]
    assert _csv_chunks(tmp_path) == full_names

    # both complete now: a rerun of either form trains nothing and reports only its own runs and chunks
    _no_training(monkeypatch)
    quick = _run(tmp_path, QUICK_T)
    assert len(read_jsonl(tmp_path / "runs.jsonl")) == 2 * n and len(read_jsonl(tmp_path / "invocations.jsonl")) == 2
    assert f"Runs recorded: {n} of {n} planned; runs.jsonl also holds {n} records of other sweeps (e.g. the full run" \
        in quick
    assert _cost_rows(quick) == quick_names
    assert _invocations_line(quick) == {"all", "all+sinkhorn"} and _invocations_line(full) == full_names
    assert _csv_chunks(tmp_path) == quick_names
    # the quick form's records are its own first run's, not the full run's
    assert quick.split("## Claims")[1] == quick_first.split("## Claims")[1]
    assert _run(tmp_path, FULL_T).split("## Claims")[1] == full.split("## Claims")[1]


def test_full_run_into_a_quick_directory_trains_the_full_chunks(tmp_path: Path) -> None:
    _run(tmp_path / "a", QUICK_T)
    _run(tmp_path / "a", FULL_T)
    _run(tmp_path / "b", FULL_T)  # the full form alone
    key = lambda r: (r["config"], r["method"], r["tau"], r["seed"], r["chunk"])  # noqa: E731
    strip = lambda r: {k: v for k, v in r.items() if k != "chunk_wall_s"}  # noqa: E731
    mixed = sorted((r for r in read_jsonl(tmp_path / "a" / "runs.jsonl") if r["chunk"] not in ("all", "all+sinkhorn")),
                   key=key)
    alone = sorted(read_jsonl(tmp_path / "b" / "runs.jsonl"), key=key)
    assert [strip(r) for r in mixed] == [strip(r) for r in alone]  # the same runs as a full run on its own


def _fake_train(template: dict):
    """Stands in for train_chunk: one record per run, copied from a committed record (no training)."""
    calls: list[tuple[str, ...]] = []

    def train(runs, steps, *, chunk_seed=0, progress=None, timings=None):
        calls.append(tuple(sorted({r.config for r in runs})))
        return [{**template, "config": r.config, "method": r.method, "tau": r.tau, "seed": r.seed, "steps": steps}
                for r in runs]

    return train, calls


def test_committed_full_run_counts_as_the_full_run_and_not_as_the_quick_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/kool-toy is the full run (recorded before the chunk joined the key): all its records are the full
    plan's, none the quick form's. Before the fix a quick run into a copy of it trained nothing and reported the
    full run's records as its own (the scoreboard then compared the full run with itself)."""
    docs_records = read_jsonl(DOCS / "runs.jsonl")
    assert {record_key(r) for r in docs_records} == set(planned_keys(kt.FULL))
    assert not {record_key(r) for r in docs_records} & set(planned_keys(kt.QUICK))

    out = tmp_path / "kool-toy"
    out.mkdir()
    for name in ("runs.jsonl", "chunks.jsonl", "gradients.json", "marginals.json"):
        shutil.copy(DOCS / name, out / name)
    template = {k: v for k, v in docs_records[0].items() if k not in ("chunk", "chunk_wall_s")}
    train, calls = _fake_train(template)
    monkeypatch.setattr(kt, "train_chunk", train)
    quick = replace(kt.QUICK, workers=1, marginal_ns=(), gradient_seeds=())
    n_quick, n_full = len(planned_keys(kt.QUICK)), len(docs_records)
    text = _run(out, quick)
    assert len(calls) == 2  # both quick chunks trained
    assert f"Runs recorded: {n_quick} of {n_quick} planned; runs.jsonl also holds {n_full} records" in text
    assert _cost_rows(text) == {"all", "all+sinkhorn"}
    assert len(read_jsonl(out / "runs.jsonl")) == n_full + n_quick

    _no_training(monkeypatch)  # the full run: every committed record is its own, the quick ones are not
    text = _run(out, replace(kt.FULL, workers=1, marginal_ns=(), gradient_seeds=()))
    assert f"Runs recorded: {n_full} of {n_full} planned; runs.jsonl also holds {n_quick} records" in text
    assert _cost_rows(text) == {c.name for c in kt.plan_chunks(kt.FULL)}
    committed = json.loads((DOCS / "claims.json").read_text())
    now = json.loads((out / "claims.json").read_text())
    assert [c["verdict"] for c in now["claims"][:8]] == [c["verdict"] for c in committed["claims"][:8]]
