"""The language-modelling text of the lm-routers experiment: the English Bible, characters, split by book.

The World English Bible (``sword-text-web``, loaded by :func:`routelab.data.load_parallel_text`)
is cut into its 66 books; each book is one document, its verses joined by newlines. Books are
assigned whole to a split by their canonical index ``i``: ``i % 8 == 4`` validation (the curves),
``i % 8 == 0`` test (the final perplexity), the rest training, so no held-out sentence shares a
chapter with a training one. Tokens are characters (byte-level would spend ids on nothing: the
text is ASCII but for a few letters); the vocabulary is every character of the training books plus
id 0 for a character seen only in held-out books.

Training batches are windows of ``seq + 1`` characters at offsets drawn from an explicit
generator (``torch.Generator``), so that every router sees the same batches in the same order for a
given seed; held-out windows are evenly spaced, non-overlapping and fixed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ...data.parallel_text import load_parallel_text, pairs_fingerprint

__all__ = ["CharCorpus", "build_corpus", "split_of_book"]

#: Unknown character (held out only).
UNK = "\x00"


def split_of_book(index: int) -> str:
    """``"val"``, ``"test"`` or ``"train"`` for the book at canonical position ``index`` (0 = Genesis)."""
    if index % 8 == 4:
        return "val"
    if index % 8 == 0:
        return "test"
    return "train"



@dataclass
class CharCorpus:
    """Character streams per split.

    Attributes:
        itos: the vocabulary (id -> character; id 0 is the unknown character).
        streams: split -> ``LongTensor [chars]`` (the split's books concatenated, each ending in a newline).
        books: split -> the book names in it.
        fingerprint: the fingerprint of the verse text it was built from
            (:func:`routelab.data.parallel_text.pairs_fingerprint`; ``""`` when built otherwise).
    """

    itos: list[str]
    streams: dict[str, Tensor]
    books: dict[str, list[str]]
    fingerprint: str = ""

    @property
    def vocab(self) -> int:
        return len(self.itos)

    def train_batches(self, steps: int, batch: int, seq: int, generator: torch.Generator) -> Tensor:
        """Offsets of every training batch: ``LongTensor [steps, batch]`` drawn uniformly from ``generator``."""
        n = self.streams["train"].numel() - seq - 1
        return torch.randint(0, n, (steps, batch), generator=generator)

    def windows(self, offsets: Tensor, seq: int, split: str = "train") -> Tensor:
        """``LongTensor [len(offsets), seq + 1]``: the windows starting at ``offsets`` in ``split``."""
        idx = offsets.reshape(-1, 1) + torch.arange(seq + 1)
        return self.streams[split][idx]

    def held_out(self, split: str, count: int, seq: int) -> Tensor:
        """``LongTensor [count, seq + 1]``: ``count`` non-overlapping windows evenly spread over ``split``.

        Raises:
            ValueError: the split holds fewer than ``count`` disjoint windows.
        """
        stream = self.streams[split]
        room = stream.numel() - seq - 1
        if count * (seq + 1) > stream.numel():
            raise ValueError(f"the {split} books hold {stream.numel()} characters, fewer than count={count} windows "
                             f"of seq + 1 = {seq + 1}; lower eval_windows or seq")
        starts = torch.linspace(0, room, count).long()
        return self.windows(starts, seq, split)


def build_corpus(cache_dir: str | None = None) -> CharCorpus:
    """Load the English Bible and split it by book (see the module docstring).

    Raises:
        routelab.data.DataUnavailable: the SWORD text is not installed (the message gives the command).
    """
    pairs = load_parallel_text(cache_dir)
    books: OrderedDict[str, list[str]] = OrderedDict()
    for p in pairs:
        books.setdefault(p.book, []).append(p.en)
    texts: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    names: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for i, (book, verses) in enumerate(books.items()):
        split = split_of_book(i)
        texts[split].append("\n".join(verses) + "\n")
        names[split].append(book)
    train_text = "".join(texts["train"])
    itos = [UNK] + sorted(set(train_text))
    stoi = {c: i for i, c in enumerate(itos)}
    streams = {s: torch.tensor([stoi.get(c, 0) for c in "".join(t)], dtype=torch.long) for s, t in texts.items()}
    return CharCorpus(itos, streams, names, pairs_fingerprint(pairs))
