"""Tests for the experiment kit (routelab.experiments.kit) and the registry (routelab.experiments.registry).

The store's resume and atomic writes are tested in test_kit_store.py, diverged runs in
test_reliability_experiments.py; here: registration, the one-way imports, and the report helpers.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from routelab.experiments import registry as experiment_registry
from routelab.experiments.kit.claims import HOLDS, NOT_HOLD, PARTLY, Claim, claims_markdown, verdict_of
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.kit.provenance import load_average, routelab_version, software_line
from routelab.experiments.kit.stats import beyond_spread, mean_se, paired_difference
from routelab.experiments.kit.tables import md_table


def test_builtin_experiments_are_registered_in_listing_order() -> None:
    assert list(experiment_registry.REGISTRY) == [
        "kool-toy", "dselect-recovery", "dselect-synthetic", "dselect-movielens", "dselect-multimnist", "mae",
        "moe-routers", "lm-routers",
    ]
    assert all(isinstance(e, Experiment) for e in experiment_registry.REGISTRY.values())


def test_register_rejects_what_cannot_be_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(experiment_registry, "REGISTRY", {})

    def run(out_dir: Path, settings: Any) -> Path:
        return out_dir / "report.md"

    exp = experiment_registry.register(Experiment("toy", "A toy.", run, full="f", quick_settings="q"))
    assert experiment_registry.REGISTRY == {"toy": exp}
    assert exp.run(Path("/x"), quick=True) == Path("/x/report.md")
    with pytest.raises(ValueError, match="already registered"):
        experiment_registry.register(Experiment("toy", "Again.", run, full=None, quick_settings=None))
    with pytest.raises(ValueError, match="without whitespace"):
        experiment_registry.register(Experiment("two words", "Bad.", run, full=None, quick_settings=None))
    with pytest.raises(TypeError, match="needs an Experiment"):
        experiment_registry.register(object())  # type: ignore[arg-type]


def test_run_passes_the_full_or_the_quick_settings() -> None:
    seen = []
    exp = Experiment("x", "X.", lambda out_dir, s: seen.append((out_dir, s)) or out_dir, full="full",
                     quick_settings="quick")
    exp.run("out", quick=False)  # type: ignore[arg-type]
    exp.run(Path("out"), quick=True)
    assert seen == [(Path("out"), "full"), (Path("out"), "quick")]


def test_imports_go_one_way() -> None:
    """The kit imports no experiment and the package imports nothing, so importing one experiment
    neither imports the others nor the registry (the cycle the registry replaced)."""
    code = (
        "import sys, routelab.experiments.kit.store, routelab.experiments.kit.claims, "
        "routelab.experiments.kit.provenance, routelab.experiments.kit.divergence\n"
        "assert not [m for m in sys.modules if m.startswith('routelab.experiments.') "
        "and not m.startswith('routelab.experiments.kit')], sorted(sys.modules)\n"
        "import routelab.experiments.kool_toy\n"
        "assert 'routelab.experiments.registry' not in sys.modules\n"
        "assert not [m for m in sys.modules if m.startswith(('routelab.experiments.mae', "
        "'routelab.experiments.moe_routers', 'routelab.experiments.dselect'))]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_mean_se_and_its_format() -> None:
    s = mean_se([1.0, 2.0, 3.0, None, float("nan"), float("inf")])
    assert s.n == 3 and s.mean == 2.0 and s.se == pytest.approx(1 / math.sqrt(3))
    assert s.non_finite == 2  # NaN and inf are left out, and said
    assert s.fmt() == "2.00 ± 0.58 (2 non-finite left out)"
    assert s.fmt(1, scale=100) == "200.0 ± 57.7 (2 non-finite left out)"
    one = mean_se(x for x in [0.5])
    assert one.se is None and one.fmt(3) == "0.500"
    none = mean_se([])
    assert none.n == 0 and math.isnan(none.mean) and none.fmt() == "—"


def test_paired_difference_and_its_side_at_the_seed_spread() -> None:
    # Seeds 0-2 in both; seed 3 only in a; seed 2 failed in b (None): paired over seeds 0 and 1.
    d = paired_difference({0: 1.0, 1: 2.0, 2: 5.0, 3: 9.0}, {0: 0.5, 1: 1.0, 2: None})
    assert d.n == 2 and d.mean == pytest.approx(0.75) and d.se == pytest.approx(0.25)
    # two seeds: the 95 % t bound is t(0.975, 1) = 12.71 s.e. = 3.18, so 0.75 is a tie (it is beyond 2 s.e.)
    assert beyond_spread(d) == 0
    assert beyond_spread(d, confidence=0.5) == 1  # t(0.75, 1) = 1.0 s.e. = 0.25 < 0.75
    assert beyond_spread(paired_difference({0: 1.0, 1: 3.0}, {0: 2.0, 1: 0.0})) == 0  # +/-: a tie
    assert beyond_spread(paired_difference({0: 1.0}, {0: 2.0})) == -1  # one seed: its sign
    assert beyond_spread(paired_difference({0: 1.0}, {1: 2.0})) is None  # no seed in common
    assert beyond_spread(paired_difference({0: float("nan")}, {0: 1.0})) is None


def test_md_table_and_alignment() -> None:
    assert md_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
    assert md_table(["a", "b"], [], align="---|---:|").splitlines()[1] == "|---|---:|"


def test_verdicts_and_claims_table() -> None:
    assert verdict_of([True, True]) == HOLDS and verdict_of([True, False]) == PARTLY
    assert verdict_of([False]) == NOT_HOLD
    c = Claim(text="t", criterion="c", measured="m", verdict=f"{PARTLY} (within 2 s.e.)")
    assert c.outcome == PARTLY
    assert claims_markdown([c]).splitlines() == [
        "| # | claim (paper) | criterion | measured | verdict |", "|---|---|---|---|---|",
        "| 1 | t | c | m | **partly (within 2 s.e.)** |"]
    # the paper's side gets a column only when a claim has one; an empty criterion column is left out
    table = claims_markdown([Claim(text="t", paper="+0.8 BLEU", measured="m", verdict=HOLDS)])
    assert table.splitlines()[0] == "| # | claim (paper) | paper | measured | verdict |"
    with pytest.raises(TypeError):
        Claim("t", "c", "m", HOLDS)  # type: ignore[misc]  # keywords only


def test_provenance_lines() -> None:
    assert software_line().startswith(f"routelab {routelab_version()}, torch ")
    assert software_line(threads=3).endswith(", 3 torch thread(s)")
    load = load_average()
    assert load == "unavailable" or float(load) >= 0
