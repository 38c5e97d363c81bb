"""Calls side by side in worker processes (routelab.experiments.kit.jobs) and `routelab reproduce --jobs`."""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from routelab import cli
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.kit.jobs import JobFailed, PrefixedLines, run_side_by_side
from routelab.experiments.registry import register

# ---------------------------------------------------------------- PrefixedLines


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_prefixed_lines_prefix_every_finished_line_and_keep_the_last_one() -> None:
    target = io.StringIO()
    out = PrefixedLines(target, "[x] ")
    out.write("one\ntw")
    assert target.getvalue() == "[x] one\n"
    out.write("o\n\nthree")
    assert target.getvalue() == "[x] one\n[x] two\n"  # an empty line is dropped
    out.close()
    assert target.getvalue() == "[x] one\n[x] two\n[x] three\n"


def test_prefixed_lines_thin_a_redrawn_progress_bar() -> None:
    target, clock = io.StringIO(), _Clock()
    out = PrefixedLines(target, "[k] ", bar_every=10.0, clock=clock)
    out.write("\r  0%|")
    assert target.getvalue() == "[k]   0%|\n"  # the first draw is shown
    for pct in range(1, 10):
        clock.now += 1.0
        out.write(f"\r {pct}0%|")
    assert target.getvalue() == "[k]   0%|\n"  # redraws within 10 s are not
    clock.now += 1.0
    out.write("\r100%|")
    assert target.getvalue() == "[k]   0%|\n[k] 100%|\n"
    out.write("\r100%| done\n")  # the line ends: what it shows last is written
    out.write("next\n")
    assert target.getvalue().splitlines()[-2:] == ["[k] 100%| done", "[k] next"]


# ---------------------------------------------------------------- run_side_by_side (module-level: picklable)


def _square(x: int) -> int:
    print(f"squaring {x}")
    return x * x


def _boom(x: int) -> int:
    raise RuntimeError(f"bad input {x}")


def _die(code: int) -> None:
    os._exit(code)


def _pid_after(delay: float) -> int:
    time.sleep(delay)
    return os.getpid()


def test_run_side_by_side_returns_values_in_order_and_prefixes_output(capfd: pytest.CaptureFixture[str]) -> None:
    calls = [(f"sq{x}", _square, (x,)) for x in range(4)]
    started: list[int] = []
    assert run_side_by_side(calls, jobs=2, on_start=started.append) == [0, 1, 4, 9]
    assert started == [0, 1, 2, 3]
    out = capfd.readouterr().out
    assert all(f"[sq{x}] squaring {x}" in out.splitlines() for x in range(4))


def test_run_side_by_side_runs_calls_at_the_same_time() -> None:
    pids = run_side_by_side([("a", _pid_after, (1.0,)), ("b", _pid_after, (1.0,))], jobs=2)
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_run_side_by_side_reports_an_exception_and_a_dead_worker_and_goes_on() -> None:
    out = run_side_by_side([("boom", _boom, (3,)), ("dead", _die, (7,)), ("ok", _square, (5,))], jobs=2)
    assert isinstance(out[0], JobFailed) and "RuntimeError: bad input 3" in out[0].error
    assert isinstance(out[1], JobFailed) and "exit code 7" in out[1].error
    assert out[2] == 25


#: How long the interrupted workers would sleep: far longer than starting them takes on a loaded
#: machine (spawned children import torch), so the interrupt comes while they sleep.
WORKER_SLEEP_S = 300


def _sleep_then_clean_up(marker: str) -> None:
    Path(marker + ".started").write_text("")
    try:
        time.sleep(WORKER_SLEEP_S)
    finally:
        Path(marker).write_text("finally ran")


def test_ctrl_c_lets_every_worker_run_its_finally_blocks(tmp_path: Path) -> None:
    """A review: Ctrl-C under ``--jobs`` terminated the workers at once, so an experiment's ``finally``
    (where a sweep records the invocation it interrupted) never ran. Here only the parent is interrupted
    (as by ``kill -INT``): its workers get SIGTERM after the grace and stop as Ctrl-C stops them."""
    import _thread
    import threading

    markers = [tmp_path / f"w{i}" for i in range(2)]
    stop = threading.Event()

    def interrupt_once_both_run() -> None:  # (a worker still importing has no finally of its own to run)
        while not stop.is_set():
            if all(Path(f"{m}.started").exists() for m in markers):
                _thread.interrupt_main()
                return
            time.sleep(0.1)

    # interrupt_main raises KeyboardInterrupt only through Python's own SIGINT handler: make sure it
    # is the one in place, whatever an earlier test in this process installed.
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=interrupt_once_both_run, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_side_by_side([(f"w{i}", _sleep_then_clean_up, (str(m),)) for i, m in enumerate(markers)], jobs=2)
    finally:
        stop.set()
        signal.signal(signal.SIGINT, old_handler)
    assert [m.read_text() for m in markers] == ["finally ran"] * 2
    assert time.monotonic() - t0 < WORKER_SLEEP_S - 2  # the workers were stopped, not waited for


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_run_side_by_side_rejects_bad_jobs(jobs: Any) -> None:
    with pytest.raises(ValueError, match="jobs must be an integer >= 1"):
        run_side_by_side([("a", _square, (1,))], jobs=jobs)


# ---------------------------------------------------------------- routelab reproduce --jobs


def _toy_sweep(out_dir: Path, quick: bool) -> Path:
    print(f"training {out_dir.name}")
    report = out_dir / "report.md"
    report.write_text(f"# {out_dir.name}\n\nquick={quick}, pid={os.getpid()}\n", encoding="utf-8")
    return report


def _failing_sweep(out_dir: Path, quick: bool) -> Path:
    raise ValueError("this sweep always fails")


def test_reproduce_jobs_runs_experiments_in_workers_and_keeps_the_report_order(
    registry: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    for name in ("first", "second"):
        register(Experiment(name, f"Toy {name}.", _toy_sweep, False, True))
    register(Experiment("third", "Toy third.", _toy_sweep, False, True, quick_seconds=60.0))  # the costliest
    register(Experiment("broken", "Always fails.", _failing_sweep, False, True))

    def local(out_dir: Path, quick: bool) -> Path:  # not picklable: runs in this process
        return _toy_sweep(out_dir, quick)

    register(Experiment("local", "Defined in a function.", local, False, True))
    code = cli.main(["reproduce", "--quick", "--jobs", "2", "--out", str(tmp_path)])
    assert code == 1  # `broken` failed, the others ran
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    order = [report.index(f"## {n}") for n in ("first", "second", "third", "broken", "local")]
    assert order == sorted(order)
    pids = {int(line.split("pid=")[1]) for line in report.splitlines() if "pid=" in line}
    assert os.getpid() in pids and len(pids) >= 2  # workers, and `local` here
    assert "ValueError: this sweep always fails" in (tmp_path / "broken" / "error.txt").read_text(encoding="utf-8")
    captured = capfd.readouterr()
    assert "[first] training first" in captured.out
    started = [line.split(":")[0][3:] for line in captured.out.splitlines() if line.startswith("== ") and ":" in line]
    assert started[:4] == ["third", "first", "second", "broken"]  # the costliest first, then in order
    assert started[-1] == "local"
    assert "broken failed" in captured.err and "this sweep always fails" in captured.err
