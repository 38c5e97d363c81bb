"""Contracts of the MAE translation experiment that its main tests leave open (mutation round 6): the
``max_len`` bound is inclusive, every pass draws its own order, BLEU is hypotheses against references
(a hand-computed brevity penalty), the dev/test loss is the plain cross-entropy whatever the training
smoothing, BLEU decodes in eval mode against the matching references, and the runner's recorded numbers
follow from its models (paired initial weights, test loss and test BLEU recomputed by hand)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_mae_translation import TINY, synthetic_pairs, tiny_model

from routelab.data.parallel_text import VersePair
from routelab.experiments import mae_translation as mt
from routelab.experiments.mae_translation.corpus import EOS, PAD, build_corpus, length_batches, split_batch
from routelab.experiments.mae_translation.decode import beam_search, corpus_bleu, translate
from routelab.experiments.mae_translation.model import TranslationLoss, TranslationModel
from routelab.layers.bcd import EVAL_ROUTING
from routelab.layers.mae import set_routing


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(synthetic_pairs(400), 120, 100, 24)


# ----------------------------------------------------------------------------- corpus


def test_a_side_of_exactly_max_len_pieces_is_kept() -> None:
    """'A pair whose source or target has *more than* max_len pieces is left out': at max_len equal to the
    longest side nothing is dropped, one piece less drops the longest."""
    pairs = synthetic_pairs(200)
    wide = build_corpus(pairs, 120, 100, 64)
    assert wide.dropped == 0
    longest_t = max(int((x[:, wide.src_len:] != PAD).sum(1).max()) for x in wide.data.values()) - 2  # BOS, EOS
    longest_s = max(int((x[:, : wide.src_len] != PAD).sum(1).max()) for x in wide.data.values()) - 1  # EOS
    bound = max(longest_s, longest_t)  # 9 words on each side, one piece each
    at = build_corpus(pairs, 120, 100, bound)
    assert at.dropped == 0 and sum(v.shape[0] for v in at.data.values()) == len(pairs)
    assert build_corpus(pairs, 120, 100, bound - 1).dropped >= 1


def test_a_pair_with_an_empty_side_is_left_out() -> None:
    """An empty verse on either side has nothing to translate or score: it is in no split (here it would be
    the first dev pair, index 100)."""
    pairs = synthetic_pairs(100)
    for empty in (VersePair("Genesis", 9, 9, 1, "dog a.", ""), VersePair("Genesis", 9, 9, 1, "", "Dog.")):
        c = build_corpus([*pairs, empty], 120, 100, 24)
        assert sum(v.shape[0] for v in c.data.values()) == len(pairs)
        assert c.refs["dev"][-1] == pairs[80].en.lower() and "" not in c.refs["dev"]


def test_every_pass_draws_a_new_order(corpus) -> None:
    """Pass ``p`` draws its order from seed ``seed * 1000 + p``: the second pass is another arrangement of the
    same pairs, not the first one again."""
    data = corpus.data["train"]
    per_pass = math.ceil(data.shape[0] / 32)  # 12 batches of a pass, the last one short
    first, second = (length_batches(data, 32, 5, e, per_pass) for e in (0, 1))

    def rows(batches: list[torch.Tensor]) -> list[tuple[int, ...]]:
        return [tuple(r.tolist()) for b in batches for r in b]

    assert sorted(rows(first)) == sorted(rows(second)) == sorted(tuple(r.tolist()) for r in data)
    assert rows(first) != rows(second)


# ----------------------------------------------------------------------------- loss


def _hand_losses(model: TranslationModel, batch: torch.Tensor, src_len: int, eps: float) -> tuple[float, float]:
    """(plain, label-smoothed) cross-entropy per target piece, pads excluded, from log-softmax by hand."""
    src, tgt = split_batch(batch, src_len)
    with torch.no_grad():
        logp = torch.log_softmax(model(src, tgt[:, :-1]).double(), -1)
    gold = tgt[:, 1:]
    nll, smooth, count = 0.0, 0.0, 0
    for b in range(gold.shape[0]):
        for t in range(gold.shape[1]):
            if gold[b, t] == PAD:
                continue
            nll -= float(logp[b, t, gold[b, t]])
            smooth -= float(logp[b, t].mean())
            count += 1
    return nll / count, ((1 - eps) * nll + eps * smooth) / count


def test_nll_is_the_plain_cross_entropy_whatever_the_training_smoothing(corpus) -> None:
    """``TranslationLoss.nll`` ('the plain cross-entropy that dev scores use') ignores ``label_smoothing``; the
    call itself is (1 - eps) NLL + eps * mean over the vocabulary of -log p, both over non-pad targets."""
    model = tiny_model(corpus)
    batch = corpus.data["train"][:6]
    loss = TranslationLoss(corpus.src_len, label_smoothing=0.1)
    nll, smoothed = _hand_losses(model, batch, corpus.src_len, 0.1)
    with torch.no_grad():
        assert float(loss.nll(model, batch)) == pytest.approx(nll, rel=1e-5)
        assert float(loss(model, batch)) == pytest.approx(smoothed, rel=1e-5)
    assert abs(nll - smoothed) > 1e-3  # the two differ, so the first check tells them apart


def test_rows_of_exactly_max_len_positions_are_accepted(corpus) -> None:
    """'length <= cfg.max_len': a source and a target of ``max_len`` (40) positions go through, 41 do not."""
    model = tiny_model(corpus)
    ids = torch.full((1, model.cfg.max_len), 5, dtype=torch.long)
    with torch.no_grad():
        assert model(ids, ids).shape == (1, model.cfg.max_len, model.cfg.tgt_vocab)
    with pytest.raises(ValueError, match="max_len"):
        model(F.pad(ids, (0, 1), value=5), ids)
    with pytest.raises(ValueError, match="max_len"):
        model(ids, F.pad(ids, (0, 1), value=5))


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize(("width", "steps"), [(6, 19), (30, 39)])
def test_the_default_step_bound_is_one_and_a_half_source_lengths_plus_ten(corpus, width: int, steps: int) -> None:
    """``max_steps`` defaults to ``1.5 * S + 10`` pieces (S the source columns), capped at ``max_len - 1``
    (39 for the tiny model): a model that never ends a sentence is cut exactly there."""
    model = tiny_model(corpus)
    full_step = model.step

    def never_eos(state, tokens):
        out = full_step(state, tokens).clone()
        out[:, EOS] = -math.inf
        return out

    model.step = never_eos
    src = torch.full((2, width), 5, dtype=torch.long)
    src[:, -1] = EOS
    for beam in (1, 2):
        assert [len(h) for h in beam_search(model, src, beam=beam)] == [steps, steps]


def test_no_hypothesis_continues_past_its_eos(corpus) -> None:
    """A hypothesis that chose EOS is finished: the live beam holds ``beam`` hypotheses without EOS even when
    EOS is among the best candidates of several of them, so no result contains a special piece. EOS is made
    likely (its logit raised by 2) so that it often is."""
    model = tiny_model(corpus)
    full_step = model.step

    def eager_eos(state, tokens):
        out = full_step(state, tokens).clone()
        out[:, EOS] += 2.0
        return out

    model.step = eager_eos
    src = corpus.sources("dev")[:12]
    hyps = beam_search(model, src[:, : int((src != PAD).sum(1).max())], beam=3, max_steps=12)
    assert all(min(h, default=4) >= 4 for h in hyps), hyps


# ----------------------------------------------------------------------------- BLEU


def test_corpus_bleu_scores_hypotheses_against_references() -> None:
    """A hypothesis that is its reference minus the last word: every n-gram precision is 1 and BLEU is the
    brevity penalty alone, exp(1 - 7 / 6) (hypothesis 6 tokens, reference 7). Swapping the roles gives
    another number (precisions below 1, no penalty)."""
    hyp, ref = "the earth was formless and empty", "the earth was formless and empty ."
    assert corpus_bleu([hyp], [ref]) == pytest.approx(100 * math.exp(1 - 7 / 6), rel=1e-6)
    assert corpus_bleu([ref], [hyp]) != pytest.approx(100 * math.exp(1 - 7 / 6), rel=1e-3)


def test_bleu_of_decodes_in_eval_mode_and_scores_the_matching_references(corpus, monkeypatch) -> None:
    """``bleu_of`` translates the first ``bleu_sentences`` of a split with dropout off (a model left in training
    mode gives the eval-mode translations, and is handed back in training mode) and scores them against the
    references of those same sentences."""
    model = tiny_model(corpus)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.5
    s = TINY.with_(bleu_sentences=6, beam=2, decode_batch=4)
    src = corpus.sources("dev")[:6]
    expected = translate(model.eval(), src, beam=2, batch=4)  # dropout off
    model.train()
    score, hyps = mt.bleu_of(model, corpus, "dev", s, "gate")
    assert model.training
    assert hyps == [corpus.tgt_bpe.decode(h) for h in expected]
    assert score == pytest.approx(corpus_bleu(hyps, corpus.refs["dev"][:6]))

    # a translator that returns each source's own target pieces scores 100 against the matching references
    targets = {tuple(r[: corpus.src_len].tolist()): r[corpus.src_len:].tolist() for r in corpus.data["dev"]}

    def perfect(model, src, **kw):
        return [[p for p in targets[tuple(F.pad(row, (0, corpus.src_len - row.shape[0])).tolist())] if p > 3]
                for row in src]

    monkeypatch.setattr(mt, "translate", perfect)
    score, _ = mt.bleu_of(model, corpus, "dev", s, "gate")
    assert score == pytest.approx(100.0)


# ----------------------------------------------------------------------------- the runner


def test_the_runner_records_what_its_models_score(tmp_path, monkeypatch) -> None:
    """Per run: BASE and MAE-7 start from the same weights at a seed and from other weights at another seed
    (paired seeds); ``test_loss`` is the plain cross-entropy of the trained model on the test split under the
    variant's evaluation routing, and ``test_bleu`` is its BLEU on the first ``bleu_sentences`` test pairs."""
    monkeypatch.setattr(mt, "load_parallel_text", lambda cache_dir=None: synthetic_pairs(200))
    made: list[tuple[TranslationModel, dict[str, torch.Tensor]]] = []

    class Recorded(TranslationModel):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            made.append((self, {k: v.detach().clone() for k, v in self.state_dict().items()}))

    monkeypatch.setattr(mt, "TranslationModel", Recorded)
    s = TINY.with_(variants=("BASE", "MAE-7"), seeds=(0, 1))
    mt.run(tmp_path, s)
    runs = {(r["variant"], r["seed"]): r for r in mt.read_jsonl(tmp_path / "runs.jsonl")}
    assert list(runs) == [("BASE", 0), ("MAE-7", 0), ("BASE", 1), ("MAE-7", 1)] and len(made) == 4
    models = dict(zip(runs, made))

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(a[k], b[k]) for k in a)

    assert same(models[("BASE", 0)][1], models[("MAE-7", 0)][1])
    assert not same(models[("BASE", 0)][1], models[("BASE", 1)][1])

    corpus = build_corpus(synthetic_pairs(200), s.src_vocab, s.tgt_vocab, s.max_len)
    modes = {v.name: v.mode for v in mt.VARIANTS}
    for key, (model, _) in models.items():
        model.eval()
        set_routing(model, EVAL_ROUTING[modes[key[0]]])
        nll, _ = _hand_losses(model, corpus.data["test"], corpus.src_len, 0.0)
        assert runs[key]["test_loss"] == pytest.approx(nll, rel=1e-4)
        ids = translate(model, corpus.sources("test")[: s.bleu_sentences], beam=s.beam, batch=s.decode_batch)
        hyps = [corpus.tgt_bpe.decode(h) for h in ids]
        assert runs[key]["test_bleu"] == pytest.approx(corpus_bleu(hyps, corpus.refs["test"][: s.bleu_sentences]))


