"""Reproduction of Peng et al. (2020), "A Mixture of h - 1 Heads is Better than h Heads" (MAE).

``routelab reproduce mae [--quick] [--out DIR]`` trains a small decoder-only transformer
language model on the English side of the Spanish-English parallel Bible (Old Testament) in
five variants (BASE, MAE-7, MAE-6, UNI-MAE-7, NOBCD) with :class:`routelab.layers.bcd.BCDTrainer`,
runs the analyses of Sec. 5.1 / App. C (gate entropy, attribution of instances to experts, the
top-expert-only drop, indicative tokens by PMI), fine-tunes MAE-7 on the New Testament (FTG,
FTG+, FTALL; Sec. 5.2), and writes the report with the learning curves (App. B).

Why a language model and not translation: on 1 CPU core in 30 minutes for five variants plus
fine-tuning, an encoder-decoder plus beam/greedy decoding for BLEU leaves each variant a
minute or two of training, and BLEU of such tiny models is too coarse to separate variants;
a decoder LM spends all of its budget on training and perplexity is a smooth score.

Layout: :mod:`.corpus` (tokens, splits), :mod:`.model` (the LM), :mod:`.train` (variants,
fine-tuning, checkpoints), :mod:`.analyses` (Sec. 5.1), :mod:`.report` (claims, figures,
``report.md``); here, the ``EXPERIMENT`` and :func:`run` (resumable: finished runs are
lines of ``runs.jsonl`` / ``analyses.jsonl`` / ``finetune.jsonl``, trained models are kept under
``models/``, and an interrupted training resumes from its last epoch's checkpoint).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from routelab.data.parallel_text import load_parallel_text, pairs_fingerprint
from routelab.layers.bcd import EVAL_ROUTING

from ..kit.data_stamp import DataStamp
from ..kit.divergence import RunDiverged, train_or_fail
from ..kit.experiment import Experiment
from ..kit.failed_runs import add_failures_to_report
from ..kit.provenance import CommitStamp
from ..kit.store import append_jsonl_atomic, failed_record, is_failed, read_jsonl, split_failed
from .analyses import attribution_shares, collect_gates, mean_entropy, pmi_tokens
from .corpus import build_corpus
from .model import LMConfig, TransformerLM
from .train import FINETUNE_METHODS, VARIANTS, Schedule, _log, evaluate, finetune, train_variant

__all__ = ["FULL", "QUICK", "EXPERIMENT", "Settings", "run", "run_name"]

_GATED = ("MAE-7", "MAE-6", "NOBCD")  # the variants with a learned gate (and a gate lr)


@dataclass(frozen=True)
class Settings:
    """Size of one run of the experiment.

    Attributes:
        vocab, dim, heads, layers, ffn, seq, gate_hidden, gate_context: the LM (:class:`LMConfig`).
        schedule: training of each variant (its ``seed`` and ``gate_lr`` are set per run).
        seeds: paired seeds: every variant in ``multi_seed`` is trained once per seed, from the
            same initial weights of the shared parameters and on the same batches.
        gate_lrs: the gate SGD learning rates tried; MAE-7 is trained at ``seeds[0]`` with each and
            the one with the lowest dev perplexity among those whose gates did not collapse (see
            ``collapse``) is used for every gated run (one value: no selection).
        variants: the variants trained (names of :data:`~.train.VARIANTS`).
        multi_seed: the variants trained at every seed; the others at ``seeds[0]`` only.
        scale_dims: larger model widths (``dim``; ``ffn = 4 dim``, ``gate_hidden = dim``, same
            heads) at which ``scale_variants`` are trained at ``seeds[0]``, to see whether the gap
            to BASE closes as the model grows.
        ft_lr: Adam learning rate of fine-tuning (theta); the gates keep the selected gate lr.
        ft_epochs: fine-tuning epochs (full passes over the subset) per data fraction; () skips
            fine-tuning.
        train_limit: use only the first ``train_limit`` training windows.
        uni_runs: random-expert evaluations of UNI-MAE-7 averaged (paper: 5).
        pmi_min_count: tokens rarer than this are left out of the PMI ranking.
        collapse: a layer's gates have collapsed when the expert with the largest mean
            responsibility gets at least this much of it on average (rich get richer).
    """

    vocab: int = 3000
    dim: int = 32
    heads: int = 8
    layers: int = 2
    ffn: int = 128
    seq: int = 64
    gate_hidden: int = 32
    gate_context: int = 32
    schedule: Schedule = field(default_factory=lambda: Schedule(epochs=8, batches_per_epoch=50, batch=16, warmup=40))
    seeds: tuple[int, ...] = (0, 1, 2)
    gate_lrs: tuple[float, ...] = (1.0, 10.0, 30.0, 100.0, 1000.0)
    variants: tuple[str, ...] = tuple(v.name for v in VARIANTS)
    multi_seed: tuple[str, ...] = ("BASE", "MAE-7", "UNI-MAE-7", "NOBCD")
    scale_dims: tuple[int, ...] = (64,)
    scale_variants: tuple[str, ...] = ("BASE", "MAE-7", "UNI-MAE-7")
    ft_lr: float = 5e-4
    ft_epochs: tuple[tuple[float, int], ...] = ((0.1, 6), (1.0, 1))
    train_limit: int | None = None
    uni_runs: int = 5
    pmi_min_count: int = 20
    collapse: float = 0.9
    quick: bool = False

    def lm_config(self, vocab: int, dim: int | None = None) -> LMConfig:
        """The LM at this width (default ``self.dim``; a scaled width scales ffn and the gate)."""
        if dim is None or dim == self.dim:
            return LMConfig(vocab=vocab, dim=self.dim, heads=self.heads, layers=self.layers,
                            ffn=self.ffn, seq=self.seq, gate_hidden=self.gate_hidden,
                            gate_context=self.gate_context)
        return LMConfig(vocab=vocab, dim=dim, heads=self.heads, layers=self.layers, ffn=4 * dim,
                        seq=self.seq, gate_hidden=dim, gate_context=self.gate_context)


FULL = Settings()
QUICK = Settings(
    seeds=(0, 1, 2), gate_lrs=(30.0,), variants=("MAE-7", "UNI-MAE-7"), scale_dims=(), ft_epochs=(),
    quick=True,
)
"""The quick form: the full run's cells of MAE-7 (at the gate lr the full run selected on dev) and
UNI-MAE-7 at every seed, at full length, so that its verdicts on the headline claims (MAE-7 vs
UNI-MAE-7, learned vs uniform gates, gate entropy, attribution balance, top-1 drop) are decided
over the same paired seeds as the full run's; no selection, no BASE / NOBCD / MAE-6, no fine-tuning,
no larger model (6 runs, about 2.7 minutes on one core of this project's 2-core machine)."""


def run_name(variant: str, seed: int, gate_lr: float | None, dim: int, main_dim: int) -> str:
    """The file name of a run's model and checkpoint, e.g. ``MAE-7_s0_g100`` or ``BASE_s1_d64``."""
    name = f"{variant}_s{seed}"
    if gate_lr is not None:
        name += f"_g{gate_lr:g}"
    return name if dim == main_dim else f"{name}_d{dim}"


def _windows_subset(w: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    n = max(1, int(round(frac * w.shape[0])))
    perm = torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(seed))
    return w[perm[:n]]


def _key(variant: str, seed: int, gate_lr: float | None, dim: int) -> tuple[str, int, float | None, int]:
    return (variant, seed, gate_lr, dim)


def _rec_key(r: dict[str, Any]) -> tuple[str, int, float | None, int]:
    return _key(r["variant"], r["seed"], r.get("gate_lr"), r["dim"])


def run(out_dir: Path, s: Settings) -> Path:
    """Select the gate lr, train the variants over the seeds (and larger models), run the analyses
    and fine-tuning, write the report (resumable).

    Order: (1) MAE-7 at ``seeds[0]`` for every gate lr, the lr with the lowest dev perplexity
    among those whose gates did not collapse chosen (:func:`_select_gate_lr`); (2) every variant
    at every seed (``multi_seed``) or at ``seeds[0]``; (3) the larger models; (4) the analyses per
    trained model; (5) fine-tuning of ``seeds[0]``'s MAE-7.

    A run that diverges is recorded as failed (with the reason) in ``runs.jsonl`` /
    ``finetune.jsonl``; the other runs still train. The analyses and claims compare the variants,
    so with a failed run the report gives the scores of the others and the failures only.

    Raises:
        DataUnavailable: the parallel text is not installed (``routelab reproduce`` reports
            the experiment as skipped, with the install command).
    """
    from .report import write_failed_report, write_report  # lazy: matplotlib

    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    pairs = load_parallel_text()  # DataUnavailable (with the install command) if not installed
    corpus = build_corpus(pairs, s.vocab, s.seq)
    train = corpus.windows["train"]
    if s.train_limit is not None:
        train = train[: s.train_limit]
    dev, test = corpus.windows["dev"], corpus.windows["test"]
    variants = {v.name: v for v in VARIANTS}
    unknown = [n for n in s.variants if n not in variants]
    if unknown or not s.seeds or not s.gate_lrs:
        raise ValueError(f"Settings.variants must name variants of {tuple(variants)} (got unknown {unknown}); "
                         f"seeds and gate_lrs must not be empty.")
    runs_path = out_dir / "runs.jsonl"
    # the text of every recorded run must be this one (a refusal when it changed, a warning for unstamped runs)
    data = DataStamp("mae", pairs_fingerprint(pairs), runs_path)
    data.check([*read_jsonl(runs_path), *read_jsonl(out_dir / "finetune.jsonl")])
    from_records = _render_from_records(out_dir, s, corpus, t_start)
    if from_records is not None:
        return from_records
    commit = CommitStamp("mae")  # the commit on every record written, a warning when resuming another's runs

    def stamp(record: dict[str, Any]) -> dict[str, Any]:
        return data(commit(record))

    models_dir, ckpt_dir = out_dir / "models", out_dir / "checkpoints"
    models_dir.mkdir(exist_ok=True)
    done = {_rec_key(r): r for r in read_jsonl(runs_path)}
    models: dict[tuple[str, int, float | None, int], TransformerLM] = {}

    def train_one(name: str, seed: int, gate_lr: float | None, dim: int) -> None:
        key = _key(name, seed, gate_lr, dim)
        v = variants[name]
        cfg = replace(s.lm_config(corpus.vocab, dim), drop_heads=v.drop_heads)
        label = run_name(name, seed, gate_lr, dim, s.dim)
        path = models_dir / f"{label}.pt"
        if key in done and is_failed(done[key]):
            return
        if key in done and path.exists():
            model = TransformerLM(cfg)
            model.load_state_dict(torch.load(path, weights_only=True))
            models[key] = model.eval()
            return
        sched = replace(s.schedule, seed=seed, gate_lr=gate_lr if gate_lr is not None else s.schedule.gate_lr)
        commit.before_training(done.values())
        _log(f"training {label} ({v.mode}, drop_heads={v.drop_heads})")
        ident = {"variant": name, "seed": seed, "gate_lr": gate_lr, "dim": dim, "mode": v.mode,
                 "drop_heads": v.drop_heads}
        try:
            model, state = train_variant(v, cfg, train, dev, sched, ckpt_dir, label)
        except RunDiverged as err:
            rec = stamp(failed_record(ident, err.reason, err.step))
            append_jsonl_atomic(runs_path, rec)
            done[key] = rec
            _log(f"{label}: FAILED, {err.reason}")
            return
        routing = EVAL_ROUTING[v.mode]
        gated = routing == "gate"  # the gates are part of the model only where it uses them
        dev_loss, test_loss = evaluate(model, dev, routing), evaluate(model, test, routing)
        gate_params = sum(p.numel() for b in model.blocks for p in b.attn.gate.parameters())
        total_params = sum(p.numel() for p in model.parameters())
        torch.save(model.state_dict(), path)
        rec = {**ident, "experts": model.blocks[0].attn.num_experts,
               "dev_loss": dev_loss, "test_loss": test_loss,
               "dev_ppl": math.exp(dev_loss), "test_ppl": math.exp(test_loss),
               "params": total_params if gated else total_params - gate_params,
               "gate_params": gate_params if gated else 0, "steps": state["steps"],
               "curve": state["curve"], "seconds": state["seconds"]}
        append_jsonl_atomic(runs_path, stamp(rec))
        done[key] = rec
        models[key] = model
        _log(f"{label}: dev ppl {rec['dev_ppl']:.2f}, test ppl {rec['test_ppl']:.2f}, G steps {state['steps']['g']}")

    an_path = out_dir / "analyses.jsonl"
    analyses = {(r["variant"], r["seed"], r.get("gate_lr")): r for r in read_jsonl(an_path)
                if r.get("name") == "model"}

    def analyse(key: tuple[str, int, float | None, int]) -> None:
        name, seed, lr, dim = key
        if key not in models or dim != s.dim or (name, seed, lr) in analyses or name == "BASE":
            return
        _log(f"analyses of {run_name(name, seed, lr, dim, s.dim)}")
        arec = _analyse(models[key], name, dev, test, s)
        arec.update({"name": "model", "variant": name, "seed": seed, "gate_lr": lr})
        append_jsonl_atomic(an_path, stamp(arec))
        analyses[(name, seed, lr)] = arec

    # ---- 1. the gate learning rate, chosen on dev (MAE-7, first seed) among the uncollapsed ones
    seed0 = s.seeds[0]
    if "MAE-7" in s.variants:
        for lr in s.gate_lrs:
            train_one("MAE-7", seed0, lr, s.dim)
            analyse(_key("MAE-7", seed0, lr, s.dim))
    chosen = _select_gate_lr(
        [done[k] for lr in s.gate_lrs if (k := _key("MAE-7", seed0, lr, s.dim)) in done],
        {lr: a for (n, sd, lr), a in analyses.items() if n == "MAE-7" and sd == seed0}, s.gate_lrs[0])

    # ---- 2. every variant, paired seeds (Tables 2-4, App. B); 3. larger models
    for key in _plan(s, chosen):
        train_one(*key)

    failed_runs = [r for r in done.values() if is_failed(r)]
    if failed_runs:  # the analyses, fine-tuning and claims compare the variants
        return write_failed_report(out_dir, s, list(done.values()), time.perf_counter() - t_start)

    # ---- 4. analyses of Sec. 5.1 / App. C on the dev set, per trained model of the main width
    for key in sorted(models, key=str):
        analyse(key)
    pmi_rec = next((r for r in read_jsonl(an_path) if r.get("name") == "pmi" and r.get("gate_lr") == chosen), None)
    main_key = _key("MAE-7", seed0, chosen, s.dim)
    if pmi_rec is None and main_key in models:
        tokens, gates = collect_gates(models[main_key], torch.cat([dev, test]))
        pmi_rec = {"name": "pmi", "seed": seed0, "gate_lr": chosen,
                   "pmi": [pmi_tokens(tokens, g, corpus.itos, min_count=s.pmi_min_count) for g in gates]}
        append_jsonl_atomic(an_path, stamp(pmi_rec))

    # ---- 5. transfer (Sec. 5.2): pretrained on the Old Testament, fine-tuned on the New
    ft_path = out_dir / "finetune.jsonl"
    ft_done = {(r["method"], r["fraction"]): r for r in read_jsonl(ft_path) if r.get("gate_lr") == chosen}
    base_key = _key("BASE", seed0, None, s.dim)
    if s.ft_epochs and main_key in models and base_key in models:
        nt_dev, nt_test = corpus.windows["nt_dev"], corpus.windows["nt_test"]
        if ("NOFT", 0.0) not in ft_done:
            for key, method, routing in ((main_key, "NOFT", "gate"), (base_key, "NOFT-BASE", "uniform")):
                r = {"method": method, "fraction": 0.0, "gate_lr": chosen,
                     "best_dev_loss": evaluate(models[key], nt_dev, routing),
                     "test_loss_at_best": evaluate(models[key], nt_test, routing),
                     "best_step": 0, "updated_params": 0, "curve": []}
                append_jsonl_atomic(ft_path, stamp(r))
                ft_done[(method, 0.0)] = r
        sched = replace(s.schedule, seed=seed0, gate_lr=chosen)
        for frac, epochs in s.ft_epochs:
            sub = _windows_subset(corpus.windows["nt_train"], frac, sched.seed + 5)
            bpe = max(1, math.ceil(sub.shape[0] / sched.batch))
            ft_sched = replace(sched, epochs=epochs, batches_per_epoch=bpe, lr=s.ft_lr,
                               warmup=min(sched.warmup, bpe))
            for method in FINETUNE_METHODS:
                if (method, frac) in ft_done:
                    continue
                commit.before_training([*done.values(), *ft_done.values()])
                _log(f"fine-tuning MAE-7 with {method} on {frac:.0%} of the New Testament windows")
                key = {"method": method, "fraction": frac, "windows": int(sub.shape[0]), "gate_lr": chosen}
                r = train_or_fail(lambda: finetune(models[main_key], method, sub, nt_dev, nt_test, ft_sched,
                                                   ckpt_dir, f"{method}_{frac}_g{chosen:g}"), key,
                                  on_fail=lambda why: _log(f"fine-tuning {method} on {frac:.0%}: FAILED, {why}"))
                r.update(key)
                append_jsonl_atomic(ft_path, stamp(r))
                ft_done[(method, frac)] = r

    elapsed = time.perf_counter() - t_start
    ft_ok, ft_failed = split_failed(ft_done.values())
    report = write_report(out_dir, s, corpus, list(done.values()), list(analyses.values()), pmi_rec,
                          ft_ok, chosen, elapsed)
    return add_failures_to_report(report, ft_failed, len(ft_done), ("method", "fraction"))


def _plan(s: Settings, chosen: float) -> list[tuple[str, int, float | None, int]]:
    """The runs of steps 2 and 3 of :func:`run` at the chosen gate lr: every variant at every seed of
    ``multi_seed`` (else at ``seeds[0]``), then the larger models at ``seeds[0]``."""
    seed0 = s.seeds[0]
    plan = [_key(name, seed, chosen if name in _GATED else None, s.dim)
            for seed in s.seeds for name in s.variants if seed == seed0 or name in s.multi_seed]
    plan += [_key(name, seed0, chosen if name in _GATED else None, dim)
             for dim in s.scale_dims for name in s.scale_variants]
    return plan


def _render_from_records(out_dir: Path, s: Settings, corpus: Any, t_start: float) -> Path | None:
    """The report written from ``out_dir``'s records alone, when they hold everything it reads (every
    planned run, none failed, the analyses of every gated model of the main width, the PMI record and
    every fine-tuning record), else None.

    The trained models are not committed (``models/`` is large), and :func:`run` retrains a recorded
    run whose model file is missing: without this a rerun of a finished experiment, meant to re-render
    its report after a change to the report's code, would retrain every model.
    """
    from .report import write_report  # lazy: matplotlib

    done = {_rec_key(r): r for r in read_jsonl(out_dir / "runs.jsonl")}
    records = read_jsonl(out_dir / "analyses.jsonl")
    analyses = {(r["variant"], r["seed"], r.get("gate_lr")): r for r in records if r.get("name") == "model"}
    seed0 = s.seeds[0]
    candidates = [_key("MAE-7", seed0, lr, s.dim) for lr in s.gate_lrs] if "MAE-7" in s.variants else []
    if not candidates or any(k not in done for k in candidates):
        return None
    chosen = _select_gate_lr([done[k] for k in candidates],
                             {lr: a for (n, sd, lr), a in analyses.items() if n == "MAE-7" and sd == seed0},
                             s.gate_lrs[0])
    needed = [*candidates, *_plan(s, chosen)]
    if any(k not in done or is_failed(done[k]) for k in needed):
        return None
    if any((name, seed, lr) not in analyses for name, seed, lr, dim in needed if dim == s.dim and name != "BASE"):
        return None
    pmi = next((r for r in records if r.get("name") == "pmi" and r.get("gate_lr") == chosen), None)
    if pmi is None:
        return None
    ft = [r for r in read_jsonl(out_dir / "finetune.jsonl") if r.get("gate_lr") == chosen]
    if s.ft_epochs:
        have = {(r["method"], r["fraction"]) for r in ft}
        wanted = {("NOFT", 0.0), ("NOFT-BASE", 0.0)} | {(m, f) for f, _ in s.ft_epochs for m in FINETUNE_METHODS}
        if not wanted <= have:
            return None
    _log("every run, analysis and fine-tuning is recorded: the report is written from the records")
    ft_ok, ft_failed = split_failed(ft)
    report = write_report(out_dir, s, corpus, list(done.values()), list(analyses.values()), pmi, ft_ok, chosen,
                          time.perf_counter() - t_start)
    return add_failures_to_report(report, ft_failed, len(ft), ("method", "fraction"))


def _select_gate_lr(candidates: list[dict[str, Any]], analyses: dict[float, dict[str, Any]], default: float) -> float:
    """The gate lr with the lowest dev loss among the candidate runs whose gates did not collapse
    (the paper tunes away from the rich-get-richer degeneracy, Sec. 3 fn. 4); if every candidate
    collapsed (or has no analysis), the lowest dev loss among all; ``default`` without candidates."""
    ok = [r for r in candidates if not is_failed(r)]
    if not ok:
        return default
    alive = [r for r in ok if r["gate_lr"] in analyses and not analyses[r["gate_lr"]]["collapse"]["collapsed"]]
    return min(alive or ok, key=lambda r: r["dev_loss"])["gate_lr"]


def _analyse(model: TransformerLM, name: str, dev: torch.Tensor, test: torch.Tensor, s: Settings) -> dict[str, Any]:
    """Sec. 5.1 / App. C of one trained model on dev: gate entropy, attribution shares, spread,
    collapse, the top-expert-only drop (Table 5) and the "MAE with uniform gates" diagnostic.

    UNI-MAE-7 has no gate: its responsibilities are the constant ``1/E`` (entropy ``ln E``) and its
    single-expert score is a uniformly random expert per position, averaged over ``s.uni_runs``.
    """
    rec: dict[str, Any] = {}
    if name == "UNI-MAE-7":
        e = model.blocks[0].attn.num_experts
        rec["entropy"] = {"mean": math.log(e), "per_layer": [math.log(e)] * len(model.blocks), "uniform": math.log(e)}
        mix = evaluate(model, dev, "uniform")
        runs = [math.exp(evaluate(model, dev, "uniform_sample", generator=torch.Generator().manual_seed(100 + i)))
                for i in range(s.uni_runs)]
        rec["top1"] = {"mixture_ppl": math.exp(mix), "single_ppl": sum(runs) / len(runs), "single_runs": runs,
                       "single": f"random expert, mean of {len(runs)} runs"}
        return rec
    gates = collect_gates(model, dev)[1]
    mean, per_layer = mean_entropy(gates)
    rec["entropy"] = {"mean": mean, "per_layer": per_layer, "uniform": math.log(gates[0].shape[-1])}
    rec["shares"] = [attribution_shares(g) for g in gates]
    rec["spread"] = [{"mean_max": float(g.amax(-1).mean()), "mean_min": float(g.amin(-1).mean()),
                      "uniform": 1.0 / g.shape[-1]} for g in gates]
    top_mass = [float(g.reshape(-1, g.shape[-1]).mean(0).max()) for g in gates]
    rec["collapse"] = {"top_mass": top_mass, "collapsed": any(m >= s.collapse for m in top_mass)}
    mix, top = evaluate(model, dev, "gate"), evaluate(model, dev, "top1")
    rec["top1"] = {"mixture_ppl": math.exp(mix), "single_ppl": math.exp(top), "single": "top expert"}
    rec["uniform_gates"] = {"dev_ppl": math.exp(evaluate(model, dev, "uniform")),
                            "test_ppl": math.exp(evaluate(model, test, "uniform"))}
    return rec


EXPERIMENT = Experiment(
    "mae",
    ("Peng et al. (2020) mixture of attentive experts trained by block coordinate descent: "
     "BASE / MAE-7 / MAE-6 / UNI-MAE-7 / NOBCD language models (Tables 2-5, 8), gate analyses "
     "(Sec. 5.1), gate fine-tuning (Sec. 5.2), learning curves (App. B)."
    ),
    run,
    FULL,
    QUICK,
    quick_seconds=160,  # measured 2026-11-25 on this project's 2-core machine
)
"""The registered experiment (``routelab reproduce mae``)."""
