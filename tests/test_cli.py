"""Tests for the routelab command (routelab.cli.main)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, TextIO

import pytest

from routelab import cli
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.registry import register

TABLE = "| n | k | ms |\n|---|---|---|\n| 8 | 2 | 0.1 |\n"


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace routelab.bench.assignment with a fake that records its calls."""
    calls: list[dict[str, Any]] = []

    def run_benchmark(
        quick: bool = False, threads: int | None = None, device: str = "cpu", out: TextIO | None = None
    ) -> str:
        calls.append({"quick": quick, "threads": threads, "device": device, "out": out})
        if out is not None:
            print("fake benchmark running", file=out)
        return TABLE

    fake = types.ModuleType("routelab.bench.assignment")
    fake.run_benchmark = run_benchmark  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "routelab.bench.assignment", fake)
    return calls


def toy_experiment(name: str) -> Experiment:
    def fn(out_dir: Path, quick: bool) -> Path:
        (out_dir / "fig.png").write_bytes(b"png")
        report = out_dir / "report.md"
        report.write_text(f"# {name}\n\nquick={quick}\n\n![plot](fig.png)\n", encoding="utf-8")
        return report

    return Experiment(name=name, description=f"Toy experiment {name}.", sweep=fn, full=False, quick_settings=True)


