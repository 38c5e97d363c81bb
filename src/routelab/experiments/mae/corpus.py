"""The language-modelling corpus: the English side of the parallel Bible, word-level.

Old Testament = the pretraining domain (train / dev / test by verse index mod 20); New
Testament = the held-out domain of the transfer study (Sec. 5.2): fine-tune / dev split by
verse index mod 10. Text is lower-cased and split into words and punctuation; the vocabulary is
the most frequent words of the Old Testament training verses, the rest map to ``<unk>``. Each
split is one stream of tokens (verses separated by ``<eos>``) cut into windows of ``seq + 1``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from routelab.data.parallel_text import VersePair

__all__ = ["Corpus", "build_corpus", "tokenize"]

_TOKEN = re.compile(r"\w+|[^\w\s]")
UNK, EOS = "<unk>", "<eos>"
MAX_VERSE_TOKENS = 120  # drops the glossary appended to the last verse of the WEB module


def tokenize(text: str) -> list[str]:
    """Lower-cased words and punctuation marks."""
    return _TOKEN.findall(text.lower())


@dataclass
class Corpus:
    """Token windows per split.

    Attributes:
        itos: the vocabulary (id -> token).
        windows: split name -> LongTensor ``[n, seq + 1]``.
    """

    itos: list[str]
    windows: dict[str, Tensor]

    @property
    def vocab(self) -> int:
        return len(self.itos)


def _windows(verses: list[list[str]], stoi: dict[str, int], seq: int) -> Tensor:
    ids: list[int] = []
    unk, eos = stoi[UNK], stoi[EOS]
    for toks in verses:
        ids.extend(stoi.get(t, unk) for t in toks)
        ids.append(eos)
    n = (len(ids) - 1) // seq
    t = torch.tensor(ids[: n * seq + 1])
    return torch.stack([t[i * seq: i * seq + seq + 1] for i in range(n)])


def build_corpus(pairs: list[VersePair], vocab_size: int, seq: int) -> Corpus:
    """Split, tokenise and window the English verses (see the module docstring)."""
    ot = [tokenize(p.en) for p in pairs if p.testament == 1]
    nt = [tokenize(p.en) for p in pairs if p.testament == 2]
    ot = [v for v in ot if len(v) <= MAX_VERSE_TOKENS]
    nt = [v for v in nt if len(v) <= MAX_VERSE_TOKENS]
    splits = {
        "train": [v for i, v in enumerate(ot) if i % 20 >= 2],
        "dev": [v for i, v in enumerate(ot) if i % 20 == 0],
        "test": [v for i, v in enumerate(ot) if i % 20 == 1],
        "nt_train": [v for i, v in enumerate(nt) if i % 10 >= 2],
        "nt_dev": [v for i, v in enumerate(nt) if i % 10 == 0],
        "nt_test": [v for i, v in enumerate(nt) if i % 10 == 1],
    }
    counts = Counter(t for v in splits["train"] for t in v)
    itos = [UNK, EOS] + [t for t, _ in counts.most_common(vocab_size - 2)]
    stoi = {t: i for i, t in enumerate(itos)}
    return Corpus(itos, {k: _windows(v, stoi, seq) for k, v in splits.items()})