# ----------------------------------------------------------------------------- the report


def _record(variant: str, seed: int, dev: float, top1: float | None, steps: dict[str, int]) -> dict:
    curve = [{"step": 3, "train_loss": 2.0, "dev_loss": 2.5}, {"step": 6, "train_loss": 1.5, "dev_loss": 2.0}]
    rec = {"variant": variant, "seed": seed, "experts": 8, "test_bleu": dev - 1.0, "dev_bleu": dev, "test_loss": 2.0,
           "params": 1000, "steps": {"f": 0, "g": 0, "joint": 0, "base": 0, **steps}, "seconds": 60.0,
           "decode_seconds": 30.0, "curve": curve, "samples": ["a", "b"], "machine": "CPU (test)"}
    if top1 is not None:
        rec["top1_dev_bleu"] = top1
    return rec


def test_the_report_states_its_numbers_from_the_records(tmp_path) -> None:
    """Hand-made records of MAE-7 (BCD: F and G steps) and NOBCD (joint steps) at three seeds: the report
    states the passes over the pairs trained on (``train_limit``), the pairs BLEU is scored on (the test
    split's size when ``bleu_sentences`` is None; dev has one more pair here), each run's expert updates, the
    top-expert change as top expert - mixture, and the Table 5 claim on the drops mixture - top expert."""
    from routelab.experiments.kit.claims import read_claims_json
    from routelab.experiments.mae_translation.report import write_report

    corpus = build_corpus(synthetic_pairs(201), 100, 80, 24)  # 180 train, 11 dev, 10 test pairs
    assert {k: v.shape[0] for k, v in corpus.data.items()} == {"train": 180, "dev": 11, "test": 10}
    mae_drop, nobcd_drop = [0.3, 0.4, 0.2], [0.7, 0.9, 0.8]
    records = [_record("MAE-7", sd, 20.0 + sd, 20.0 + sd - mae_drop[sd], {"f": 40, "g": 9}) for sd in range(3)]
    records += [_record("NOBCD", sd, 19.0 + sd, 19.0 + sd - nobcd_drop[sd], {"joint": 40}) for sd in range(3)]
    s = TINY.with_(variants=("MAE-7", "NOBCD"), seeds=(0, 1, 2), bleu_sentences=None, train_limit=100)
    settings = {**mt.asdict(s), "schedule": mt.asdict(s.schedule)}
    text = write_report(tmp_path, settings, corpus, records, 1.0).read_text()

    assert "(0.5 passes)" in text  # 2 epochs x 3 batches x 8 pairs / 100 pairs trained on = 0.48
    assert "on the first 10 dev and test pairs" in text
    rows = {v: next(line for line in text.splitlines() if line.startswith(f"| {v} |")) for v in ("MAE-7", "NOBCD")}
    assert "| 9 / 40 |" in rows["MAE-7"] and "| 0 / 40 |" in rows["NOBCD"]
    assert "| MAE-7 | 0 | 20.00 | 19.70 | -0.30 |" in text and "| NOBCD | 2 | 21.00 | 20.20 | -0.80 |" in text
    table5 = [c for c in read_claims_json(tmp_path / "claims.json").claims if "top expert" in c.text]
    assert len(table5) == 1
    assert "per-seed MAE-7 - NOBCD: -0.40, -0.50, -0.60" in table5[0].measured
    assert table5[0].verdict.startswith("holds")


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_outside_check_seeds_range_is_refused(seed, tmp_path, capsys) -> None:
    """Seeds as ``check_seed`` takes them, in the settings and on the command line (status 2)."""
    from routelab.experiments.mae_translation import __main__ as cli

    with pytest.raises(ValueError, match=r"Settings.seeds must be an integer in \[0, 2\*\*64\)"):
        mt.check_settings_can_run(mt.QUICK.with_(seeds=(seed,), device="cpu"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["--quick", "--device", "cpu", "--seeds", str(seed), "--out", str(tmp_path)])
    assert stop.value.code == 2 and "[0, 2**64)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
