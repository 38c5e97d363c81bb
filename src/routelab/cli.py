"""The ``routelab`` command.

Subcommands::

    routelab reproduce [NAME ...] [--quick] [--out DIR] [--fresh] [--allow-missing-data] [--jobs N]
                                                          run experiments, write DIR/report.md
    routelab bench assignment [--quick] [--threads N] [--device cpu|cuda] [--out FILE]
    routelab bench assignment --peers [--quick] [--threads N] [--out FILE]   vs POT, OR-Tools, scipy, auction
    routelab bench sinkhorn --peers [--quick] [--threads N] [--out FILE]     vs POT ot.sinkhorn (plain, log)
    routelab bench b-matching [--quick] [--threads N] [--out FILE]   k experts per token vs OR-Tools, scipy
    routelab bench moe [--quick] [--threads N] [--device cpu|cuda] [--dtype float32|bfloat16] [--d-model N ...]
                       [--experts E ...] [--k K ...] [--compile [MODE]] [--out FILE]
    routelab bench moe --world-size N [N ...] [--quick] [--out FILE]   expert parallel, gloo workers
    routelab list                                         list the registered experiments

Exit codes: 0 on success, 1 when an experiment could not run (the others still run; the report
and one ``routelab: error: ...`` line say which and why), 2 on a usage error (unknown
experiment, bad option), 130 when interrupted with Ctrl-C (finished runs stay recorded).
"""

from __future__ import annotations

import argparse
import difflib
import os
import pickle
import re
import sys
import tempfile
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import routelab
from routelab._checks import positive_int_arg
from routelab.data.errors import DataUnavailable
from routelab.experiments import registry
from routelab.experiments.kit.claims import CLAIMS_FILE
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.kit.lock import ResultsBusy, lock_results
from routelab.experiments.kit.provenance import software_line
from routelab.experiments.kit.scoreboard import committed_dir, scoreboard_markdown
from routelab.experiments.kit.store import ResultsFileError, atomic_write_text

