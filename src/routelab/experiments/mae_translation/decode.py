"""Beam search for :class:`~.model.TranslationModel` (the paper decodes with beam size 5), and BLEU.

A hypothesis is scored by its summed log-probability divided by ``length ** len_penalty`` (its
length in pieces, EOS included; fairseq's convention). Each step feeds one piece per hypothesis to
the decoder's incremental form (:meth:`~.model.TranslationModel.step`: cached inputs and running
gate means, equal to the full decoder's last position), at most ``max_steps`` steps.

Finished hypotheses (EOS chosen among the ``beam`` best candidates) leave the beam; a sentence is
done once it has ``beam`` of them, or once no live hypothesis can still beat its best one (a
score only falls as pieces are added, so a live hypothesis's best final score is at most its
score over ``max_steps ** len_penalty``). At ``max_steps`` the live hypotheses are finished as
they are. The result is the best finished hypothesis. With ``beam=1`` this is greedy decoding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .corpus import BOS, EOS, PAD
from .model import TranslationModel

__all__ = ["beam_search", "corpus_bleu", "translate"]


@torch.no_grad()
def beam_search(model: TranslationModel, src: Tensor, *, beam: int = 5, max_steps: int | None = None,
                len_penalty: float = 1.0) -> list[list[int]]:
    """The best hypothesis per source sentence.

    Args:
        model: in eval mode, its MAE layers set to the routing to decode with.
        src: ``[B, S]`` source ids (EOS-terminated, :data:`~.corpus.PAD`-padded).
        beam: hypotheses kept per sentence (>= 1).
        max_steps: most pieces generated, EOS included (default: ``1.5 * S + 10``, capped by the
            model's ``max_len - 1``).
        len_penalty: exponent of the length normalisation (0: raw log-probability).

    Returns:
        per sentence, the target piece ids without BOS and EOS.
    """
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}.")
    cap = model.cfg.max_len - 1
    steps = min(cap, int(1.5 * src.shape[1]) + 10) if max_steps is None else max_steps
    if not 1 <= steps <= cap:
        raise ValueError(f"max_steps must be in [1, model.cfg.max_len - 1 = {cap}], got {steps}.")
    batch, device = src.shape[0], src.device
    memory, src_pad = model.encode(src)
    state = model.start(memory.repeat_interleave(beam, dim=0), src_pad.repeat_interleave(beam, dim=0))  # B * beam
    ys = torch.full((batch * beam, 1), BOS, dtype=torch.long, device=device)
    scores = torch.full((batch, beam), -math.inf, device=device)
    scores[:, 0] = 0.0  # one live hypothesis (BOS) at first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    done = [False] * batch
    denom = steps ** len_penalty
    for t in range(1, steps + 1):
        logp = torch.log_softmax(model.step(state, ys[:, -1]).float(), dim=-1)
        logp[:, PAD] = logp[:, BOS] = -math.inf  # never generated
        vocab = logp.shape[-1]
        cand = (scores.unsqueeze(-1) + logp.view(batch, beam, vocab)).view(batch, beam * vocab)
        top, idx = cand.topk(min(2 * beam, beam * vocab), dim=1)  # [B, 2 beam]
        src_beam, tok = idx // vocab, idx % vocab
        is_eos = tok == EOS
        # Finished: an EOS among the beam best candidates (a finite score) of a sentence not yet done.
        # (Read back from the device in a few transfers per step, not one per hypothesis.)
        ended = [(b, r) for b, r in (is_eos[:, :beam] & torch.isfinite(top[:, :beam])).nonzero().tolist()
                 if not done[b]]
        if ended:
            top_h, src_beam_h = top.cpu(), src_beam.cpu()
            prefixes = ys[[b * beam + int(src_beam_h[b, r]) for b, r in ended], 1:].tolist()
            for (b, r), prefix in zip(ended, prefixes):
                finished[b].append((float(top_h[b, r]) / t ** len_penalty, prefix))
        # Live: the beam best candidates that are not EOS (stable sort keeps their rank order).
        keep = torch.argsort(is_eos.to(torch.int8), dim=1, stable=True)[:, :beam]
        scores = top.gather(1, keep)
        rows = (torch.arange(batch, device=device).unsqueeze(1) * beam + src_beam.gather(1, keep)).view(-1)
        ys = torch.cat([ys[rows], tok.gather(1, keep).view(-1, 1)], dim=1)
        state.reorder(rows)
        best_live = scores.max(dim=1).values.tolist()
        for b in range(batch):
            if not done[b] and finished[b]:
                best = max(f[0] for f in finished[b])
                done[b] = len(finished[b]) >= beam or best_live[b] / denom <= best
        if all(done):
            break
    else:  # max_steps reached: the live hypotheses end here
        scores_h, ys_h = scores.cpu().tolist(), ys[:, 1:].cpu().tolist()
        for b in range(batch):
            if not done[b]:
                for r in range(beam):
                    if math.isfinite(scores_h[b][r]):
                        finished[b].append((scores_h[b][r] / steps ** len_penalty, ys_h[b * beam + r]))
    return [max(f, key=lambda x: x[0])[1] for f in finished]


def translate(model: TranslationModel, src: Tensor, *, beam: int = 5, batch: int = 64, len_penalty: float = 1.0,
              max_steps: int | None = None) -> list[list[int]]:
    """:func:`beam_search` over ``src`` ``[n, S]``, in the input's order.

    Sentences are decoded in batches of ``batch`` of similar length (sorted by source length, each
    batch trimmed to its longest source), so that little is padding and the default step bound of
    each batch fits its sentences.
    """
    lengths = (src != PAD).sum(1)
    order = torch.argsort(lengths, stable=True).tolist()
    out: list[list[int] | None] = [None] * src.shape[0]
    for i in range(0, len(order), batch):
        rows = order[i: i + batch]
        b = src[rows][:, : max(1, int(lengths[rows].max()))]
        for r, hyp in zip(rows, beam_search(model, b, beam=beam, len_penalty=len_penalty, max_steps=max_steps)):
            out[r] = hyp
    return out  # type: ignore[return-value]


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU by sacrebleu (its default 13a tokenisation) of lower-cased detokenised text."""
    try:
        import sacrebleu
    except ModuleNotFoundError as err:  # pragma: no cover - part of the experiments extra
        raise ModuleNotFoundError("BLEU needs sacrebleu; install it with `pip install sacrebleu` "
                                  "(part of `pip install -e .[experiments]`).", name="sacrebleu") from err
    if len(hypotheses) != len(references):
        raise ValueError(f"one hypothesis per reference: got {len(hypotheses)} and {len(references)}.")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)
