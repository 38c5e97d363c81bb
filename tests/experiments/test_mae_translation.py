"""The MAE translation experiment: BPE round trips, corpus layout, the model's causality and padding
invariance, the loss against a per-sentence loop, beam search against greedy and brute-force oracles,
BLEU, and the runner end to end (resumable) on a synthetic parallel text."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.data.parallel_text import VersePair, pairs_fingerprint
from routelab.experiments import mae_translation as mt
from routelab.experiments.kit.store import ResultsFileError
from routelab.experiments.mae_translation.corpus import BOS, BPE, EOS, PAD, build_corpus, length_batches, split_batch
from routelab.experiments.mae_translation.decode import beam_search, corpus_bleu, translate
from routelab.experiments.mae_translation.model import Seq2SeqConfig, TranslationLoss, TranslationModel
from routelab.layers.mae import set_routing

WORDS = ["god", "said", "let", "there", "be", "light", "and", "was", "the", "earth", "water", "day", "night",
         "he", "made", "two", "great", "lights", "over", "sea"]


def synthetic_pairs(n: int, seed: int = 0) -> list[VersePair]:
    """English sentences of the words above; the 'Spanish' side spells each word backwards plus 'a'."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        en = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))).capitalize() + "."
        es = " ".join(w[::-1] + "a" for w in en[:-1].lower().split()) + "."
        out.append(VersePair("Genesis", 1 + i // 50, 1 + i % 50, 1, es, en))
    return out


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(synthetic_pairs(400), 120, 100, 24)


def tiny_model(corpus, seed: int = 0, drop_heads: int = 1) -> TranslationModel:
    torch.manual_seed(seed)
    cfg = Seq2SeqConfig(src_vocab=corpus.src_bpe.vocab_size, tgt_vocab=corpus.tgt_bpe.vocab_size, dim=16, heads=4,
                        layers=1, ffn=32, max_len=40, drop_heads=drop_heads, gate_hidden=8, dropout=0.0)
    model = TranslationModel(cfg)
    for m in model.modules():  # gates that are not uniform, so that routing matters in the tests
        if hasattr(m, "gate") and hasattr(m.gate, "out"):
            torch.nn.init.normal_(m.gate.out.weight, std=1.0)
    set_routing(model, "gate")
    return model.eval()


# ----------------------------------------------------------------------------- corpus


_BPE_CACHE: dict[str, BPE] = {}


LETTERS = list("abcdefghGOD,.\u00e1\u00e9\u00f1\u2019")  # accents and the curly apostrophe of the texts


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from(LETTERS), min_size=1, max_size=9), min_size=1, max_size=8))
def test_bpe_decodes_what_it_encodes(words: list[str]) -> None:
    """Verse text has single spaces (the loader collapses whitespace); every such text round-trips to its
    normalised (lower-cased) form."""
    texts = [p.en for p in synthetic_pairs(200)] + ["".join(LETTERS)]
    bpe = _BPE_CACHE.setdefault("bpe", BPE.train(texts, 80))
    text = " ".join(words)
    assert bpe.decode(bpe.encode(text)) == bpe.normalize(text)


def test_bpe_learning_is_deterministic_and_saved_encodings_read_back(tmp_path) -> None:
    pairs = synthetic_pairs(300)
    a = build_corpus(pairs, 120, 100, 24, bpe_dir=tmp_path)
    b = build_corpus(pairs, 120, 100, 24)  # learned again
    c = build_corpus(pairs, 120, 100, 24, bpe_dir=tmp_path)  # read back
    for split in ("train", "dev", "test"):
        assert torch.equal(a.data[split], b.data[split]) and torch.equal(a.data[split], c.data[split])
    assert (tmp_path / "bpe_es.json").exists() and (tmp_path / "bpe_en.json").exists()
    d = build_corpus(pairs, 110, 100, 24, bpe_dir=tmp_path)  # another size: learned again, not read
    assert d.src_bpe.vocab_size <= 110


