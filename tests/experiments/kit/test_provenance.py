"""Provenance names the code that trained each number (a review: the report named only the commit that
rendered it, and resuming at another commit went unnoticed).

Oracle: the commits a fake ``git_commit`` returned while each run was trained, counted by hand.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import types
import warnings

import pytest

from routelab.experiments.kit import provenance
from routelab.experiments.kit.provenance import COMMIT, NOT_RECORDED, software_line, trained_commits
from routelab.experiments.kit.router_sweep import invocations_markdown, recorded_runs, train_router_seeds


def _sweep(tmp_path, seeds, monkeypatch, commit):
    monkeypatch.setattr(provenance, "git_commit", lambda: commit)
    return train_router_seeds("t", tmp_path, key={"epochs": 1}, routers=["a", "b"], seeds=seeds, threads=1,
                              load_data=lambda: None, summary=lambda r: "ok", progress=False,
                              train=lambda router, seed, data, say: {"router": router, "seed": seed, "acc": 0.5})


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_runs_and_invocations_record_their_commit_and_the_report_lists_every_commit(tmp_path, monkeypatch):
    _sweep(tmp_path, [0], monkeypatch, "aaaaaaa")
    with pytest.warns(RuntimeWarning, match=r"recorded at commit aaaaaaa \(2 runs\).*trains at commit bbbbbbb"):
        _sweep(tmp_path, [0, 1, 2], monkeypatch, "bbbbbbb")
    assert [r[COMMIT] for r in _lines(tmp_path / "runs.jsonl")] == ["aaaaaaa"] * 2 + ["bbbbbbb"] * 4
    assert [i[COMMIT] for i in _lines(tmp_path / "invocations.jsonl")] == ["aaaaaaa", "bbbbbbb"]

    monkeypatch.setattr(provenance, "git_commit", lambda: "ccccccc")  # the report is written at a third
    runs = recorded_runs(tmp_path, key={"epochs": 1}, routers=["a", "b"], seeds=[0, 1, 2])
    line = software_line(runs=runs.ok)
    assert ("(code of the runs: 2 code versions, so not every number comes from the same code: commit bbbbbbb "
            "(4 runs), commit aaaaaaa (2 runs); report written at commit ccccccc)") in line
    inv = invocations_markdown(runs.invocations)[0]
    assert "(commit aaaaaaa): 2 runs" in inv and "(commit bbbbbbb): 4 runs" in inv


def test_one_commit_is_named_once_and_resuming_at_it_does_not_warn(tmp_path, monkeypatch):
    _sweep(tmp_path, [0], monkeypatch, "aaaaaaa")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sweep(tmp_path, [0, 1], monkeypatch, "aaaaaaa")
    runs = recorded_runs(tmp_path, key={"epochs": 1}, routers=["a", "b"], seeds=[0, 1])
    assert trained_commits(runs.ok) == "commit aaaaaaa (4 runs)"


def test_records_without_a_commit_are_reported_as_such_and_resuming_them_warns(tmp_path, monkeypatch):
    """Records written before routelab recorded a commit: "commit not recorded", no crash."""
    old = [{"router": r, "seed": 0, "settings": {"epochs": 1}, "acc": 0.5} for r in ("a", "b")]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (tmp_path / "invocations.jsonl").write_text(json.dumps(
        {"started": "2026-11-22 00:37 UTC", "wall_s": 1.0, "trained": 2, "settings": {"epochs": 1},
         "load_start": "1.0", "load_end": "1.0", "threads": 1}) + "\n")
    with pytest.warns(RuntimeWarning, match=rf"{NOT_RECORDED} \(2 runs\).*trains at commit bbbbbbb"):
        _sweep(tmp_path, [0, 1], monkeypatch, "bbbbbbb")
    runs = recorded_runs(tmp_path, key={"epochs": 1}, routers=["a", "b"], seeds=[0, 1])
    assert trained_commits(runs.ok) == ("2 code versions, so not every number comes from the same code: "
                                        "commit bbbbbbb (2 runs), commit not recorded (2 runs)")
    assert "2026-11-22 00:37 UTC (commit not recorded): 2 runs" in invocations_markdown(runs.invocations)[0]
    assert trained_commits([]) == "no runs recorded"
    monkeypatch.setattr(provenance, "git_commit", lambda: None)  # outside a git checkout
    assert "no git checkout (1 run)" in software_line(runs=[{COMMIT: None}])
    assert "report written outside a git checkout" in software_line(runs=[{COMMIT: None}])


def test_an_experiment_resumed_at_another_commit_warns_and_its_report_names_both(tmp_path, monkeypatch):
    """dselect-synthetic (its own resume loop, through kit.provenance.CommitStamp): one repetition at one
    commit, a second at another; the report's provenance line counts the runs of each."""
    from routelab.experiments.dselect import synthetic

    s = synthetic.SyntheticSettings(tasks=(16,), reps=1, epochs=1, n_train=600, n_test=50, batch=200)
    monkeypatch.setattr(provenance, "git_commit", lambda: "aaaaaaa")
    synthetic.run_synthetic(tmp_path, s)
    per_rep = len(_lines(tmp_path / "runs.jsonl"))
    monkeypatch.setattr(provenance, "git_commit", lambda: "bbbbbbb")
    with pytest.warns(RuntimeWarning, match=rf"commit aaaaaaa \({per_rep} runs\).*trains at commit bbbbbbb"):
        report = synthetic.run_synthetic(tmp_path, dataclasses.replace(s, reps=2))
    assert [r[COMMIT] for r in _lines(tmp_path / "runs.jsonl")] == ["aaaaaaa"] * per_rep + ["bbbbbbb"] * per_rep
    assert (f"2 code versions, so not every number comes from the same code: commit aaaaaaa ({per_rep} runs), "
            f"commit bbbbbbb ({per_rep} runs); report written at commit bbbbbbb") in report.read_text()


