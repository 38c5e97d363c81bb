"""Tests for the MAE experiment's parts: the parallel-text loader, the corpus, the LM and the
Sec. 5.1 analyses on fixed tiny inputs (no real data needed)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import routelab.data.parallel_text as pt
import routelab.experiments.mae as mae_exp
from routelab.data import DataUnavailable
from routelab.data.parallel_text import VersePair, parse_imp
from routelab.experiments.mae.analyses import attribution_shares, collect_gates, mean_entropy, pmi_tokens
from routelab.experiments.mae.corpus import build_corpus, tokenize
from routelab.experiments.mae.model import LMConfig, TransformerLM, lm_loss
from routelab.experiments.registry import REGISTRY
from routelab.layers.mae import set_routing

torch.set_num_threads(1)

IMP = """$$$[ Module Heading ]

$$$[ Testament 1 Heading ]
$$$Genesis 0:0
Intro text
$$$Genesis 1:0
Chapter heading
$$$Genesis 1:1
EN el principio <H7225> crió
  Dios.
$$$Genesis 1:2

$$$[ Testament 2 Heading ]
$$$Matthew 1:1
LIBRO de <G5547> la generación
"""


def test_parse_imp_keeps_verses_strips_tags_and_tracks_testament() -> None:
    got = parse_imp(IMP)
    assert got == {
        ("Genesis", 1, 1): (1, "EN el principio crió Dios."),
        ("Matthew", 1, 1): (2, "LIBRO de la generación"),
    }


def test_loader_reports_missing_tool_and_reads_its_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pt.shutil, "which", lambda name: None)
    with pytest.raises(DataUnavailable, match="apt-get install"):
        pt.load_parallel_text(tmp_path / "empty")
    outputs = {pt.ENGLISH_MODULE: "$$$Genesis 1:1\nIn the beginning\n$$$Genesis 1:2\nOnly English\n",
               pt.SPANISH_MODULE: "$$$Genesis 1:1\nEn el principio <H1>\n"}
    monkeypatch.setattr(pt, "_export", lambda module: outputs[module])
    pairs = pt.load_parallel_text(tmp_path)
    assert pairs == [VersePair("Genesis", 1, 1, 1, "En el principio", "In the beginning")]
    monkeypatch.setattr(pt, "_export", lambda module: pytest.fail("cache not used"))
    assert pt.load_parallel_text(tmp_path) == pairs
    (tmp_path / pt._CACHE_NAME).write_bytes(b"not gzip")  # a corrupt cache is named, not parsed
    with pytest.raises(ValueError, match="refresh=True"):
        pt.load_parallel_text(tmp_path)
    monkeypatch.setattr(pt, "_export", lambda module: outputs[module])
    assert pt.load_parallel_text(tmp_path, refresh=True) == pairs
    assert pt.load_parallel_text(tmp_path) == pairs


def test_corpus_splits_and_windows() -> None:
    pairs = [VersePair("B", 1, i + 1, 1 if i < 100 else 2, "x", f"word{i % 7} and more, words.") for i in range(140)]
    c = build_corpus(pairs, vocab_size=6, seq=8)
    assert c.itos[:2] == ["<unk>", "<eos>"] and c.vocab == 6
    assert tokenize("In the beginning, God.") == ["in", "the", "beginning", ",", "god", "."]
    for name in ("train", "dev", "test", "nt_train", "nt_dev", "nt_test"):
        w = c.windows[name]
        assert w.dim() == 2 and w.shape[1] == 9 and int(w.max()) < 6
    # consecutive windows share their boundary token (inputs / shifted targets)
    w = c.windows["train"]
    assert torch.equal(w[1:, 0], w[:-1, -1])


def test_corpus_splits_by_verse_index_and_builds_the_vocabulary_from_train_only() -> None:
    # verse i of the Old Testament reads "v<i> ."; 30 OT verses, 20 NT verses
    pairs = [VersePair("B", 1, i + 1, 1 if i < 30 else 2, "x", f"v{i} .") for i in range(50)]
    c = build_corpus(pairs, vocab_size=1000, seq=2)

    def stream(split: str) -> list[str]:
        w = c.windows[split]
        ids = torch.cat([w[0], w[1:, 1:].reshape(-1)]).tolist()  # undo the one-token overlap
        return [c.itos[i] for i in ids]

    # oracle: the documented rule, verse index mod 20 (OT) / mod 10 (NT), verses joined by <eos>
    ot_train = [i for i in range(30) if i % 20 >= 2]
    assert set(c.itos) == {"<unk>", "<eos>", "."} | {f"v{i}" for i in ot_train}
    want = [t for i in ot_train for t in (f"v{i}", ".", "<eos>")]
    assert stream("train") == want[: len(stream("train"))] and len(want) - len(stream("train")) < 2
    assert stream("dev")[:3] == ["<unk>", ".", "<eos>"]  # v0, v20: not training words
    assert len(c.windows["dev"]) == (2 * 3 - 1) // 2  # two dev verses of 3 tokens, seq 2
    assert len(c.windows["nt_train"]) == (16 * 3 - 1) // 2  # NT indices 2..9, 12..19
    assert set(stream("nt_test")) == {"<unk>", ".", "<eos>"}
    long = [VersePair("B", 1, 1, 1, "x", "a " * 121)] + pairs
    assert torch.equal(build_corpus(long, 1000, 2).windows["train"], c.windows["train"])  # too long: dropped


def _mha_reference_logits(model: TransformerLM, ids: torch.Tensor) -> torch.Tensor:
    """The same LM with every MAE layer replaced by nn.MultiheadAttention (eq. 5), by hand."""
    cfg = model.cfg
    length = ids.shape[1]
    mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    x = model.tok(ids) + model.pos.weight[:length]
    for block in model.blocks:
        mha = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True).eval()
        with torch.no_grad():
            mha.in_proj_weight.copy_(block.attn.in_proj_weight)
            mha.in_proj_bias.copy_(block.attn.in_proj_bias)
            mha.out_proj.load_state_dict(block.attn.out_proj.state_dict())
        h = block.ln1(x)
        x = x + mha(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + block.ffn(block.ln2(x))
    return model.ln(x) @ model.tok.weight.T


def test_lm_with_uniform_routing_is_a_plain_transformer_and_causal() -> None:
    torch.manual_seed(0)
    cfg = LMConfig(vocab=13, dim=16, heads=4, layers=2, ffn=32, seq=10, gate_hidden=8, gate_context=3, dropout=0.0)
    model = TransformerLM(cfg).eval()
    for block in model.blocks:  # learned, non-uniform gates: routing decides what is computed
        with torch.no_grad():
            block.attn.gate.out.weight.normal_(0, 3.0)
    ids = torch.randint(13, (2, 10))
    logits, gates = model(ids, return_gates=True)
    assert logits.shape == (2, 10, 13) and len(gates) == 2 and gates[0].shape == (2, 10, 4)
    assert (gates[0] - 0.25).abs().max() > 0.05  # the gate mixture is not uniform...
    ids2 = ids.clone()
    ids2[:, 7] = (ids2[:, 7] + 1) % 13
    torch.testing.assert_close(model(ids2)[:, :7], logits[:, :7])  # ...and no position sees the future
    set_routing(model, "uniform")
    with torch.no_grad():
        want = _mha_reference_logits(model, ids)
        torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=1e-5)
        assert (want - logits).abs().max() > 1e-3  # uniform routing differs from the gate mixture
        batch = torch.randint(13, (2, 11))
        ref = F.cross_entropy(_mha_reference_logits(model, batch[:, :-1]).reshape(-1, 13), batch[:, 1:].reshape(-1))
        torch.testing.assert_close(lm_loss(model, batch), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cfg.seq"):
        model(torch.randint(13, (1, 11)))


def test_entropy_and_shares_on_fixed_gates() -> None:
    e = 4
    uniform = torch.full((3, 5, e), 1 / e)
    mean, per = mean_entropy([uniform, uniform])
    assert math.isclose(mean, math.log(e), rel_tol=1e-6) and len(per) == 2
    one_hot = torch.nn.functional.one_hot(torch.tensor([[0, 0, 1, 3]]), e).float()
    assert mean_entropy([one_hot])[0] == pytest.approx(0.0, abs=1e-6)
    assert attribution_shares(one_hot) == [50.0, 25.0, 0.0, 25.0]


def test_pmi_matches_a_hand_count() -> None:
    # tokens 0,0,1,1 ; experts 0,0,0,1 -> p(tok1, e1) = 1/4, p(tok1) = 1/2, p(e1) = 1/4
    tokens = torch.tensor([0, 0, 1, 1])
    gates = torch.nn.functional.one_hot(torch.tensor([0, 0, 0, 1]), 2).float()
    out = pmi_tokens(tokens, gates, ["a", "b"], min_count=1, top=2)
    assert out[1] == [("b", pytest.approx(math.log(2.0)), 1)]
    assert [t for t, _, _ in out[0]] == ["a", "b"]
    assert out[0][0][1] == pytest.approx(math.log(0.5 / (0.5 * 0.75)))
    assert pmi_tokens(tokens, gates, ["a", "b"], min_count=3) == [[], []]


def test_collect_gates_equals_one_eval_forward_under_the_gate() -> None:
    torch.manual_seed(0)
    cfg = LMConfig(vocab=11, dim=16, heads=4, layers=2, ffn=32, seq=6, drop_heads=2, gate_hidden=8, gate_context=2)
    model = TransformerLM(cfg)
    for block in model.blocks:
        with torch.no_grad():
            block.attn.gate.out.weight.normal_(0, 3.0)
    set_routing(model, "uniform")  # collect_gates must switch to the learned gate itself
    windows = torch.randint(11, (5, 7))
    tokens, gates = collect_gates(model, windows, batch=2)
    assert torch.equal(tokens, windows[:, :-1])
    assert [g.shape for g in gates] == [(5, 6, 6), (5, 6, 6)]
    assert model.training  # restored
    # oracle: the learned gates of one whole-batch forward in eval mode (no dropout)
    model.eval()
    set_routing(model, "gate")
    with torch.no_grad():
        _, want = model(windows[:, :-1], return_gates=True)
    for g, w in zip(gates, want):
        torch.testing.assert_close(g, w)
        assert (w - 1 / 6).abs().max() > 0.05


def test_experiment_is_registered() -> None:
    assert "mae" in REGISTRY and "Peng" in REGISTRY["mae"].description
    assert REGISTRY["mae"].sweep is mae_exp.run and REGISTRY["mae"].quick_settings is mae_exp.QUICK