def test_corpus_layout_splits_and_references(corpus) -> None:
    n = {k: v.shape[0] for k, v in corpus.data.items()}
    assert n == {"dev": 20, "test": 20, "train": 360}  # i mod 20: 0 dev, 1 test
    for split, x in corpus.data.items():
        src, tgt = x[:, : corpus.src_len], x[:, corpus.src_len:]
        assert (tgt[:, 0] == BOS).all()
        for row_s, row_t, ref in zip(src.tolist(), tgt.tolist(), corpus.refs[split]):
            s = [t for t in row_s if t != PAD]
            t = [u for u in row_t if u != PAD]
            assert s[-1] == EOS and EOS not in s[:-1] and t[-1] == EOS
            assert corpus.tgt_bpe.decode(t) == ref  # the reference is the decoded target
    pairs = synthetic_pairs(400)
    assert corpus.refs["dev"][0] == pairs[0].en.lower() and corpus.refs["test"][0] == pairs[1].en.lower()


def test_long_pairs_are_left_out_and_counted() -> None:
    pairs = synthetic_pairs(100)
    long = VersePair("Genesis", 9, 9, 1, "a " * 50, "b " * 50)
    c = build_corpus([*pairs, long], 120, 100, 24)
    assert c.dropped == 1 and sum(v.shape[0] for v in c.data.values()) == 100
    with pytest.raises(ValueError, match="max_len"):
        build_corpus(pairs, 120, 100, 0)


def test_split_batch_trims_to_the_longest_row(corpus) -> None:
    batch = corpus.data["train"][:5]
    src, tgt = split_batch(batch, corpus.src_len)
    assert ((src != PAD).sum(1).max() == src.shape[1]) and ((tgt != PAD).sum(1).max() == tgt.shape[1])
    assert (batch[:, src.shape[1]: corpus.src_len] == PAD).all()


# ----------------------------------------------------------------------------- model and loss


def test_decoder_logits_do_not_depend_on_later_target_pieces(corpus) -> None:
    model = tiny_model(corpus)
    src, tgt = split_batch(corpus.data["dev"][:4], corpus.src_len)
    out = model(src, tgt)
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(4, corpus.tgt_bpe.vocab_size, changed[:, 5:].shape)
    out2 = model(src, changed)
    torch.testing.assert_close(out[:, :5], out2[:, :5])
    assert not torch.allclose(out[:, 5:], out2[:, 5:])


def test_source_padding_changes_nothing(corpus) -> None:
    model = tiny_model(corpus)
    src, tgt = split_batch(corpus.data["dev"][:4], corpus.src_len)
    padded = F.pad(src, (0, 7), value=PAD)
    torch.testing.assert_close(model(src, tgt), model(padded, tgt), atol=1e-5, rtol=1e-5)


def test_loss_is_the_per_sentence_loop(corpus) -> None:
    model = tiny_model(corpus)
    batch = corpus.data["train"][:6]
    loss = TranslationLoss(corpus.src_len, label_smoothing=0.0)
    total, count = 0.0, 0
    for row in batch:  # one unpadded sentence at a time (scores only: no graph needed)
        s = row[: corpus.src_len]
        t = row[corpus.src_len:]
        s, t = s[s != PAD].unsqueeze(0), t[t != PAD].unsqueeze(0)
        with torch.no_grad():
            logits = model(s, t[:, :-1])[0]
        total += float(F.cross_entropy(logits, t[0, 1:], reduction="sum"))
        count += t.shape[1] - 1
    assert loss.targets(batch) == count
    with torch.no_grad():
        assert math.isclose(float(loss(model, batch)), total / count, rel_tol=1e-5)
        assert math.isclose(float(loss.nll(model, batch)), total / count, rel_tol=1e-5)
        smoothed = TranslationLoss(corpus.src_len, label_smoothing=0.1)
        assert float(smoothed(model, batch)) != float(loss(model, batch))


