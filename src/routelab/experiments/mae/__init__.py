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

from routelab.data.parallel_text import load_parallel_text
from routelab.layers.bcd import EVAL_ROUTING
from routelab.layers.mae import set_routing

from ..kit.divergence import RunDiverged, train_or_fail
from ..kit.experiment import Experiment
from ..kit.failed_runs import add_failures_to_report
from ..kit.store import append_jsonl_atomic, failed_record, is_failed, read_jsonl, split_failed
from .analyses import attribution_shares, collect_gates, mean_entropy, pmi_tokens
from .corpus import build_corpus
from .model import LMConfig, TransformerLM
from .train import FINETUNE_METHODS, VARIANTS, Schedule, _log, evaluate, finetune, train_variant

__all__ = ["FULL", "QUICK", "EXPERIMENT", "Settings", "run"]


@dataclass(frozen=True)
class Settings:
    """Size of one run of the experiment.

    Attributes:
        vocab, dim, heads, layers, ffn, seq, gate_hidden, gate_context: the LM (:class:`LMConfig`).
        schedule: training of each variant.
        ft_lr: Adam learning rate of fine-tuning (theta); the gates keep ``schedule.gate_lr``.
        ft_epochs: fine-tuning epochs (full passes over the subset) per data fraction.
        train_limit: use only the first ``train_limit`` training windows (quick form).
        uni_runs: random-expert evaluations of UNI-MAE-7 averaged (paper: 5).
        pmi_min_count: tokens rarer than this are left out of the PMI ranking.
    """

    vocab: int = 3000
    dim: int = 64
    heads: int = 8
    layers: int = 2
    ffn: int = 256
    seq: int = 64
    gate_hidden: int = 64
    gate_context: int = 32
    schedule: Schedule = field(default_factory=Schedule)
    ft_lr: float = 5e-4
    ft_epochs: tuple[tuple[float, int], ...] = ((0.1, 6), (1.0, 1))
    train_limit: int | None = None
    uni_runs: int = 5
    pmi_min_count: int = 20
    quick: bool = False

    def lm_config(self, vocab: int) -> LMConfig:
        return LMConfig(vocab=vocab, dim=self.dim, heads=self.heads, layers=self.layers,
                        ffn=self.ffn, seq=self.seq, gate_hidden=self.gate_hidden,
                        gate_context=self.gate_context)


FULL = Settings()
QUICK = Settings(
    vocab=1500, dim=32, heads=8, layers=1, ffn=64, seq=32, gate_hidden=32, gate_context=16,
    schedule=Schedule(epochs=5, batches_per_epoch=12, batch=16, warmup=10, g_every=2),
    ft_epochs=((0.05, 2), (0.2, 1)), train_limit=4000, uni_runs=2, pmi_min_count=5, quick=True,
)


def _windows_subset(w: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    n = max(1, int(round(frac * w.shape[0])))
    perm = torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(seed))
    return w[perm[:n]]


