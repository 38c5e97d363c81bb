"""Contracts of the ``routelab`` command from its documentation (cli.py's docstrings and --help, README.md).

Written after mutation testing src/routelab/cli.py: each test pins a documented behaviour that the other
CLI tests left open. Runs stay cheap: toy experiments registered in an isolated registry (the ``registry``
fixture of conftest.py), invalid options that stop before anything runs, and fake benchmark modules.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from routelab import cli
from routelab.data.errors import DataUnavailable
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.registry import register


def _toy(name: str, error: BaseException | None = None) -> Experiment:
    """An experiment that writes a one-line report, or raises ``error``."""
    def sweep(out_dir: Path, quick: bool) -> Path:
        if error is not None:
            raise error
        report = out_dir / "report.md"
        report.write_text(f"# {name}\n\nquick={quick}\n", encoding="utf-8")
        return report

    return Experiment(name=name, description=f"Toy {name}.", sweep=sweep, full=False, quick_settings=True)


def _pid_sweep(out_dir: Path, quick: bool) -> Path:
    """Module level, so a worker process can receive it: records the pid of the process that ran it."""
    report = out_dir / "report.md"
    report.write_text(f"# pid\n\npid={os.getpid()}\n", encoding="utf-8")
    return report


# ---------------------------------------------------------------------------- reproduce: options


def test_reproduce_defaults_are_the_documented_ones() -> None:
    """--help: --out defaults to ``results``, --jobs to 1; --quick and --fresh are off unless given."""
    args = cli.build_parser().parse_args(["reproduce"])
    assert args.out == Path("results")
    assert args.jobs == 1
    assert args.quick is False and args.fresh is False and args.allow_missing_data is False
    assert args.names == []
    given = cli.build_parser().parse_args(["reproduce", "a", "--quick", "--fresh", "--jobs", "3", "--out", "d"])
    assert (given.quick, given.fresh, given.jobs, given.out, given.names) == (True, True, 3, Path("d"), ["a"])


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_reproduce_refuses_a_jobs_that_is_not_a_positive_integer(value: str, registry: dict[str, Any],
                                                                 tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A bad option is a usage error (status 2) before anything runs."""
    register(_toy("alpha"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["reproduce", "alpha", "--jobs", value, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--jobs" in capsys.readouterr().err
    assert not (tmp_path / "alpha").exists()


def test_reproduce_runs_each_named_experiment_once(registry: dict[str, Any], tmp_path: Path) -> None:
    register(_toy("alpha"))
    register(_toy("beta"))
    assert cli.main(["reproduce", "alpha", "alpha", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert report.count("## alpha\n\nToy alpha.") == 1 and "## beta" not in report


def test_fresh_moves_earlier_results_aside_and_resume_keeps_them(registry: dict[str, Any], tmp_path: Path) -> None:
    """--fresh: DIR/NAME is moved aside to DIR/NAME.old-<time> (nothing deleted); without it, it stays."""
    register(_toy("alpha"))
    (tmp_path / "alpha").mkdir()
    (tmp_path / "alpha" / "earlier.txt").write_text("earlier run")
    assert cli.main(["reproduce", "alpha", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "alpha" / "earlier.txt").exists()  # resumed: nothing moved
    assert cli.main(["reproduce", "alpha", "--fresh", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "alpha" / "earlier.txt").exists()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("alpha.old-")]
    assert len(moved) == 1 and (moved[0] / "earlier.txt").read_text() == "earlier run"
    assert (tmp_path / "alpha" / "report.md").exists()


def test_jobs_runs_experiments_in_their_own_processes(registry: dict[str, Any], tmp_path: Path) -> None:
    """--jobs N: up to N experiments at once, each in its own process; the report is in the same order."""
    for name in ("alpha", "beta"):
        register(Experiment(name=name, description=f"Toy {name}.", sweep=_pid_sweep, full=False,
                            quick_settings=True))
    assert cli.main(["reproduce", "--jobs", "2", "--out", str(tmp_path)]) == 0
    pids = {(tmp_path / n / "report.md").read_text(encoding="utf-8").split("pid=")[1].strip()
            for n in ("alpha", "beta")}
    assert str(os.getpid()) not in pids
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert report.index("## alpha") < report.index("## beta")


# ---------------------------------------------------------------------------- reproduce: outcomes and exit codes


def test_one_failure_exits_1_with_one_error_line_naming_it(registry: dict[str, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    register(_toy("alpha"))
    register(_toy("broken", RuntimeError("boom")))
    assert cli.main(["reproduce", "--out", str(tmp_path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("routelab: error:")]
    assert len(errors) == 1 and errors[0].startswith("routelab: error: broken failed: RuntimeError: boom")
    assert (tmp_path / "alpha" / "report.md").exists()  # the others still run


def test_missing_data_exits_1_unless_allowed(registry: dict[str, Any], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Missing data alone exits 1, or 0 with --allow-missing-data (a warning; still listed in the report)."""
    register(_toy("alpha"))
    register(_toy("nodata", DataUnavailable("run `make data`")))
    assert cli.main(["reproduce", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "routelab: error: nodata was skipped: its data is not installed" in err
    assert cli.main(["reproduce", "--allow-missing-data", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "routelab: warning: nodata skipped" in err and "routelab: error:" not in err
    assert "| nodata | skipped |" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_allow_missing_data_does_not_excuse_a_failure(registry: dict[str, Any], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    register(_toy("nodata", DataUnavailable("run `make data`")))
    register(_toy("broken", RuntimeError("boom")))
    assert cli.main(["reproduce", "--allow-missing-data", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "routelab: error: broken failed: RuntimeError: boom" in err


def test_several_not_run_are_named_on_one_error_line(registry: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    register(_toy("nodata1", DataUnavailable("x")))
    register(_toy("nodata2", DataUnavailable("y")))
    register(_toy("broken", RuntimeError("boom")))
    assert cli.main(["reproduce", "--out", str(tmp_path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("routelab: error:")]
    assert len(errors) == 1
    assert "3 experiments did not run" in errors[0]
    assert "nodata1, nodata2 skipped: data not installed" in errors[0]
    assert "broken failed: RuntimeError: boom" in errors[0]


def test_ctrl_c_exits_130(registry: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit codes: 130 when interrupted with Ctrl-C."""
    register(_toy("alpha", KeyboardInterrupt()))
    assert cli.main(["reproduce", "alpha", "--out", str(tmp_path)]) == 130
    assert "routelab: interrupted" in capsys.readouterr().err
    # the lock went with the interrupted invocation: a second one runs
    registry.clear()
    register(_toy("alpha"))
    assert cli.main(["reproduce", "alpha", "--out", str(tmp_path)]) == 0


# ---------------------------------------------------------------------------- bench: option checks


@pytest.fixture
def no_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any benchmark that starts fails the test: the option checks must stop the command first."""
    def refuse(*args: Any, **kwargs: Any) -> str:
        pytest.fail("a benchmark ran although its options are invalid")

    from routelab.bench.moe_parallel import benchmark_config

    monkeypatch.setattr(cli, "_run_assignment_benchmark", refuse)
    for module, names in {"routelab.bench.peers": ("run_assignment_peers", "run_sinkhorn_peers"),
                          "routelab.bench.moe_parallel": ("run_benchmark",)}.items():
        fake = types.ModuleType(module)
        for name in names:
            setattr(fake, name, refuse)
        monkeypatch.setitem(sys.modules, module, fake)
    sys.modules["routelab.bench.moe_parallel"].benchmark_config = benchmark_config  # the real option check


@pytest.mark.parametrize(("argv", "named"), [
    (["bench", "assignment", "--world-size", "2"], "--world-size"),
    (["bench", "b-matching", "--world-size", "2"], "--world-size"),
    (["bench", "assignment", "--dtype", "bfloat16"], "--dtype"),
    (["bench", "assignment", "--k", "1"], "--k"),
    (["bench", "b-matching", "--experts", "8"], "--experts"),
    (["bench", "moe", "--world-size", "1", "--d-model", "64"], "--d-model"),
    (["bench", "moe", "--world-size", "1", "--compile"], "--compile"),
    (["bench", "moe", "--world-size", "1", "--threads", "2"], "--threads"),
])
def test_bench_refuses_an_option_that_does_not_apply_and_names_it(argv: list[str], named: str, no_benchmarks: None,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("routelab: error:") and named in err


@pytest.mark.parametrize("argv", [
    ["bench", "moe", "--world-size", "2", "--threads", "2"],
    ["bench", "moe", "--d-model", "7", "--quick"],
    ["bench", "moe", "--world-size", "3", "--quick"],
], ids=["threads-with-world-size", "d-model-not-in-the-grid", "world-size-not-dividing-the-experts"])
def test_a_refused_bench_leaves_no_directory_behind(argv: list[str], no_benchmarks: None, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A bad option is an error "before anything runs": the --out check creates the table's directory,
    so it comes after every option check (review s42: both commands left ./newdir behind)."""
    out = tmp_path / "newdir" / "table.md"
    assert cli.main([*argv, "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("routelab: error:")
    assert not (tmp_path / "newdir").exists()


def test_bench_peers_on_cuda_is_refused(no_benchmarks: None, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--peers runs on CPU (its peers are CPU solvers), even where a GPU is present."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["bench", "assignment", "--peers", "--device", "cuda"]) == 2
    assert "--peers" in capsys.readouterr().err


def test_bench_device_cuda_without_a_gpu_is_a_usage_error(no_benchmarks: None, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "assignment", "--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_help_documents_the_reproduce_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["reproduce", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--quick", "--out DIR", "--fresh", "--allow-missing-data", "--jobs N"):
        assert option in out
    assert "(default: results)" in out and "(default: 1;" in out