@pytest.mark.parametrize("routing", ["gate", "top1", "uniform"])
def test_incremental_decoding_equals_the_full_decoder(corpus, routing: str) -> None:
    """step() keeps cached inputs and running gate means; its logits at every position must be those of
    decode() over the whole prefix, also after the hypotheses are reordered (as beam search does)."""
    model = tiny_model(corpus)
    set_routing(model, routing)
    src, tgt = split_batch(corpus.data["dev"][:5], corpus.src_len)
    with torch.no_grad():
        memory, pad = model.encode(src)
        full = model.decode(tgt, memory, pad)
        state = model.start(memory, pad)
        for t in range(tgt.shape[1]):
            torch.testing.assert_close(model.step(state, tgt[:, t]), full[:, t], atol=1e-5, rtol=1e-5)
        # three hypotheses of sentence 0 (one memory), reordered after 4 pieces as a beam does
        mem3, pad3 = memory[:1].expand(3, -1, -1), pad[:1].expand(3, -1)
        prefixes = tgt[:3]
        state = model.start(mem3, pad3)
        for t in range(4):
            model.step(state, prefixes[:, t])
        rows = torch.tensor([2, 0, 0])
        state.reorder(rows)
        want = model.decode(prefixes[rows, :5], mem3, pad3)[:, -1]
        torch.testing.assert_close(model.step(state, prefixes[rows, 4]), want, atol=1e-5, rtol=1e-5)