def _git(cwd, *args):
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def _fake_routelab(monkeypatch, init_py):
    init_py.parent.mkdir(parents=True)
    init_py.write_text("")
    monkeypatch.setattr(provenance, "routelab", types.SimpleNamespace(__file__=str(init_py), __version__="0.1.0"))


def test_git_commit_names_a_checkout_but_not_an_installed_copy_inside_one(tmp_path, monkeypatch):
    """A copy of routelab installed into a virtual environment inside some checkout is no checkout's code:
    ``None``, not the enclosing repository's HEAD (a review: it was that HEAD, and clean). Oracle: git itself."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "README").write_text("x\n")
    _git(repo, "add", "README")
    _git(repo, "commit", "-q", "-m", "init")
    head = _git(repo, "rev-parse", "--short", "HEAD")

    _fake_routelab(monkeypatch, repo / ".venv2" / "lib" / "python3.11" / "site-packages" / "routelab" / "__init__.py")
    assert provenance.git_commit() is None

    monkeypatch.undo()
    _fake_routelab(monkeypatch, repo / "src" / "routelab" / "__init__.py")  # a checkout's src/: untracked, dirty
    assert provenance.git_commit() == f"{head}+dirty"

    nested = repo / "sub"  # <root>/src/routelab under a folder of the repository, not at its top
    monkeypatch.undo()
    _fake_routelab(monkeypatch, nested / "src" / "routelab" / "__init__.py")
    assert provenance.git_commit() is None


def test_commit_of_version_reads_back_routelab_version(monkeypatch):
    from routelab.experiments.kit.provenance import commit_of_version, routelab_version

    assert commit_of_version("0.1.0 (commit ba96d28)") == "ba96d28"
    assert commit_of_version("0.1.0 (commit ba96d28+dirty)") == "ba96d28+dirty"
    assert commit_of_version("0.1.0") is None and commit_of_version("?") is None
    monkeypatch.setattr(provenance, "git_commit", lambda: "abc1234")
    assert commit_of_version(routelab_version()) == "abc1234"