__all__ = ["main", "build_parser"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # as a shell reports a process ended by Ctrl-C (128 + SIGINT)

BENCHMARKS: tuple[str, ...] = ("assignment", "b-matching", "moe", "sinkhorn")


# ---------------------------------------------------------------------------- helpers


def _error(message: str) -> int:
    """Print ``routelab: error: message`` to stderr and return the usage exit code."""
    print(f"routelab: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _run_assignment_benchmark(
    *, quick: bool, threads: int | None = None, device: str | None = None
) -> str:
    """Run the balanced-assignment benchmark, streaming progress to stdout.

    Returns:
        The benchmark's markdown table.
    """
    from routelab.bench.assignment import run_benchmark  # lazy: heavy, and optional here

    kwargs: dict[str, object] = {"quick": quick, "out": sys.stdout}
    if threads is not None:
        kwargs["threads"] = threads
    if device is not None:
        kwargs["device"] = device
    return run_benchmark(**kwargs)


def _demote_headings(markdown: str, levels: int = 2) -> str:
    """Push every ATX heading outside fenced code blocks ``levels`` deeper (at most ``######``).

    An experiment's report is embedded under a ``##`` section of the aggregated report, so its
    own ``#`` title becomes ``###``.
    """
    lines = []
    in_fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        elif not in_fence:
            match = re.match(r"(#{1,6})(?= |$)", line)
            if match:
                depth = min(len(match.group(1)) + levels, 6)
                line = "#" * depth + line[match.end():]
        lines.append(line)
    return "\n".join(lines)


# A link target is one token directly closed by ")" (or followed by a quoted title), so maths in
# prose such as "1[x<0.5](0.8x - 0.2)" is left alone.
_RELATIVE_LINK = re.compile(r'(\]\()(?![a-zA-Z][a-zA-Z0-9+.-]*:|/|#)([^)\s]+)(?=\)|\s+")')


def _rebase_links(markdown: str, prefix: str) -> str:
    """Prefix relative markdown link targets (``](fig.png)``) with ``prefix/``."""
    if prefix in ("", "."):
        return markdown
    return _RELATIVE_LINK.sub(lambda m: f"{m.group(1)}{prefix}/{m.group(2)}", markdown)


def _one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (whitespace collapsed), at most ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _out_dir(value: str) -> Path:
    """``--out DIR``: a non-empty path."""
    if not value.strip():
        raise argparse.ArgumentTypeError("needs a directory path, got an empty string (e.g. --out results)")
    return Path(value)


def _move_aside(exp_dir: Path) -> Path | None:
    """``--fresh``: rename a non-empty ``exp_dir`` to ``exp_dir.old-<UTC time>``; returns the new path."""
    if not exp_dir.exists() or not any(exp_dir.iterdir()):
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    target = exp_dir.with_name(f"{exp_dir.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = exp_dir.with_name(f"{exp_dir.name}.old-{stamp}-{n}")
    exp_dir.rename(target)
    return target


def _run_experiment(exp: Experiment, exp_dir: Path, quick: bool) -> tuple[Path | None, str, str]:
    """Run one experiment; never raises except on Ctrl-C.

    Returns:
        ``(report path, "", "")`` on success, else ``(None, kind, reason)``: kind ``"skipped"``
        (its data is not installed) or ``"failed"``; reason is one line that says what is wrong
        and how to fix it. The traceback of an unexpected error goes to ``exp_dir/error.txt``.
    """
    try:  # an earlier invocation's traceback must not sit beside this one's outcome
        (exp_dir / "error.txt").unlink(missing_ok=True)
    except OSError:
        pass
    try:
        report = Path(exp.run(exp_dir, quick))
        return report, "", ""
    except DataUnavailable as err:
        return None, "skipped", _one_line(f"its data is not installed: {err}")
    except ResultsFileError as err:  # (the message names the file, the line and the fix)
        return None, "failed", _one_line(f"cannot resume from its results: {err}{_write_traceback(exp_dir)}")
    except Exception as err:  # noqa: BLE001 - one experiment's bug must not stop the others
        where = _write_traceback(exp_dir)
        first = (str(err).strip().splitlines() or [""])[0]
        hint = ""
        if isinstance(err, KeyError) and any(exp_dir.glob("*.jsonl")):  # most likely a record without that field
            hint = (f" (a record in {exp_dir}/*.jsonl without the field {first}, from another version or edited? "
                    "`--fresh` moves the old results aside)")
        return None, "failed", _one_line(f"{type(err).__name__}: {first}{hint}{where}")


def _write_traceback(exp_dir: Path) -> str:
    """Write the exception being handled, with its traceback, to ``exp_dir/error.txt``; ``"; traceback in
    PATH"`` for the one-line reason (``""`` when it cannot be written)."""
    log = exp_dir / "error.txt"
    try:
        atomic_write_text(log, traceback.format_exc())
    except OSError:
        return ""
    return f"; traceback in {log}"


def _run_experiments(exps: Sequence[Experiment], out_dir: Path, quick: bool,
                     jobs: int) -> list[tuple[Path | None, str, str]]:
    """:func:`_run_experiment` for each of ``exps`` (in ``out_dir / name``), ``jobs`` at a time.

    With ``jobs > 1`` each experiment runs in its own worker process and its output lines carry
    the prefix ``[name]``; quick forms start in the order of their ``Experiment.quick_seconds``,
    the costliest first. An experiment whose run function cannot be sent to a worker (defined
    inside a function or in ``__main__``) runs in this process after the others.
    """
    def announce(exp: Experiment) -> None:
        print(f"== {exp.name}: {exp.description}", flush=True)

    outcomes: dict[str, tuple[Path | None, str, str]] = {}
    side_by_side = jobs > 1 and len(exps) > 1  # a single experiment needs no worker
    in_workers = [e for e in exps if side_by_side and _picklable(e)]
    if quick:  # the costliest first (a stable sort: unknown costs keep their order, last)
        in_workers.sort(key=lambda e: -e.quick_seconds)
    if in_workers:
        from routelab.experiments.kit.jobs import JobFailed, run_side_by_side  # lazy: multiprocessing

        calls = [(e.name, _run_experiment, (e, out_dir / e.name, quick)) for e in in_workers]
        print(f"== {len(in_workers)} experiments on {min(jobs, len(in_workers))} worker processes side by side "
              "(--jobs); each line starts with its experiment's name", flush=True)
        answers = run_side_by_side(calls, jobs, on_start=lambda i: announce(in_workers[i]))
        for exp, answer in zip(in_workers, answers, strict=True):
            if isinstance(answer, JobFailed):
                log = out_dir / exp.name / "error.txt"
                atomic_write_text(log, answer.error)
                lines = answer.error.strip().splitlines() or [""]
                # A worker killed by a signal leaves no traceback, only how it ended.
                what = "traceback" if len(lines) > 1 else "details"
                answer = (None, "failed", _one_line(f"{lines[-1]}; {what} in {log}"))
            outcomes[exp.name] = answer
    for exp in exps:
        if exp.name not in outcomes:
            if side_by_side:
                print(f"== {exp.name}: runs in this process (its run function cannot be sent to a worker)",
                      flush=True)
            announce(exp)
            outcomes[exp.name] = _run_experiment(exp, out_dir / exp.name, quick)
    return [outcomes[e.name] for e in exps]


def _picklable(exp: Experiment) -> bool:
    """Whether ``exp`` can be sent to a worker process (its run function importable by name)."""
    try:
        pickle.dumps(exp)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


def _report_header(quick: bool) -> list[str]:
    """The first lines of the aggregated report: what ran, where and when."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [
        "# routelab reproduce report",
        "",
        f"- mode: {'quick' if quick else 'full'}",
        f"- {software_line()} ({os.cpu_count()} CPUs)",
        f"- generated: {stamp}",
        "",
    ]


# ---------------------------------------------------------------------------- commands


def _cmd_reproduce(args: argparse.Namespace) -> int:
    """``routelab reproduce``: run the experiments, write the combined report."""
    experiments = registry.REGISTRY
    unknown = [name for name in args.names if name not in experiments]
    if unknown:
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
            name.replace("_", "-"), experiments, n=1, cutoff=0.6)) else repr(name) for name in unknown]
        return _error(f"unknown experiment(s): {', '.join(hints)} (valid names: {', '.join(sorted(experiments))}).")

    out_dir: Path = args.out
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return _error(f"cannot create the output directory {out_dir}: {err.strerror or err}; choose another --out.")
    lines = _report_header(args.quick)
    names = list(dict.fromkeys(args.names or experiments))  # de-duplicate, keep order
    locks = []
    try:
        for name in names:  # every directory locked before anything is moved or run
            locks.append(lock_results(out_dir / name, "routelab reproduce"))
        for name in names:
            exp_dir = out_dir / name
            if args.fresh and (old := _move_aside(exp_dir)) is not None:
                print(f"== {name}: --fresh: moved the earlier results aside to {old}", flush=True)
            exp_dir.mkdir(parents=True, exist_ok=True)
            (exp_dir / CLAIMS_FILE).unlink(missing_ok=True)  # an earlier invocation's: the scoreboard reads this run's
    except ResultsBusy as err:
        for lock in locks:
            lock.close()
        return _error(str(err))
    except OSError as err:
        for lock in locks:
            lock.close()
        where = f" {err.filename}" if err.filename else ""
        return _error(f"cannot prepare the results directory{where}: {err.strerror or err} (a file in the way?); "
                      "remove it or choose another --out.")
    try:
        return _reproduce_locked(args, names, out_dir, lines)
    finally:
        for lock in locks:
            lock.close()


def _reproduce_locked(args: argparse.Namespace, names: list[str], out_dir: Path, lines: list[str]) -> int:
    """The rest of :func:`_cmd_reproduce`, with the experiments' directories locked and prepared."""
    experiments = registry.REGISTRY
    not_run: list[tuple[str, str, str]] = []  # (name, "skipped" | "failed", reason)
    outcomes = _run_experiments([experiments[name] for name in names], out_dir, args.quick, args.jobs)
    sections: list[str] = []
    for name, (report_path, kind, reason) in zip(names, outcomes, strict=True):
        exp = experiments[name]
        if report_path is None:
            not_run.append((name, kind, reason))
            print(f"== {name}: {kind}: {reason}", file=sys.stderr, flush=True)
            sections += [f"## {name}", "", exp.description, "", f"**Not run ({kind}):** {reason}", ""]
            continue
        rel = Path(os.path.relpath(report_path, out_dir)).as_posix()
        body = report_path.read_text(encoding="utf-8")
        body = _rebase_links(body, Path(rel).parent.as_posix())
        sections += [
            f"## {name}",
            "",
            exp.description,
            "",
            f"Full report: [{rel}]({rel})",
            "",
            _demote_headings(body).strip(),
            "",
        ]
    lines += [scoreboard_markdown(names, out_dir, quick=args.quick, docs_dir=committed_dir(),
                                  not_run={n: f"{k}: {r}" for n, k, r in not_run})]
    if not_run:
        lines += [f"**{len(not_run)} of {len(names)} experiment(s) did not run**; the others ran and are "
                  "reported below.", "", "| experiment | status | reason and fix |", "|---|---|---|"]
        lines += [f"| {n} | {k} | {r.replace('|', '/')} |" for n, k, r in not_run]
        lines.append("")
    lines += sections

    report = atomic_write_text(out_dir / "report.md", "\n".join(lines))
    print(f"report: {report}", flush=True)
    if args.allow_missing_data:
        for name, _, reason in [x for x in not_run if x[1] == "skipped"]:
            print(f"routelab: warning: {name} skipped: {reason}", file=sys.stderr)
        not_run = [x for x in not_run if x[1] != "skipped"]
    if not not_run:
        return EXIT_OK
    if len(not_run) == 1:
        name, kind, reason = not_run[0]
        message = f"{name} {'was skipped' if kind == 'skipped' else 'failed'}: {reason}"
    else:  # one line still: the missing data sets by name, each failure with its reason
        skipped = [n for n, k, _ in not_run if k == "skipped"]
        parts = [f"{n} failed: {r}" for n, k, r in not_run if k != "skipped"]
        if skipped:
            parts.insert(0, f"{', '.join(skipped)} skipped: data not installed (run `make data`; what is "
                            "missing is listed in the report)")
        message = f"{len(not_run)} experiments did not run, the others did (see {report}): " + "; ".join(parts)
    print(f"routelab: error: {_one_line(message, limit=4000)}", file=sys.stderr)
    return EXIT_FAILED


def _cmd_bench(args: argparse.Namespace) -> int:
    """``routelab bench NAME``: run a benchmark, optionally saving its markdown table."""
    if args.benchmark == "b-matching" and args.device == "cuda":
        return _error("`routelab bench b-matching` runs on CPU (its peers are CPU solvers); for the GPU use "
                      "`routelab bench assignment --device cuda`.")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return _error("--device cuda was requested but torch.cuda.is_available() is False.")
    if args.world_size is not None and args.benchmark != "moe":
        return _error("--world-size applies to `routelab bench moe` only.")
    if args.peers and args.benchmark == "moe":
        return _error("--peers applies to `routelab bench assignment` and `routelab bench sinkhorn` "
                      "(`routelab bench b-matching` always times its peers).")
    if args.benchmark == "sinkhorn" and not args.peers:
        return _error("`routelab bench sinkhorn` compares with POT: run it with --peers.")
    if args.peers and args.device == "cuda":
        return _error("--peers runs on CPU (the peers are CPU solvers).")
    moe_only = {"--dtype": args.dtype, "--d-model": args.d_model, "--experts": args.experts, "--k": args.k,
                "--compile": args.compile}
    given = [flag for flag, value in moe_only.items() if value is not None]
    if given and (args.benchmark != "moe" or args.world_size is not None):
        verb = "applies" if len(given) == 1 else "apply"
        return _error(f"{', '.join(given)} {verb} to `routelab bench moe` (single process) only.")
    if args.benchmark == "moe" and args.world_size is not None and args.threads is not None:
        return _error("--threads does not apply with --world-size: each rank runs one thread.")
    if args.benchmark == "moe" and args.world_size is not None and args.device == "cuda":
        return _error("--world-size starts local gloo (CPU) workers; for GPUs use torchrun (see the README).")
    if args.benchmark == "moe" and args.world_size is None:
        from routelab.bench.moe import DTYPES, default_configs, select_configs, select_grid  # lazy: heavy

        try:  # the selection is checked before minutes of benchmark, not after
            configs = default_configs(quick=args.quick, device=args.device, dtype=DTYPES[args.dtype or "float32"])
            if args.d_model is not None:
                configs = select_configs(configs, args.d_model)
            select_grid(configs, args.experts, args.k)
        except ValueError as err:
            return _error(str(err))
    if args.benchmark == "moe" and args.world_size is not None:
        from routelab.bench.moe_parallel import benchmark_config  # lazy: imports the parallel layer

        try:  # a world size that does not divide the experts is refused before --out makes a directory
            benchmark_config(world_sizes=args.world_size, quick=args.quick)
        except ValueError as err:
            return _error(str(err))
    # --out last (it creates the table's directory): an invalid option leaves nothing behind, and an
    # unwritable table is found before a benchmark of minutes, not after it.
    if args.out is not None:
        problem = _unwritable_table_path(Path(args.out))
        if problem is not None:
            return _error(problem)
    if args.benchmark == "moe" and args.world_size is not None:
        from routelab.bench.moe_parallel import run_benchmark as run_moe_parallel  # lazy: starts workers

        text = run_moe_parallel(world_sizes=args.world_size, quick=args.quick, out=sys.stdout)
    elif args.benchmark == "moe":
        from routelab.bench.moe import run_benchmark as run_moe

        text = run_moe(quick=args.quick, threads=args.threads or 1, device=args.device, out=sys.stdout,
                       dtype=args.dtype or "float32",
                       d_models=args.d_model, experts=args.experts, ks=args.k, compile_mode=args.compile)
    elif args.benchmark == "b-matching":
        from routelab.bench.b_matching import FULL_SIZES, QUICK_SIZES, run_b_matching_benchmark  # lazy: scipy

        text = run_b_matching_benchmark(QUICK_SIZES if args.quick else FULL_SIZES, out=sys.stdout,
                                        threads=args.threads or 1)
    elif args.peers:
        from routelab.bench.peers import run_assignment_peers, run_sinkhorn_peers  # lazy: imports the peers

        run = run_sinkhorn_peers if args.benchmark == "sinkhorn" else run_assignment_peers
        text = run(quick=args.quick, threads=args.threads or 1, out=sys.stdout)
    else:
        text = _run_assignment_benchmark(quick=args.quick, threads=args.threads, device=args.device)
    if args.out is not None:
        try:
            path = atomic_write_text(args.out, text.rstrip("\n") + "\n")
        except OSError as err:  # changed while the benchmark ran: the table is printed above
            return _error(f"cannot write --out {args.out}: {err.strerror or err}; the table is printed above.")
        print(f"table: {path}")
    return EXIT_OK


def _unwritable_table_path(out: Path) -> str | None:
    """Why a table cannot be written at ``out`` (its directory created if missing), or None: a
    directory, a parent that is a file, or a directory that refuses a file (tried, then removed)."""
    if out.is_dir():
        return f"--out {out} is a directory; give a file path for the table (e.g. {out / 'bench.md'})."
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # (FileExistsError: a file in the way)
        return f"cannot create the directory of --out {out}: {err.strerror or err}; choose another."
    try:
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".routelab-probe-"):
            pass
    except OSError as err:
        return f"cannot write in the directory of --out {out}: {err.strerror or err}; choose another."
    return None


def _cmd_list(args: argparse.Namespace) -> int:
    """``routelab list``: print the registered experiments, one per line."""
    experiments = registry.REGISTRY
    width = max((len(name) for name in experiments), default=0)
    for name, exp in experiments.items():
        print(f"{name:<{width}}  {exp.description}")
    return EXIT_OK


# ---------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``routelab`` command."""
    parser = argparse.ArgumentParser(
        prog="routelab",
        description="Routing in mixtures of experts: reproduce experiments, run benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"routelab {routelab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    rep = sub.add_parser(
        "reproduce",
        help="run registered experiments and write DIR/report.md",
        description="Run the named experiments (all if none is named) and aggregate their "
        "reports into DIR/report.md. Finished runs are recorded as they end, so an interrupted "
        "call resumes. An experiment that cannot run (its data is not installed, its results file "
        "is corrupt, an error) does not stop the others: the report and one `routelab: error:` "
        "line say which and why, and the exit status is 1.",
    )
    rep.add_argument("names", nargs="*", metavar="NAME", help="experiments to run (default: all)")
    rep.add_argument("--quick", action="store_true", help="reduced sizes and seeds (minutes)")
    rep.add_argument(
        "--out", type=_out_dir, default=Path("results"), metavar="DIR",
        help="output directory (default: results)",
    )
    rep.add_argument(
        "--fresh", action="store_true",
        help="start the experiments over: move their earlier results in DIR/NAME aside to "
        "DIR/NAME.old-<time> (nothing is deleted) instead of resuming from them",
    )
    rep.add_argument(
        "--allow-missing-data", action="store_true",
        help="an experiment whose data is not installed is skipped with a warning and does not make "
        "the exit status nonzero (it is still listed in the report)",
    )
    rep.add_argument(
        "--jobs", type=positive_int_arg, default=1, metavar="N",
        help="run up to N experiments at once, each in its own process (default: 1; `make run` uses the number "
        "of CPU cores); their output lines start with the experiment's name",
    )
    rep.set_defaults(func=_cmd_reproduce)

    bench = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    bench.add_argument("benchmark", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    bench.add_argument(
        "--threads", type=positive_int_arg, default=None, metavar="N",
        help="torch intra-op threads for the timed calls (default: 1, the single-thread comparison with scipy)",
    )
    bench.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="device (default: cpu)"
    )
    bench.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None,
        help="moe only: dtype of weights, inputs and gradients (default: float32)",
    )
    bench.add_argument(
        "--d-model", type=positive_int_arg, nargs="+", default=None, metavar="N",
        help="moe only: measure only the grid's sizes with these d_model (e.g. one GPU size per call)",
    )
    bench.add_argument(
        "--experts", type=positive_int_arg, nargs="+", default=None, metavar="E",
        help="moe only: measure only the grid's sizes with these numbers of experts (default: all: 8 64)",
    )
    bench.add_argument(
        "--k", type=positive_int_arg, nargs="+", default=None, metavar="K",
        help="moe only: measure only these top-k values of the grid (default: all: 1 2)",
    )
    bench.add_argument(
        "--compile", nargs="?", const="default", default=None, metavar="MODE",
        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
        help="moe only: time the layer under torch.compile (MODE: default, reduce-overhead = CUDA graphs, "
        "max-autotune-no-cudagraphs) against the eager layer and transformers' compiled block, instead of the "
        "eager tables",
    )
    bench.add_argument(
        "--out", type=Path, default=None, metavar="FILE",
        help="also write the markdown table to FILE",
    )
    bench.add_argument(
        "--peers", action="store_true",
        help="assignment/sinkhorn: time routelab against POT, OR-Tools, scipy and the fairseq auction in the same "
        "run (install them with the `bench` extra; a missing one is reported)",
    )
    bench.add_argument(
        "--world-size", type=positive_int_arg, nargs="+", default=None, metavar="N",
        help="moe only: expert-parallel benchmark on N local gloo workers (several: 1 2 4), vs DeepSpeed if installed",
    )
    bench.set_defaults(func=_cmd_bench)

    lst = sub.add_parser("list", help="list the registered experiments")
    lst.set_defaults(func=_cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``routelab`` command.

    Args:
        argv: the arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 1 when an experiment could not run, 2 on a usage error,
        130 on Ctrl-C. (argparse's own usage errors raise ``SystemExit(2)``.)
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.command == "bench":  # benchmarks record nothing: the rows printed were measured, the rest not
            said = "nothing was written (--out is written at the end); the rows printed above were measured"
        else:
            said = ("every finished run is recorded (an experiment that trains in chunks, as kool-toy, loses the "
                    "chunk in progress), rerun the same command to resume")
        print(f"\nroutelab: interrupted; {said}.", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
