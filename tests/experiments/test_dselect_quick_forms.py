"""The quick forms of the DSelect-k experiments (issue 13, part 4): what they train, and how they judge.

The committed full runs (docs/dselect-*/runs.jsonl) are the independent truth: their records, run
through the report code with the full settings, give the committed claims; restricted to the cells a
quick form trains, they give the verdicts the quick form is meant to show.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from routelab.experiments.dselect import movielens, multimnist, synthetic
from routelab.experiments.kit.claims import NOT_MEASURED, SINGLE_SEED
from routelab.experiments.kit.store import read_jsonl, split_failed

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _records(name: str) -> list[dict]:
    path = DOCS / name / "runs.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not in this checkout")
    return split_failed(read_jsonl(path))[0]


def _claims(out_dir: Path) -> list[dict]:
    return json.loads((out_dir / "claims.json").read_text(encoding="utf-8"))["claims"]


def _committed(name: str) -> list[dict]:
    return json.loads((DOCS / name / "claims.json").read_text(encoding="utf-8"))["claims"]


def test_synthetic_and_movielens_quick_forms_train_as_long_as_the_full_runs() -> None:
    for mod in (synthetic, movielens):
        quick, full = mod.QUICK, mod.FULL
        assert quick.quick and not full.quick and quick.reps < full.reps
        same = replace(quick, reps=full.reps, quick=False)
        if mod is movielens:
            same = replace(same, alphas=full.alphas)
        assert same == full  # only repetitions (and movielens' α) differ


def test_synthetic_quick_form_is_the_full_runs_first_repetition_and_agrees(tmp_path: Path) -> None:
    records = [r for r in _records("dselect-synthetic") if r["seed"] == 0]
    synthetic.write_report(tmp_path, records, synthetic.QUICK, 0.0)
    quick = _claims(tmp_path)
    committed = _committed("dselect-synthetic")
    assert [c["id"] for c in quick] == [c["id"] for c in committed]
    # The same verdict wherever the full run's is clear-cut; a "partly" or "inconclusive" (some or every T a tie:
    # a difference within the 95 % t interval over its three repetitions) is not reproducible from one, whose
    # sign decides.
    for q, c in zip(quick, committed, strict=True):
        if c["outcome"] not in ("partly", "inconclusive"):  # (the quick run's verdicts say they rest on one seed)
            assert q["verdict"].split(" (")[0] == c["verdict"], (c["id"], q["verdict"], c["verdict"])
            assert "1 seed" in q["verdict"]


@pytest.mark.parametrize("name", ["dselect-movielens", "dselect-multimnist"])
def test_full_records_give_the_committed_claims(name: str, tmp_path: Path) -> None:
    ok = _records(name)
    if name == "dselect-movielens":
        movielens.write_report(tmp_path, ok, movielens.FULL, 0.0, None)
    else:
        multimnist.write_report(tmp_path, ok, multimnist.FULL, 0.0, [])
    got = [(c["id"], c["verdict"], c["measured"]) for c in _claims(tmp_path)]
    assert got == [(c["id"], c["verdict"], c["measured"]) for c in _committed(name)]


def test_movielens_quick_judges_the_alphas_it_trained(tmp_path: Path) -> None:
    records = [r for r in _records("dselect-movielens") if r["alpha"] == 0.5 and r["seed"] == 0]
    movielens.write_report(tmp_path, records, movielens.QUICK, 0.0, None)
    claims = _claims(tmp_path)
    assert len(claims) == 3 and all(c["measured"].split(";")[0].endswith("/1 α (α = 0.5 only)") for c in claims)

    def loss(kind: str) -> float:
        (r,) = [r for r in records if r["model"] == kind]
        return r["loss"]

    softmax_beaten = loss("softmax") > max(loss("dselect_static"), loss("topk_static"))
    assert claims[1]["verdict"] == ("holds" if softmax_beaten else "does not hold") + f" ({SINGLE_SEED})"
    assert claims[1]["measured"].startswith(f"{int(softmax_beaten)}/1")


def test_movielens_settings_reject_unknown_alphas() -> None:
    with pytest.raises(ValueError, match="alphas must be a non-empty subset"):
        replace(movielens.QUICK, alphas=(0.3,))
    with pytest.raises(ValueError, match="alphas must be a non-empty subset"):
        replace(movielens.QUICK, alphas=())


def test_multimnist_quick_form_is_too_short_to_judge(tmp_path: Path) -> None:
    ok = _records("dselect-multimnist")
    multimnist.write_report(tmp_path, ok, multimnist.QUICK, 0.0, [])
    claims = _claims(tmp_path)
    assert len(claims) == 6
    assert all(c["verdict"] == f"{NOT_MEASURED} (quick form: 4 of the full run's 124 training steps)"
               for c in claims)
    assert [c["measured"] for c in claims] == [c["measured"] for c in _committed("dselect-multimnist")]
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "too short to judge the claims" in report


def test_a_quick_run_after_a_full_run_reports_only_its_own_runs(tmp_path: Path, monkeypatch) -> None:
    """Quick and full runs into one directory stay apart. The synthetic quick form is the full
    run's first repetition: it reuses those records and reports them alone (not every recorded
    seed). Multi-MNIST's quick form trains other sizes: full records are neither resumed from nor
    reported (here its data is withheld, so with nothing of its own the quick run is skipped)."""
    import shutil

    from routelab.data.errors import DataUnavailable

    _records("dselect-synthetic")
    shutil.copy(DOCS / "dselect-synthetic" / "runs.jsonl", tmp_path / "runs.jsonl")
    synthetic.run_synthetic(tmp_path, synthetic.QUICK)  # nothing to train: seed 0 is recorded
    rows = (tmp_path / "results.csv").read_text(encoding="utf-8").strip().splitlines()[1:]
    assert len(rows) == len(synthetic.QUICK.tasks) * len(synthetic.GATES)

    _records("dselect-multimnist")
    mm = tmp_path / "mm"
    mm.mkdir()
    shutil.copy(DOCS / "dselect-multimnist" / "runs.jsonl", mm / "runs.jsonl")

    def withheld(*args, **kwargs):
        raise DataUnavailable("withheld by the test")

    monkeypatch.setattr(multimnist, "_data", withheld)
    with pytest.raises(DataUnavailable, match="withheld"):
        multimnist.run_multimnist(mm, multimnist.QUICK)
    report = multimnist.run_multimnist(mm, multimnist.FULL)  # the full settings' records: reported
    assert "Full run" in report.read_text(encoding="utf-8")
    assert len((mm / "results.csv").read_text(encoding="utf-8").strip().splitlines()) == 1 + len(_records(
        "dselect-multimnist"))
