"""Contracts of ``python -m routelab.experiments.lm_routers`` (its ``__main__.main``) that the rest of the
suite left unchecked, found by a mutation review of the command line (each test here fails on a mutant
the other tests let through).

* With no form flag the run is the full form; ``--quick`` and ``--large`` are exclusive; ``--large``
  alone runs on the CPU (the device is its own option).
* ``--out`` defaults to ``results/lm-routers`` (the directory ``routelab reproduce lm-routers`` writes).
* ``--seeds`` takes seeds as ``check_seed`` does (integers in [0, 2**64), seed 0 included), at least one;
  ``--steps 0`` is refused by the option.

Independent truths: the module docstring and option help, and the forms QUICK / LARGE / FULL themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from routelab.experiments import lm_routers as lm
from routelab.experiments.lm_routers import __main__ as cli


@pytest.fixture
def seen(monkeypatch):
    """The settings each ``main`` call hands to run_sweep (which does not run)."""
    got = []
    monkeypatch.setattr(cli, "run_sweep", lambda out, s, data_dir=None: got.append(s) or out / "report.md")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return got


@pytest.mark.parametrize(("flags", "form"), [([], lm.FULL), (["--quick"], lm.QUICK), (["--large"], lm.LARGE)])
def test_each_form_flag_runs_its_form_on_the_cpu_by_default(flags, form, seen, tmp_path):
    """No form flag is the full form (the docstring: the same sweep as ``routelab reproduce``); the device
    is ``cpu`` unless ``--device`` says otherwise, for ``--large`` too ("meant for a GPU", not forced onto one)."""
    assert cli.main([*flags, "--out", str(tmp_path)]) == 0
    assert seen == [form.with_(device="cpu")]


def test_quick_and_large_are_exclusive(seen, tmp_path, capsys):
    """``--quick --large`` names two forms: a usage error (status 2) before anything runs."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["--quick", "--large", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert seen == []


def test_the_default_results_directory_is_results_lm_routers(monkeypatch):
    """``--out`` defaults to ``results/lm-routers``, the directory ``routelab reproduce lm-routers`` writes
    (so both commands share its lock and its resumable records)."""
    asked = []
    monkeypatch.setattr(cli, "run_locked", lambda out, holder, run: asked.append((out, holder)) or 0)
    assert cli.main(["--quick"]) == 0
    assert asked == [(Path("results/lm-routers"), "python -m routelab.experiments.lm_routers")]


def test_seed_zero_is_a_seed(seen, tmp_path):
    """``--seeds`` takes ints (the forms' own seeds start at 0): ``--seeds 0 3`` runs seeds 0 and 3."""
    assert 0 in lm.QUICK.seeds
    assert cli.main(["--quick", "--seeds", "0", "3", "--out", str(tmp_path)]) == 0
    assert [s.seeds for s in seen] == [(0, 3)]


@pytest.mark.parametrize("option", ["--seeds", "--routers"])
def test_a_list_option_without_values_is_a_usage_error(option, seen, tmp_path, capsys):
    """``--seeds`` / ``--routers`` given with no value is a usage error (status 2), not a silent fall back
    on the form's defaults."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["--quick", "--out", str(tmp_path), option])
    assert stop.value.code == 2 and f"argument {option}" in capsys.readouterr().err
    assert seen == []


def test_steps_below_one_is_refused_by_the_option_itself(seen, tmp_path, capsys):
    """``--steps`` is a positive int by its own type: the usage error names the option ``--steps``
    (status 2), before the settings are built."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["--quick", "--out", str(tmp_path), "--steps", "0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --steps: expected a positive integer" in err
    assert seen == []


@pytest.mark.parametrize("seed", ["-3", str(2**64), "1.5"])
def test_a_seed_outside_check_seeds_range_is_a_usage_error(seed, seen, tmp_path, capsys):
    """A seed ``torch.Generator.manual_seed`` would wrap (a negative one) or refuse is refused by the
    option (status 2, naming the range) before anything runs, and by the settings' own check."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["--quick", "--seeds", seed, "--out", str(tmp_path)])
    assert stop.value.code == 2 and seen == []
    assert "[0, 2**64)" in capsys.readouterr().err
    if seed != "1.5":
        with pytest.raises(ValueError, match=r"seeds must be an integer in \[0, 2\*\*64\)"):
            lm.QUICK.with_(seeds=(int(seed),)).validate()
