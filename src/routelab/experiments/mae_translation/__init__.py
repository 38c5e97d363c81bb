"""MAE as Spanish -> English translation with BLEU (Peng et al. 2020, Sec. 4.1, Tables 2-3 and 5).

``python -m routelab.experiments.mae_translation [--quick | --gpu] [--device cuda] [--out DIR]``
trains an encoder-decoder transformer whose every attention is an MAE layer (:mod:`.model`) on the
parallel Bible (:mod:`.corpus`; 28k verse pairs, BPE) in the paper's five variants (BASE, MAE-7,
MAE-6, UNI-MAE-7, NOBCD) over paired seeds, decodes dev and test with beam search (beam 5,
:mod:`.decode`), scores them with sacrebleu, and writes ``report.md`` with the claims judged on the
seed spread (:mod:`.report`). The gated variants are also decoded with their top expert only
(Table 5).

The language-model reproduction (``routelab reproduce mae``) is the one ``make run`` includes; this
one needs more compute than a shared 2-core CPU gives in minutes (:data:`GPU` is its intended size),
so it is not part of ``routelab reproduce``. :data:`CPU` is a smaller model that trains on one core in
about an hour and a half for 15 runs; :data:`QUICK` checks the pipeline in a minute.

Resumable: a finished run is a line of ``runs.jsonl``; an interrupted training resumes from its last
epoch's checkpoint under ``checkpoints/``; the BPE encodings are saved next to the results.
Training reuses the LM reproduction's loop (:func:`routelab.experiments.mae.train.run_training`:
BCD schedule, warm-up and cosine decay, divergence checks).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from routelab._checks import check_seed, is_device_name
from routelab.data.parallel_text import load_parallel_text, pairs_fingerprint
from routelab.layers.bcd import EVAL_ROUTING, BCDTrainer
from routelab.layers.mae import set_routing

from ..kit.data_stamp import DataStamp
from ..kit.divergence import RunDiverged
from ..kit.provenance import CommitStamp
from ..kit.router_sweep import check_distinct
from ..kit.store import append_jsonl_atomic, atomic_write_text, failed_record, read_jsonl
from ..mae.train import VARIANTS, Schedule, _log, evaluate, run_training
from .corpus import TranslationCorpus, build_corpus, length_batches
from .decode import corpus_bleu, translate
from .model import Seq2SeqConfig, TranslationLoss, TranslationModel

__all__ = ["CPU", "GPU", "QUICK", "Settings", "check_settings_can_run", "run"]


@dataclass(frozen=True)
class Settings:
    """Size of one run of the experiment.

    Attributes:
        src_vocab, tgt_vocab: BPE sizes of Spanish and English (specials included).
        max_len: the most BPE pieces of a side; longer pairs are left out (:mod:`.corpus`).
        dim, heads, layers, ffn, gate_hidden, dropout: the model (:class:`~.model.Seq2SeqConfig`).
        label_smoothing: of the training loss (dev/test losses are plain cross-entropy).
        schedule: training of each variant (its ``seed`` and ``gate_lr`` are set per run; an epoch
            is ``batches_per_epoch`` batches of ``batch`` sentence pairs).
        gate_lr: the gates' SGD learning rate (every gated variant).
        seeds: paired seeds: every variant is trained once per seed, from the same initial shared
            weights and on the same batches.
        variants: the variants trained (names of :data:`routelab.experiments.mae.train.VARIANTS`).
        beam, len_penalty: decoding (the paper: beam 5).
        decode_batch: sentences decoded together (sorted by length; each with ``beam`` hypotheses).
        bleu_sentences: BLEU on the first this many dev and test sentences (None: all).
        train_limit: use only the first this many training pairs (None: all).
        device: ``"cpu"`` or ``"cuda"``.
        data_dir: the parallel text's cache directory (``load_parallel_text(cache_dir=)``; None:
            its default); a GPU machine without the Debian packages reads the cache carried there.
        quick: the quick form (the report says so).
    """

    src_vocab: int = 8000
    tgt_vocab: int = 6000
    max_len: int = 128
    dim: int = 256
    heads: int = 8
    layers: int = 3
    ffn: int = 1024
    gate_hidden: int = 128
    dropout: float = 0.2
    label_smoothing: float = 0.1
    schedule: Schedule = field(default_factory=lambda: Schedule(
        epochs=10, batches_per_epoch=200, batch=64, lr=1e-3, warmup=400, g_phase=10))
    gate_lr: float = 10.0
    seeds: tuple[int, ...] = (0, 1, 2)
    variants: tuple[str, ...] = tuple(v.name for v in VARIANTS)
    beam: int = 5
    len_penalty: float = 1.0
    decode_batch: int = 256
    bleu_sentences: int | None = None
    train_limit: int | None = None
    device: str = "cpu"
    data_dir: str | None = None
    quick: bool = False

    def model_config(self, corpus: TranslationCorpus, drop_heads: int) -> Seq2SeqConfig:
        """The model for ``corpus`` with experts that drop ``drop_heads`` heads."""
        return Seq2SeqConfig(
            src_vocab=corpus.src_bpe.vocab_size, tgt_vocab=corpus.tgt_bpe.vocab_size, dim=self.dim,
            heads=self.heads, layers=self.layers, ffn=self.ffn,
            max_len=max(corpus.src_len, self.max_len + 2), drop_heads=drop_heads,
            gate_hidden=self.gate_hidden, dropout=self.dropout)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)


GPU = Settings()
"""The intended size, for one GPU: 3 + 3 layers of width 256, 2,000 steps of 64 pairs (4.6 passes)
per run, 15 runs."""

CPU = Settings(
    src_vocab=4000, tgt_vocab=3000, dim=128, layers=2, ffn=512, gate_hidden=64, dropout=0.1,
    schedule=Schedule(epochs=8, batches_per_epoch=150, batch=32, lr=2e-3, warmup=150, g_phase=10),
    bleu_sentences=400, decode_batch=64,
)
"""A smaller model that one CPU core trains in about 6 minutes per run (1,200 steps of 32 pairs, 1.4
passes; BLEU on 400 dev and 400 test pairs)."""

QUICK = Settings(
    src_vocab=1000, tgt_vocab=1000, max_len=48, dim=32, layers=1, ffn=64, gate_hidden=16, dropout=0.1,
    schedule=Schedule(epochs=2, batches_per_epoch=20, batch=16, warmup=10, g_phase=2),
    seeds=(0,), beam=2, bleu_sentences=40, train_limit=2000, quick=True,
)
"""The pipeline in about a minute: one seed, a tiny model, 40 steps; its BLEU means nothing."""


SETTINGS_FILE = "settings.json"
# May change between invocations on one out_dir. decode_batch sets the speed of decoding; it also decides which
# sentences share a batch, hence a batch's step bound 1.5 S + 10 (S its longest source), a bound that 1 of the
# 1554 test references exceeds at its own length.
_PER_INVOCATION = ("seeds", "variants", "device", "data_dir", "decode_batch")


def check_settings(out_dir: Path, s: Settings) -> None:
    """Record the settings that define a run in ``out_dir/settings.json``, or check them against it.

    A directory holds runs of one configuration: resuming it with another model, data or schedule
    would mix incomparable runs in one report, so that is an error. Seeds, variants, the device and
    the data directory may change between invocations (more seeds, a run split over machines).

    Raises:
        ValueError: ``out_dir`` holds runs of other settings (the message names the fields).
    """
    fields = {k: v for k, v in {**asdict(s), "schedule": asdict(s.schedule)}.items() if k not in _PER_INVOCATION}
    fields = json.loads(json.dumps(fields))  # tuples -> lists, as read back
    path = out_dir / SETTINGS_FILE
    if path.exists():
        saved = json.loads(path.read_text())
        diff = sorted(k for k in set(saved) | set(fields) if saved.get(k) != fields.get(k))
        if diff:
            raise ValueError(f"{out_dir} holds runs of other settings (differing: {', '.join(diff)}); "
                             "pass another out directory, or the settings it was run with.")
        return
    atomic_write_text(path, json.dumps(fields, indent=1) + "\n")


def _record_key(r: dict[str, Any]) -> tuple[str, int]:
    return (r["variant"], r["seed"])


def bleu_of(model: TranslationModel, corpus: TranslationCorpus, split: str, s: Settings,
            routing: str) -> tuple[float, list[str]]:
    """BLEU of ``model`` routed by ``routing`` on the first ``s.bleu_sentences`` of ``split``, and
    its translations."""
    n = s.bleu_sentences or corpus.data[split].shape[0]
    src = corpus.sources(split)[:n].to(s.device)
    set_routing(model, routing)
    was = model.training
    model.eval()
    ids = translate(model, src, beam=s.beam, batch=s.decode_batch, len_penalty=s.len_penalty)
    model.train(was)
    hyps = [corpus.tgt_bpe.decode(h) for h in ids]
    return corpus_bleu(hyps, corpus.refs[split][:n]), hyps


def check_settings_can_run(s: Settings) -> None:
    """ValueError naming the first setting that cannot run: an unknown variant, no seeds, a device
    that is not ``cpu``/``cuda[:N]``, or a CUDA device where torch finds none."""
    names = tuple(v.name for v in VARIANTS)
    unknown = [n for n in s.variants if n not in names]
    if unknown:
        raise ValueError(f"Settings.variants must name variants of {names}; unknown: {unknown}")
    if not s.variants:
        raise ValueError(f"Settings.variants must name at least one variant of {names}")
    if not s.seeds:
        raise ValueError("Settings.seeds must name at least one seed")
    check_distinct("Settings.variants", s.variants)
    check_distinct("Settings.seeds", s.seeds)
    for seed in s.seeds:
        check_seed(seed, "Settings.seeds")
    if not is_device_name(s.device):
        raise ValueError(f"Settings.device must be 'cpu', 'cuda' or 'cuda:N', got {s.device!r}")
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch finds no CUDA device; run with device='cpu'.")


def run(out_dir: Path, s: Settings) -> Path:
    """Train every variant at every seed (seed-major, so that partial results stay paired), score
    them, write the report; returns its path. Resumable (module docstring).

    Raises:
        DataUnavailable: the parallel text is not installed (the message gives the command).
        ValueError: unknown variants, no seeds, or a CUDA device where there is none.
    """
    from .report import machine_name, write_report  # lazy: matplotlib

    check_settings_can_run(s)
    variants = {v.name: v for v in VARIANTS}
    if s.device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True  # named in the report
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_settings(out_dir, s)
    t_start = time.perf_counter()
    pairs = load_parallel_text(s.data_dir)
    corpus = build_corpus(pairs, s.src_vocab, s.tgt_vocab, s.max_len, bpe_dir=out_dir)
    train = corpus.data["train"]
    if s.train_limit is not None:
        train = train[: s.train_limit]
    train, dev = train.to(s.device), corpus.data["dev"].to(s.device)
    loss = TranslationLoss(corpus.src_len, s.label_smoothing)

    def dev_loss(model: torch.nn.Module, data: torch.Tensor, routing: str) -> float:
        return evaluate(model, data, routing, loss_fn=loss.nll, targets=loss.targets)

    def batches(data: torch.Tensor, sched: Schedule, epoch: int) -> list[torch.Tensor]:
        return length_batches(data, sched.batch, sched.seed, epoch, sched.batches_per_epoch)

    runs_path = out_dir / "runs.jsonl"
    recorded = read_jsonl(runs_path)
    done = {_record_key(r) for r in recorded}
    # the text of every recorded run must be this one (a refusal when it changed, a warning for unstamped runs)
    data = DataStamp("mae-translation", pairs_fingerprint(pairs), runs_path)
    data.check(recorded)
    commit = CommitStamp("mae-translation")  # the commit on every record, a warning when resuming another's runs

    def stamp(record: dict[str, Any]) -> dict[str, Any]:
        return data(commit(record))

    for seed in s.seeds:
        for name in s.variants:
            if (name, seed) in done:
                continue
            v = variants[name]
            label = f"{name}_s{seed}"
            sched = replace(s.schedule, seed=seed, gate_lr=s.gate_lr)
            ident = {"variant": name, "seed": seed, "mode": v.mode, "drop_heads": v.drop_heads,
                     "gate_lr": s.gate_lr}
            commit.before_training(recorded)
            _log(f"translation: training {label} ({v.mode}, drop_heads={v.drop_heads}) on {s.device}")
            torch.manual_seed(seed)
            model = TranslationModel(s.model_config(corpus, v.drop_heads)).to(s.device)
            trainer = BCDTrainer(
                model, loss, mode=v.mode, g_every=sched.g_every, g_every_steps=sched.g_every_steps,
                gate_lr=sched.gate_lr, lr=sched.lr, clip_norm=sched.clip_norm,
                generator=torch.Generator().manual_seed(seed + 17))
            try:
                state = run_training(model, trainer, train, dev, sched, out_dir / "checkpoints" / f"{label}.pt",
                                     label, evaluate_fn=dev_loss, batches_fn=batches)
            except RunDiverged as err:
                append_jsonl_atomic(runs_path, stamp(failed_record(ident, err.reason, err.step)))
                _log(f"{label}: FAILED, {err.reason}")
                continue
            routing = EVAL_ROUTING[v.mode]
            t0 = time.perf_counter()
            rec: dict[str, Any] = {**ident, "experts": model.encoder[0].attn.num_experts,
                                   "dev_loss": state["curve"][-1]["dev_loss"],
                                   "test_loss": dev_loss(model, corpus.data["test"].to(s.device), routing)}
            rec["dev_bleu"], _ = bleu_of(model, corpus, "dev", s, routing)
            rec["test_bleu"], hyps = bleu_of(model, corpus, "test", s, routing)
            if routing == "gate":  # Table 5: only the expert each gate weights most
                rec["top1_dev_bleu"], _ = bleu_of(model, corpus, "dev", s, "top1")
            rec.update({"samples": hyps[:3], "steps": dict(trainer.steps), "curve": state["curve"],
                        "seconds": state["seconds"], "decode_seconds": time.perf_counter() - t0,
                        "params": sum(p.numel() for p in model.parameters()), "device": s.device,
                        "machine": machine_name(s.device)})
            append_jsonl_atomic(runs_path, stamp(rec))
            _log(f"{label}: dev BLEU {rec['dev_bleu']:.2f}, test BLEU {rec['test_bleu']:.2f} "
                 f"({rec['seconds']:.0f}s training, {rec['decode_seconds']:.0f}s decoding)")
    settings = {**asdict(s), "schedule": asdict(s.schedule)}
    return write_report(out_dir, settings, corpus, read_jsonl(runs_path), time.perf_counter() - t_start)