def run(out_dir: Path, s: Settings) -> Path:
    """Train the variants, run the analyses and fine-tuning, write the report (resumable).

    A variant or fine-tuning run that diverges is recorded as failed (with the reason) in
    ``runs.jsonl`` / ``finetune.jsonl``; the other variants still train. The analyses and claims
    compare all five variants, so with a failed variant the report gives the scores of the others
    and the failures only.

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
    cfg = s.lm_config(corpus.vocab)
    sched = s.schedule
    models_dir, ckpt_dir = out_dir / "models", out_dir / "checkpoints"
    models_dir.mkdir(exist_ok=True)
    runs_path = out_dir / "runs.jsonl"

    # ---- 1. the five variants (Tables 2-4, App. B)
    done = {r["variant"]: r for r in read_jsonl(runs_path)}
    models: dict[str, TransformerLM] = {}
    for v in VARIANTS:
        path = models_dir / f"{v.name}.pt"
        if v.name in done and is_failed(done[v.name]):
            continue
        if v.name in done and path.exists():
            model = TransformerLM(replace(cfg, drop_heads=v.drop_heads))
            model.load_state_dict(torch.load(path, weights_only=True))
            model.eval()
            models[v.name] = model
            continue
        _log(f"training {v.name} ({v.mode}, drop_heads={v.drop_heads})")
        try:
            model, state = train_variant(v, cfg, train, corpus.windows["dev"], sched, ckpt_dir)
        except RunDiverged as err:
            rec = failed_record({"variant": v.name, "mode": v.mode, "drop_heads": v.drop_heads}, err.reason, err.step)
            append_jsonl_atomic(runs_path, rec)
            done[v.name] = rec
            _log(f"{v.name}: FAILED, {err.reason}")
            continue
        routing = EVAL_ROUTING[v.mode]
        gated = routing == "gate"  # the gates are part of the model only where it uses them
        dev = evaluate(model, corpus.windows["dev"], routing)
        test = evaluate(model, corpus.windows["test"], routing)
        gate_params = sum(p.numel() for b in model.blocks for p in b.attn.gate.parameters())
        total_params = sum(p.numel() for p in model.parameters())
        torch.save(model.state_dict(), path)
        rec = {
            "variant": v.name, "mode": v.mode, "drop_heads": v.drop_heads,
            "experts": model.blocks[0].attn.num_experts,
            "dev_loss": dev, "test_loss": test, "dev_ppl": math.exp(dev), "test_ppl": math.exp(test),
            "params": total_params if gated else total_params - gate_params,
            "gate_params": gate_params if gated else 0,
            "curve": state["curve"], "seconds": state["seconds"],
        }
        append_jsonl_atomic(runs_path, rec)
        done[v.name] = rec
        models[v.name] = model
        _log(f"{v.name}: dev ppl {rec['dev_ppl']:.2f}, test ppl {rec['test_ppl']:.2f}")

    failed_variants = [r for r in done.values() if is_failed(r)]
    if failed_variants:  # the analyses, fine-tuning and claims compare all five variants
        return write_failed_report(out_dir, s, list(done.values()), time.perf_counter() - t_start)

    # ---- 2. analyses of Sec. 5.1 / App. C on the dev set
    an_path = out_dir / "analyses.jsonl"
    analyses = {r["name"]: r for r in read_jsonl(an_path)}
    dev = corpus.windows["dev"]
    dev_gates: dict[str, list[torch.Tensor]] = {}  # collected once, for "gates" and "spread"

    def gates_on_dev(name: str) -> list[torch.Tensor]:
        if name not in dev_gates:
            dev_gates[name] = collect_gates(models[name], dev)[1]
        return dev_gates[name]

    if "gates" not in analyses:
        _log("analyses: entropy, attribution shares, top-1, PMI")
        rec: dict[str, Any] = {"name": "gates", "entropy": {}, "shares": {}}
        for name in ("MAE-7", "MAE-6", "NOBCD"):
            gates = gates_on_dev(name)
            mean, per_layer = mean_entropy(gates)
            rec["entropy"][name] = {"mean": mean, "per_layer": per_layer,
                                    "uniform": math.log(gates[0].shape[-1])}
            rec["shares"][name] = [attribution_shares(g) for g in gates]
        # UNI-MAE-7's responsibilities are the constant 1/h: measure them as used at test time
        uni = models["UNI-MAE-7"]
        set_routing(uni, "uniform")
        with torch.no_grad():
            _, ug = uni(dev[:8, :-1], return_gates=True)
        umean, uper = mean_entropy(ug)
        rec["entropy"]["UNI-MAE-7"] = {"mean": umean, "per_layer": uper, "uniform": math.log(ug[0].shape[-1])}
        tokens, gates = collect_gates(models["MAE-7"], torch.cat([dev, corpus.windows["test"]]))
        rec["pmi"] = [pmi_tokens(tokens, g, corpus.itos, min_count=s.pmi_min_count) for g in gates]
        append_jsonl_atomic(an_path, rec)
        analyses["gates"] = rec
    if "spread" not in analyses:
        rec = {"name": "spread", "models": {}}
        for name in ("MAE-7", "MAE-6", "NOBCD"):
            gates = gates_on_dev(name)
            rec["models"][name] = [
                {"mean_max": float(g.amax(-1).mean()), "mean_min": float(g.amin(-1).mean()),
                 "uniform": 1.0 / g.shape[-1]} for g in gates]
        append_jsonl_atomic(an_path, rec)
        analyses["spread"] = rec
    if "top1" not in analyses:
        rec = {"name": "top1", "models": {}}
        for name in ("MAE-7", "MAE-6", "NOBCD"):
            mix = evaluate(models[name], dev, "gate")
            top = evaluate(models[name], dev, "top1")
            rec["models"][name] = {"mixture_ppl": math.exp(mix), "single_ppl": math.exp(top),
                                   "single": "top expert"}
        mix = evaluate(models["UNI-MAE-7"], dev, "uniform")
        runs = [math.exp(evaluate(models["UNI-MAE-7"], dev, "uniform_sample",
                                  generator=torch.Generator().manual_seed(100 + i)))
                for i in range(s.uni_runs)]
        rec["models"]["UNI-MAE-7"] = {"mixture_ppl": math.exp(mix), "single_ppl": sum(runs) / len(runs),
                                      "single_runs": runs, "single": f"random expert, mean of {len(runs)} runs"}
        append_jsonl_atomic(an_path, rec)
        analyses["top1"] = rec

    # ---- 3. transfer (Sec. 5.2): pretrained on the Old Testament, fine-tuned on the New
    ft_path = out_dir / "finetune.jsonl"
    ft_done = {(r["method"], r["fraction"]): r for r in read_jsonl(ft_path)}
    nt_dev, nt_test = corpus.windows["nt_dev"], corpus.windows["nt_test"]
    if ("NOFT", 0.0) not in ft_done:
        for name in ("MAE-7", "BASE"):
            routing = "gate" if name == "MAE-7" else "uniform"
            r = {"method": "NOFT" if name == "MAE-7" else "NOFT-BASE", "fraction": 0.0,
                 "best_dev_loss": evaluate(models[name], nt_dev, routing),
                 "test_loss_at_best": evaluate(models[name], nt_test, routing),
                 "best_step": 0, "updated_params": 0, "curve": []}
            append_jsonl_atomic(ft_path, r)
            ft_done[(r["method"], 0.0)] = r
    for frac, epochs in s.ft_epochs:
        sub = _windows_subset(corpus.windows["nt_train"], frac, sched.seed + 5)
        bpe = max(1, math.ceil(sub.shape[0] / sched.batch))
        ft_sched = replace(sched, epochs=epochs, batches_per_epoch=bpe, lr=s.ft_lr,
                           warmup=min(sched.warmup, bpe))
        for method in FINETUNE_METHODS:
            if (method, frac) in ft_done:
                continue
            _log(f"fine-tuning MAE-7 with {method} on {frac:.0%} of the New Testament windows")
            key = {"method": method, "fraction": frac, "windows": int(sub.shape[0])}
            r = train_or_fail(lambda: finetune(models["MAE-7"], method, sub, nt_dev, nt_test, ft_sched,
                                               ckpt_dir, f"{method}_{frac}"), key,
                              on_fail=lambda why: _log(f"fine-tuning {method} on {frac:.0%}: FAILED, {why}"))
            r.update(key)
            append_jsonl_atomic(ft_path, r)
            ft_done[(method, frac)] = r

    elapsed = time.perf_counter() - t_start
    ft_ok, ft_failed = split_failed(ft_done.values())
    report = write_report(out_dir, s, corpus, list(done.values()), analyses, ft_ok, elapsed)
    return add_failures_to_report(report, ft_failed, len(ft_done), ("method", "fraction"))


EXPERIMENT = Experiment(
    "mae",
    ("Peng et al. (2020) mixture of attentive experts trained by block coordinate descent: "
     "BASE / MAE-7 / MAE-6 / UNI-MAE-7 / NOBCD language models (Tables 2-5, 8), gate analyses "
     "(Sec. 5.1), gate fine-tuning (Sec. 5.2), learning curves (App. B)."
    ),
    run,
    FULL,
    QUICK,
)
"""The registered experiment (``routelab reproduce mae``)."""