def test_model_rejects_rows_longer_than_max_len(corpus) -> None:
    model = tiny_model(corpus)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.ones(1, 41, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


# ----------------------------------------------------------------------------- decoding


def _greedy_loop(model: TranslationModel, src: torch.Tensor, steps: int) -> list[int]:
    ys = [BOS]
    for _ in range(steps):
        logits = model(src, torch.tensor([ys]))[0, -1]
        logits[PAD] = logits[BOS] = -math.inf
        nxt = int(logits.argmax())
        if nxt == EOS:
            break
        ys.append(nxt)
    return ys[1:]


def test_beam_one_is_greedy_decoding(corpus) -> None:
    model = tiny_model(corpus)
    src = corpus.sources("dev")[:6]
    src = src[:, : int((src != PAD).sum(1).max())]
    got = beam_search(model, src, beam=1, max_steps=12)
    for row, hyp in zip(src, got):
        assert hyp == _greedy_loop(model, row[row != PAD].unsqueeze(0), 12)


@pytest.mark.parametrize("len_penalty", [0.0, 1.0])
def test_a_wide_beam_finds_the_brute_force_best(len_penalty: float) -> None:
    """With 4 generable pieces (<unk> is one) and 3 steps there are 4 + 16 + 64 sequences; a beam of 80
    keeps every candidate of every step, so its answer must be the best of all of them under the same
    length-normalised score."""
    torch.manual_seed(3)
    cfg = Seq2SeqConfig(src_vocab=7, tgt_vocab=7, dim=16, heads=4, layers=1, ffn=32, max_len=8, gate_hidden=8,
                        dropout=0.0)
    model = TranslationModel(cfg).eval()
    for p in model.parameters():  # sharpen the distribution so that the best sequence is unique
        p.data.mul_(3.0)
    src = torch.tensor([[4, 5, 6, EOS]])
    steps = 3
    GENERABLE = (1, 4, 5, 6)  # noqa: N806 - every id but PAD, BOS and EOS

    @torch.no_grad()
    def logp(prefix: list[int]) -> torch.Tensor:
        out = torch.log_softmax(model(src, torch.tensor([[BOS, *prefix]]))[0, -1], -1)
        out[PAD] = out[BOS] = -math.inf
        return out

    best, best_seq = -math.inf, None
    for length in range(1, steps + 1):  # finished with EOS at position `length`, or cut at max_steps
        for body in itertools.product(GENERABLE, repeat=length - 1):
            score = sum(float(logp(list(body[:i]))[body[i]]) for i in range(len(body)))
            score += float(logp(list(body))[EOS])
            if score / length ** len_penalty > best:
                best, best_seq = score / length ** len_penalty, list(body)
        # sequences cut at max_steps: `steps` pieces, no EOS
    for body in itertools.product(GENERABLE, repeat=steps):
        score = sum(float(logp(list(body[:i]))[body[i]]) for i in range(steps))
        if score / steps ** len_penalty > best:
            best, best_seq = score / steps ** len_penalty, list(body)
    assert beam_search(model, src, beam=80, max_steps=steps, len_penalty=len_penalty)[0] == best_seq


def test_batched_beam_search_equals_one_sentence_at_a_time(corpus) -> None:
    model = tiny_model(corpus)
    src = corpus.sources("test")[:9]
    batched = translate(model, src, beam=3, batch=4, max_steps=14)
    for row, hyp in zip(src, batched):  # in the input's order, though decoded sorted by length
        assert beam_search(model, row[row != PAD].unsqueeze(0), beam=3, max_steps=14)[0] == hyp


def test_length_batches_cover_each_pass_once_and_cut_padding(corpus) -> None:
    data = corpus.data["train"]  # 360 pairs: 12 batches of 32 per pass (the last one short)
    epochs = [length_batches(data, 32, 5, e, 5) for e in range(5)]  # 25 batches: two passes and a bit
    rows = [tuple(r.tolist()) for bs in epochs for b in bs for r in b]
    first_pass = rows[:360]
    assert sorted(first_pass) == sorted(tuple(r.tolist()) for r in data)
    assert [torch.equal(a, b) for a, b in zip(epochs[1], length_batches(data, 32, 5, 1, 5))] == [True] * 5
    assert not torch.equal(epochs[0][0], length_batches(data, 32, 6, 0, 5)[0])  # another seed, another order

    def padding(batches: list[torch.Tensor]) -> float:
        lengths = [(b != PAD).sum(1) for b in batches]
        return sum(float(n.max() * len(n) - n.sum()) for n in lengths)

    random_batches = list(data[torch.randperm(360, generator=torch.Generator().manual_seed(0))].split(32))
    assert padding([b for bs in epochs for b in bs][:12]) < 0.5 * padding(random_batches)


def test_beam_search_rejects_bad_arguments(corpus) -> None:
    model = tiny_model(corpus)
    src = corpus.sources("dev")[:1]
    with pytest.raises(ValueError, match="beam"):
        beam_search(model, src, beam=0)
    with pytest.raises(ValueError, match="max_steps"):
        beam_search(model, src[:, :10], max_steps=40)


def test_corpus_bleu() -> None:
    refs = ["the earth was formless and empty .", "god said , let there be light ."]
    assert corpus_bleu(refs, refs) == pytest.approx(100.0)
    assert corpus_bleu(["x y z", "q"], refs) < 1.0
    with pytest.raises(ValueError, match="one hypothesis per reference"):
        corpus_bleu(refs[:1], refs)


# ----------------------------------------------------------------------------- the runner


TINY = mt.QUICK.with_(src_vocab=100, tgt_vocab=80, max_len=24, dim=16, heads=4, ffn=32, gate_hidden=8,
                      bleu_sentences=8, train_limit=None, beam=2,
                      schedule=mt.QUICK.schedule.__class__(epochs=2, batches_per_epoch=3, batch=8, warmup=2,
                                                           g_phase=1))


def test_run_end_to_end_and_resume(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(mt, "load_parallel_text", lambda cache_dir=None: synthetic_pairs(200))
    report = mt.run(tmp_path, TINY)
    text = report.read_text()
    assert "Quick form" in text and "## Claims" in text and (tmp_path / "fig_learning_curves.png").exists()
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["variant"] for r in runs) == sorted(TINY.variants)
    assert len({r["commit"] for r in runs}) == 1 and "code of the runs: " in text  # the code that trained them
    for r in runs:
        assert 0.0 <= r["test_bleu"] <= 100.0 and math.isfinite(r["test_loss"])
        assert ("top1_dev_bleu" in r) == (r["variant"] in ("MAE-7", "MAE-6", "NOBCD"))
    claims = json.loads((tmp_path / "claims.json").read_text())
    assert claims["experiment"] == "mae-translation" and len(claims["claims"]) == 6
    monkeypatch.setattr(mt, "run_training", lambda *a, **k: pytest.fail("a finished run was trained again"))
    mt.run(tmp_path, TINY)
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == len(runs)


def test_run_rejects_unknown_variants_and_missing_cuda(tmp_path) -> None:
    with pytest.raises(ValueError, match="variants"):
        mt.run(tmp_path, TINY.with_(variants=("MAE-9",)))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            mt.run(tmp_path, TINY.with_(device="cuda"))


@pytest.mark.requires_cuda
def test_run_on_cuda(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(mt, "load_parallel_text", lambda cache_dir=None: synthetic_pairs(200))
    mt.run(tmp_path, TINY.with_(device="cuda", variants=("BASE", "MAE-7")))
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["device"] for r in runs] == ["cuda", "cuda"] and all(math.isfinite(r["test_loss"]) for r in runs)


def test_an_out_directory_holds_runs_of_one_configuration(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(mt, "load_parallel_text", lambda cache_dir=None: synthetic_pairs(200))
    mt.run(tmp_path, TINY.with_(variants=("BASE",)))
    mt.run(tmp_path, TINY.with_(variants=("BASE", "MAE-7")))  # more variants (or seeds): the same configuration
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in runs] == ["BASE", "MAE-7"] and all(r["machine"] for r in runs)
    with pytest.raises(ValueError, match="differing: dim"):
        mt.run(tmp_path, TINY.with_(dim=24))
    # every record names the text it trained on; resuming after the text changed is refused, not mixed in
    assert {r["data"] for r in runs} == {pairs_fingerprint(synthetic_pairs(200))}
    monkeypatch.setattr(mt, "load_parallel_text", lambda cache_dir=None: synthetic_pairs(200, seed=1))
    with pytest.raises(ResultsFileError, match="trained on other data"):
        mt.run(tmp_path, TINY.with_(variants=("BASE", "MAE-7", "NOBCD")))


def test_the_committed_report_is_what_its_runs_say() -> None:
    """docs/mae-translation/claims.json follows from the committed runs.jsonl by report.claims (no number in the
    report is typed by hand), and the runs are the CPU form's: every variant at every seed, one machine recorded."""
    from routelab.experiments.kit.claims import read_claims_json
    from routelab.experiments.mae_translation.report import Runs, claims

    docs = Path(__file__).resolve().parents[2] / "docs" / "mae-translation"
    records = [json.loads(line) for line in (docs / "runs.jsonl").read_text().splitlines()]
    settings_file = json.loads((docs / "settings.json").read_text())
    assert settings_file["dim"] == mt.CPU.dim and settings_file["schedule"]["epochs"] == mt.CPU.schedule.epochs
    runs = Runs(records, list(mt.CPU.variants), list(mt.CPU.seeds))
    assert len(runs.by) == len(mt.CPU.variants) * len(mt.CPU.seeds) and all(r["machine"] for r in records)
    committed = read_claims_json(docs / "claims.json").claims
    def rows(found: list) -> list[tuple[str, str, str]]:
        return [(c.text, c.measured, c.verdict) for c in found]

    assert rows(claims(runs)) == rows(list(committed))


@pytest.mark.parametrize(("argv", "says"), [
    (["--variants", "bogus"], "invalid choice"), (["--device", "tpu"], "cpu or cuda"),
    (["--device", "cuda:"], "cpu or cuda"),
    (["--device", "cuda"], "no CUDA device"),
])
def test_the_command_line_refuses_bad_options_before_running(argv, says, tmp_path, monkeypatch, capsys) -> None:
    """Review finding: bad values were raw tracebacks (status 1), the device's only after the data loaded."""
    from routelab.experiments.mae_translation import __main__ as cli

    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("the experiment ran"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--quick", "--out", str(tmp_path), *argv])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_the_command_line_maps_its_options_onto_the_forms(tmp_path, monkeypatch) -> None:
    from routelab.experiments.mae_translation import __main__ as cli

    seen = []
    monkeypatch.setattr(cli, "run", lambda out, s: seen.append((out, s)) or out / "report.md")
    cli.main(["--quick", "--out", str(tmp_path), "--seeds", "3", "4", "--variants", "BASE"])
    cli.main(["--cpu"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (the settings are checked before the run)
    cli.main(["--data-dir", "data-cache"])
    (out, quick), (_, cpu), (_, gpu) = seen
    assert out == tmp_path and quick == mt.QUICK.with_(device="cpu", seeds=(3, 4), variants=("BASE",))
    assert cpu == mt.CPU  # defaults: no option changes the form
    assert gpu == mt.GPU.with_(device="cuda", data_dir="data-cache")


def test_the_committed_report_states_its_departures() -> None:
    """Review: the report did not say that its gate lr departs from the paper's (App. A: SGD at lr 1), nor
    that its runs (recorded before commit stamps) drew the decoder's expert per target position, while its
    Scale line said per sentence."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "mae-translation" / "report.md").read_text()
    assert "the paper's App. A updates the gates by SGD at a fixed lr of 1" in text
    assert "runs recorded without a commit (before 2026-11-27) drew the decoder's expert per target position" in text
