"""Reproduction of the toy experiment of Kool, Maddison & Mnih (2021), Sec. 3, 3.1 and App. E.

``routelab reproduce kool-toy [--quick] [--out DIR]`` trains a mixture of two linear experts with a
Bernoulli router on a discontinuous 1-D function, with the six routing estimators of
:func:`routelab.estimators.sample_routes`, REINFORCE or differentiable gating, over a sweep of
proposal temperatures and seeds, and checks the paper's claims from the results.

Layout:

* :mod:`.model` — data, the batched model (all runs of a chunk in one set of ``[R]`` parameters),
  training of one chunk;
* :mod:`.sweep` — the sweep's size (:data:`FULL`, :data:`QUICK`) and its chunks;
* :mod:`.marginals` — the Sec. 2.3 Sinkhorn vs Gumbel-Matching marginals check;
* :mod:`.claims` — success criteria and the paper's claims as testable functions;
* :mod:`.figures`, :mod:`.report` — the PNG figures, ``results.csv`` and ``report.md``;
* here — the registered ``EXPERIMENT`` and :func:`run_sweep`: each chunk is trained as one
  batched model; a finished chunk appends one JSON line per run to ``DIR/runs.jsonl``, and a
  rerun skips the chunks whose runs are all recorded. A run is identified with the chunk it was
  trained in (:func:`.sweep.record_key`), so the quick form and the full run, batched differently,
  can share ``runs.jsonl`` and each resumes from and reports only its own records.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch

from ..kit.claims import write_claims_json
from ..kit.experiment import Experiment
from ..kit.provenance import COMMIT, CommitStamp, load_average, routelab_version
from ..kit.store import append_jsonl_atomic, atomic_write_text, is_failed, read_jsonl, split_failed
from .claims import evaluate_claims
from .figures import FIGURES, draw_figures
from .gradients import gradient_check
from .marginals import marginals_check
from .model import CONFIGS, Config, RunSpec, make_data, train_chunk
from .parallel import ChunkResult, train_chunks
from .report import render_report, results_csv
from .sweep import FULL, QUICK, Chunk, Settings, log_taus, plan_chunks, planned_keys, record_key, run_key

__all__ = [
    "CONFIGS",
    "FIGURES",
    "FULL",
    "QUICK",
    "Chunk",
    "Config",
    "EXPERIMENT",
    "RunSpec",
    "Settings",
    "log_taus",
    "make_data",
    "marginals_check",
    "plan_chunks",
    "render_report",
    "run_sweep",
    "train_chunk",
    "write_outputs",
]


def run_sweep(
    out_dir: Path,
    settings: Settings,
    *,
    progress: bool = True,
    figures: bool = True,
    skip_chunks: Sequence[str] = (),
    skip_reason: str = "",
) -> Path:
    """Train every chunk not yet recorded in ``out_dir/runs.jsonl``, then write all outputs.

    A run counts as recorded only with the chunk ``settings`` plans it in (:func:`.sweep.record_key`):
    the other form's records of the same run (quick vs full: other batching, other sampling noise)
    stay in the file and are neither reused nor reported.

    A run that diverges (non-finite loss, parameters or router logits) is recorded as failed
    with its reason and the other runs of its chunk finish unchanged (:func:`.model.train_chunk`).
    A chunk that raises a ``ValueError`` from the library (e.g. a Sinkhorn call that does not
    converge) is recorded in ``errors.jsonl`` and reported; the other chunks go on, and a rerun
    retries it. Any other exception (and Ctrl-C) stops the sweep; finished chunks stay recorded.
    Worker processes die with this process, even when it is killed (:mod:`.parallel`).

    Args:
        out_dir: where runs.jsonl, results.csv, the figures and report.md go.
        settings: the sweep.
        progress: show a tqdm bar (chunks x steps) on stderr.
        figures: draw the PNG figures (tests switch them off for speed).
        skip_chunks: names of chunks (see :func:`plan_chunks`) not to train in this invocation,
            e.g. to fit a time budget; the report lists them with ``skip_reason``.
        skip_reason: why they were skipped (printed in the report).

    Returns:
        ``out_dir / "report.md"``.
    """
    t_start = time.perf_counter()
    started, load_start = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), load_average()
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_path = out_dir / "runs.jsonl"
    chunks = plan_chunks(settings)
    unknown = sorted(set(skip_chunks) - {c.name for c in chunks})
    if unknown:
        raise ValueError(f"unknown chunk(s) {unknown}; the chunks are {', '.join(c.name for c in chunks)}")
    recorded = read_jsonl(runs_path)
    done = {record_key(r) for r in recorded}
    stamp = CommitStamp("kool-toy")  # the commit on every record, a warning when resuming another's runs
    pending = [
        c for c in chunks
        if c.name not in skip_chunks and not all(run_key(r, c, settings.steps) in done for r in c.runs)
    ]
    errors: list[dict] = []
    old_threads = torch.get_num_threads()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)

    def record(done_chunk: ChunkResult) -> None:
        chunk = done_chunk.chunk
        if done_chunk.error is not None:
            rec = {"chunk": chunk.name, "error": done_chunk.error, "steps": settings.steps}
            errors.append(rec)
            append_jsonl_atomic(out_dir / "errors.jsonl", stamp(rec))
            print(f"kool-toy: chunk {chunk.name} failed: {done_chunk.error}", file=sys.stderr)
            return
        wanted = {r.key for r in chunk.runs if run_key(r, chunk, settings.steps) not in done}
        diverged = 0
        for res in done_chunk.results or []:
            if (res["config"], res["method"], res["tau"], res["seed"]) in wanted:
                res.update(chunk=chunk.name, chunk_wall_s=round(done_chunk.wall_s, 3))
                append_jsonl_atomic(runs_path, stamp(res))
                diverged += is_failed(res)
        if diverged:
            print(f"kool-toy: chunk {chunk.name}: {diverged} run(s) diverged and are recorded as failed "
                  "(see the report)", file=sys.stderr)
        append_jsonl_atomic(out_dir / "chunks.jsonl", {
            "chunk": chunk.name, "steps": settings.steps, "runs": len(chunk.runs),
            "wall_s": round(done_chunk.wall_s, 3),
            "timings_s": {k: round(v, 3) for k, v in done_chunk.timings.items()},
            "threads": settings.threads if settings.threads is not None else torch.get_num_threads(),
            "workers": workers, "routelab": routelab_version(), COMMIT: stamp.commit,
        })

    workers = settings.resolved_workers(len(pending))
    if pending:
        planned = set(planned_keys(settings))
        stamp.before_training([r for r in recorded if record_key(r) in planned])
    try:
        bar = _progress_bar(len(pending) * settings.steps, enabled=progress)
        try:
            if pending:
                bar.set_description(f"{len(pending)} chunks on {workers} worker(s)")
            train_chunks(pending, settings.steps, workers=workers, threads=settings.threads,
                         on_progress=bar.update, on_done=record, train=train_chunk)
        finally:
            bar.close()
        if pending:  # the invocations that trained: what the report gives as the training's wall time
            append_jsonl_atomic(out_dir / "invocations.jsonl", {
                "started": started, "wall_s": round(time.perf_counter() - t_start, 1), "steps": settings.steps,
                "chunks": [c.name for c in pending], "workers": workers, "load_start": load_start,
                "load_end": load_average(), "routelab": routelab_version(), COMMIT: stamp.commit})
        marginals = _marginals(out_dir, settings)
        gradients = _gradients(out_dir, settings)
    finally:
        torch.set_num_threads(old_threads)
    skipped = {name: skip_reason for name in skip_chunks}
    return write_outputs(out_dir, settings, marginals=marginals, gradients=gradients, errors=errors,
                         wall_s=time.perf_counter() - t_start, figures=figures, skipped=skipped)


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, s: str) -> None: ...
    def close(self) -> None: ...


def _progress_bar(total: int, enabled: bool):
    if not enabled or total == 0:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="step", file=sys.stderr, mininterval=1.0, dynamic_ncols=True)


def _marginals(out_dir: Path, settings: Settings) -> list[dict] | None:
    """Run the marginals check (or reuse ``marginals.json`` written by an identical earlier call)."""
    if not settings.marginal_ns:
        return None
    spec = {"ns": list(settings.marginal_ns), "matrices": settings.marginal_matrices,
            "samples": settings.marginal_samples}
    path = out_dir / "marginals.json"
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("spec") == spec:
            return old["rows"]
    rows = marginals_check(settings.marginal_ns, matrices=settings.marginal_matrices,
                           samples=settings.marginal_samples)
    atomic_write_text(path, json.dumps({"spec": spec, "rows": rows}, indent=1))
    return rows


def _gradients(out_dir: Path, settings: Settings) -> list[dict] | None:
    """Claim 2's expected-gradient check (or reuse ``gradients.json`` from an identical earlier call)."""
    if not (settings.gradient_seeds and settings.gradient_taus):
        return None
    groups = 8
    spec = {"seeds": list(settings.gradient_seeds), "taus": list(settings.gradient_taus),
            "copies": settings.gradient_copies, "groups": groups}
    path = out_dir / "gradients.json"
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("spec") == spec:
            return old["rows"]
    rows = gradient_check(settings.gradient_seeds, settings.gradient_taus,
                          copies=max(1, settings.gradient_copies // groups), groups=groups)
    atomic_write_text(path, json.dumps({"spec": spec, "rows": rows}, indent=1))
    return rows


# ----------------------------------------------------------------------------- outputs


def write_outputs(
    out_dir: Path,
    settings: Settings,
    *,
    marginals: list[dict] | None = None,
    gradients: list[dict] | None = None,
    errors: Sequence[dict] = (),
    wall_s: float | None = None,
    figures: bool = True,
    skipped: dict[str, str] | None = None,
) -> Path:
    """Write results.csv, the figures and report.md from the records in ``out_dir/runs.jsonl`` of the runs
    ``settings`` plans, trained in the chunks it plans them in (:func:`.sweep.record_key`; the other form's
    records are left out and counted in the report), and the ``chunks.jsonl`` / ``invocations.jsonl``
    entries of those chunks.

    Failed runs (diverged; ``status: "failed"``) are rows of results.csv with their reason, are
    left out of the figures, count as unsuccessful seeds in the success tables, and are listed
    with their reasons in the report."""
    order = {k: i for i, k in enumerate(planned_keys(settings))}
    everything = read_jsonl(out_dir / "runs.jsonl")
    records = [r for r in everything if record_key(r) in order]
    records.sort(key=lambda r: order[record_key(r)])
    names = {c.name for c in plan_chunks(settings)}
    chunks = [
        c for c in read_jsonl(out_dir / "chunks.jsonl") if c.get("chunk") in names and c.get("steps") == settings.steps
    ]
    invocations = [i for i in read_jsonl(out_dir / "invocations.jsonl")
                   if i.get("steps") == settings.steps and set(i.get("chunks", ())) <= names]
    atomic_write_text(out_dir / "results.csv", results_csv(records))

    if figures:
        draw_figures(out_dir, split_failed(records)[0], marginals)
    if gradients is None and (out_dir / "gradients.json").exists():  # re-rendered from the records
        gradients = json.loads((out_dir / "gradients.json").read_text(encoding="utf-8"))["rows"]
    text = render_report(settings, records, marginals=marginals, gradients=gradients, errors=errors, wall_s=wall_s,
                         n_planned=len(order), skipped=skipped or {}, chunks=chunks, invocations=invocations,
                         unused=len(everything) - len(records))
    write_claims_json(out_dir, evaluate_claims(records, marginals, gradients), experiment="kool-toy",
                      paper="Kool et al. 2021", quick=settings.quick)
    return atomic_write_text(out_dir / "report.md", text)


EXPERIMENT = Experiment(
    "kool-toy",
    ("Kool, Maddison & Mnih (2021), Sec. 3 / App. E toy experiment: capacity-constrained "
     "routing estimators (Fig. 2, Fig. 3), balance losses, Sinkhorn vs Gumbel-Matching marginals."
    ),
    run_sweep,
    FULL,
    QUICK,
    quick_seconds=270,  # measured 2026-11-25 on this project's 2-core machine
)
"""The registered experiment (``routelab reproduce kool-toy``)."""