def test_unknown_experiment_exits_2_and_lists_valid_names(
    registry: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    register(toy_experiment("alpha"))
    register(toy_experiment("beta"))
    code = cli.main(["reproduce", "gamma", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "gamma" in err and "alpha" in err and "beta" in err
    assert not (tmp_path / "report.md").exists()


def test_list(registry: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    register(toy_experiment("alpha"))
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "Toy experiment alpha." in out


def test_reproduce_aggregates_registered_experiments(
    registry: dict[str, Any], fake_bench: list[dict[str, Any]], tmp_path: Path
) -> None:
    register(toy_experiment("alpha"))
    register(toy_experiment("beta"))
    assert cli.main(["reproduce", "beta", "--out", str(tmp_path)]) == 0
    assert fake_bench == []  # reproduce runs the experiments only, never the benchmark
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## beta" in report and "## alpha" not in report
    assert "### beta" in report  # the experiment's own title is demoted under its section
    assert "quick=False" in report
    assert "](beta/fig.png)" in report  # relative links still point at the file
    assert (tmp_path / "beta" / "report.md").exists()

    assert cli.main(["reproduce", "--quick", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert report.index("## alpha") < report.index("## beta")
    assert "- mode: quick" in report


def test_bench_passes_options_and_writes_table(
    fake_bench: list[dict[str, Any]], tmp_path: Path
) -> None:
    table = tmp_path / "bench.md"
    code = cli.main(["bench", "assignment", "--quick", "--threads", "2", "--out", str(table)])
    assert code == 0
    call = fake_bench[0]
    assert call["quick"] is True and call["threads"] == 2 and call["device"] == "cpu"
    assert call["out"] is sys.stdout
    assert table.read_text(encoding="utf-8") == TABLE


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "assignment", "--threads", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "nonsense"])
    assert exc.value.code == 2


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "reproduce" in capsys.readouterr().err


def test_rebase_links_leaves_maths_in_prose_alone() -> None:
    from routelab.cli import _rebase_links

    text = "y = 1[x<0.5](0.8x - 0.2) ![a](fig.png) [r](sub/report.md \"t\") [u](https://x.org) [h](#a)"
    assert _rebase_links(text, "kt") == (
        "y = 1[x<0.5](0.8x - 0.2) ![a](kt/fig.png) [r](kt/sub/report.md \"t\") [u](https://x.org) [h](#a)"
    )


def test_bench_peers_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "sinkhorn"]) == 2
    assert "--peers" in capsys.readouterr().err
    assert cli.main(["bench", "moe", "--peers"]) == 2
    assert "--peers applies to" in capsys.readouterr().err
    assert cli.main(["bench", "b-matching", "--device", "cuda"]) == 2
    assert "runs on CPU" in capsys.readouterr().err


def test_bench_b_matching_runs_its_sizes_with_the_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import routelab.bench.b_matching as module

    calls: list[tuple[Any, ...]] = []

    def fake(sizes: Any, seeds: int = 5, out: Any = None, threads: int | None = 1) -> str:
        calls.append((sizes, threads))
        return "| table |"

    monkeypatch.setattr(module, "run_b_matching_benchmark", fake)
    table = tmp_path / "b.md"
    assert cli.main(["bench", "b-matching", "--quick", "--threads", "2", "--out", str(table)]) == 0
    assert calls == [(module.QUICK_SIZES, 2)] and table.read_text() == "| table |\n"
    assert cli.main(["bench", "b-matching", "--peers"]) == 0  # its peers always run: accepted
    assert calls[-1] == (module.FULL_SIZES, 1)


@pytest.mark.parametrize("cost", [-1.0, float("nan"), float("inf"), "10", True])
def test_register_rejects_a_bad_quick_cost(registry: dict[str, Any], cost: Any) -> None:
    exp = Experiment("costly", "Toy.", lambda out_dir, quick: out_dir / "report.md", False, True, quick_seconds=cost)
    with pytest.raises(ValueError, match="quick_seconds of 'costly' must be a finite number >= 0"):
        register(exp)
    assert "costly" not in registry


def test_bench_checks_its_out_path_and_world_size_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit finding: an existing directory as --out failed only after the whole benchmark had run, and a
    world size that does not divide the experts was a traceback with status 1."""
    import routelab.cli as cli_module

    monkeypatch.setattr(cli_module, "_run_assignment_benchmark",
                        lambda **kw: pytest.fail("the benchmark ran before --out was checked"))
    assert cli.main(["bench", "assignment", "--quick", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli.main(["bench", "moe", "--world-size", "3", "--quick"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_bench_refuses_an_out_it_cannot_write_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: a file where --out's directory should be, or a directory that refuses files,
    failed with a raw traceback after the whole benchmark had run."""
    import routelab.cli as cli_module

    monkeypatch.setattr(cli_module, "_run_assignment_benchmark",
                        lambda **kw: pytest.fail("the benchmark ran before --out was checked"))
    (tmp_path / "afile").write_text("in the way")
    assert cli.main(["bench", "assignment", "--quick", "--out", str(tmp_path / "afile" / "x.md")]) == 2
    assert "cannot create the directory of --out" in capsys.readouterr().err

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli_module.tempfile, "NamedTemporaryFile", refuse)
    assert cli.main(["bench", "assignment", "--quick", "--out", str(tmp_path / "ok" / "x.md")]) == 2
    assert "cannot write in the directory of --out" in capsys.readouterr().err


def test_bench_reports_a_failed_table_write_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import routelab.cli as cli_module

    monkeypatch.setattr(cli_module, "_run_assignment_benchmark", lambda **kw: "| a table |")

    def fail(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(cli_module, "atomic_write_text", fail)
    assert cli.main(["bench", "assignment", "--quick", "--out", str(tmp_path / "x.md")]) == 2
    assert "cannot write --out" in capsys.readouterr().err


def test_bench_threads_is_refused_with_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    """Audit finding: --threads was accepted and silently ignored by the multi-process benchmark."""
    assert cli.main(["bench", "moe", "--world-size", "1", "--threads", "2", "--quick"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_reproduce_refuses_a_second_writer_of_one_experiment(tmp_path, capsys):
    """Two invocations into one --out would train the same runs twice and count both: the second
    is refused, naming the first; the lock goes with the process that held it."""
    from routelab import cli as cli_module
    from routelab.experiments.kit.lock import lock_results

    held = lock_results(tmp_path / "kool-toy", "routelab reproduce")
    try:
        assert cli_module.main(["reproduce", "kool-toy", "--quick", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "kool-toy is being written by routelab reproduce (pid" in err and "use another output" in err
        assert not (tmp_path / "kool-toy").exists()  # nothing moved, created or run
    finally:
        held.close()
    again = lock_results(tmp_path / "kool-toy")  # free again
    again.close()


def test_reproduce_errors_clearly_on_a_file_in_the_way_and_an_empty_out(tmp_path, capsys):
    from routelab import cli as cli_module

    (tmp_path / "kool-toy").write_text("not a directory")
    assert cli_module.main(["reproduce", "kool-toy", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot prepare the results directory" in err and "kool-toy" in err and "choose another --out" in err
    with pytest.raises(SystemExit):
        cli_module.main(["reproduce", "--out", ""])
    assert "needs a directory path, got an empty string" in capsys.readouterr().err
    assert cli_module.main(["reproduce", "kool_toy", "--out", str(tmp_path)]) == 2
    assert "'kool_toy' (did you mean 'kool-toy'?)" in capsys.readouterr().err


def test_a_file_system_without_locks_runs_unguarded_with_a_warning(tmp_path, capsys, monkeypatch):
    import errno

    from routelab.experiments.kit import lock

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", refuse)
    handle = lock.lock_results(tmp_path / "kool-toy")
    handle.close()
    assert "is not locked (its file system refuses locks (No locks available))" in capsys.readouterr().err


def test_an_experiments_own_command_takes_the_same_lock(tmp_path, capsys):
    """``python -m routelab.experiments.lm_routers --out DIR`` and ``routelab reproduce lm-routers``
    into DIR's parent cannot write one directory at once."""
    from routelab.experiments.kit.lock import lock_results
    from routelab.experiments.lm_routers.__main__ import main as lm_main

    held = lock_results(tmp_path / "lm-routers", "routelab reproduce")
    try:
        assert lm_main(["--quick", "--out", str(tmp_path / "lm-routers")]) == 2
        assert "lm-routers is being written by routelab reproduce (pid" in capsys.readouterr().err
    finally:
        held.close()


def test_an_earlier_traceback_does_not_outlive_a_later_failure(registry: dict[str, Any], tmp_path: Path) -> None:
    """A review: a failure with its own one-line reason (a results file it cannot resume from) left the
    previous invocation's error.txt, with another error's traceback, beside it."""
    from routelab.experiments.kit.store import ResultsFileError

    errors = [RuntimeError("first failure"), ResultsFileError("runs.jsonl:3: not valid JSON", tmp_path, 3)]

    def fn(out_dir: Path, quick: bool) -> Path:
        raise errors.pop(0)

    register(Experiment(name="flaky", description="Fails.", sweep=fn, full=False, quick_settings=True))
    log = tmp_path / "flaky" / "error.txt"
    assert cli.main(["reproduce", "flaky", "--out", str(tmp_path)]) == 1
    assert "RuntimeError: first failure" in log.read_text(encoding="utf-8")
    assert cli.main(["reproduce", "flaky", "--out", str(tmp_path)]) == 1
    # the second failure's own error.txt (README: every failed experiment's traceback is in DIR/NAME/error.txt;
    # a review found none for a results file it could not resume from)
    text = log.read_text(encoding="utf-8")
    assert "ResultsFileError: runs.jsonl:3: not valid JSON" in text and "first failure" not in text


def test_a_record_without_a_field_the_report_reads_is_named(registry: dict[str, Any], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A review: a record with its key fields but no measurements failed with a bare KeyError."""
    def fn(out_dir: Path, quick: bool) -> Path:
        (out_dir / "runs.jsonl").write_text('{"seed": 0}\n')
        return {"seed": 0}["test_mse"]

    register(Experiment(name="partial", description="Reads a field.", sweep=fn, full=False, quick_settings=True))
    assert cli.main(["reproduce", "partial", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "KeyError: 'test_mse' (a record in" in err and "--fresh" in err


@pytest.mark.parametrize(("module", "last_words"), [
    ("routelab.experiments.lm_routers", "16 wide experts (for a GPU)."),
    ("routelab.experiments.mae_translation", "a carried copy of the cache)."),
])
def test_an_experiments_own_help_says_its_whole_paragraph(module, last_words, capsys):
    """A review: the help took one wrapped line of the docstring ("... does not have: the")."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(f"{module}.__main__").main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert last_words in out and "``" not in out
