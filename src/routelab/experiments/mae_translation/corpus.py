"""The translation corpus: Spanish -> English verse pairs of the parallel Bible, in BPE pieces.

Splits by verse index over the whole Bible (both testaments, canonical order): ``i % 20 == 0``
dev, ``i % 20 == 1`` test, the rest train. Text is NFKC-normalised and lower-cased; each side has
its own byte-pair encoding (as the paper's IWSLT14 setup: separate source and target
vocabularies), learned on the training split with HF ``tokenizers`` and saved next to the run, so
a resumed run reads exactly the same pieces. The pre-tokeniser is ``Metaspace`` (a word boundary
is a piece ``▁``), so :meth:`BPE.decode` gives back the normalised text exactly.

A pair whose source or target has more than ``max_len`` pieces, or no piece at all (an empty verse),
is left out of every split (the count is recorded in :attr:`TranslationCorpus.dropped`; at ``max_len``
128 it is a handful of verses, among them the glossary appended to the last verse of the English module).

Tensors: one row per pair, ``[n, src_len + tgt_len]`` int64, padded with :data:`PAD`: the first
``src_len`` columns are the source pieces then :data:`EOS`; the rest are :data:`BOS`, the target
pieces, :data:`EOS`. The model trims each batch to its longest row (:func:`split_batch`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from routelab.data.parallel_text import VersePair

from ..kit.store import atomic_write_text

__all__ = [
    "BOS", "EOS", "PAD", "SPECIALS", "UNK", "BPE", "TranslationCorpus", "build_corpus", "length_batches", "split_batch",
]

BUCKET = 50
"""Batches per bucket of :func:`length_batches`: pairs are sorted by length within groups of
``BUCKET * batch`` consecutive pairs of a random order."""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")
"""The special pieces, at ids :data:`PAD`, :data:`UNK`, :data:`BOS`, :data:`EOS` of both vocabularies."""


class BPE:
    """A byte-pair encoding of one language (HF ``tokenizers``), lower-casing and reversible.

    Build it with :meth:`train` or :meth:`load`; :meth:`encode` gives piece ids (no specials),
    :meth:`decode` the text (specials skipped).
    """

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer

    @staticmethod
    def _tokenizers():  # noqa: ANN205 - the module
        try:
            import tokenizers
        except ModuleNotFoundError as err:  # pragma: no cover - installed with the experiments / hf extras
            raise ModuleNotFoundError(
                "the MAE translation experiment needs HF tokenizers for its BPE; install it with "
                "`pip install tokenizers` (part of `pip install -e .[experiments]`).", name="tokenizers"
            ) from err
        return tokenizers

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> BPE:
        """Learn a BPE of at most ``vocab_size`` pieces (specials included) from ``texts``."""
        tk = cls._tokenizers()
        if vocab_size <= len(SPECIALS):
            raise ValueError(f"vocab_size must exceed the {len(SPECIALS)} special pieces, got {vocab_size}.")
        tok = tk.Tokenizer(tk.models.BPE(unk_token=SPECIALS[UNK]))
        tok.normalizer = tk.normalizers.Sequence([tk.normalizers.NFKC(), tk.normalizers.Lowercase()])
        tok.pre_tokenizer = tk.pre_tokenizers.Metaspace()
        tok.decoder = tk.decoders.Metaspace()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False)
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> BPE:
        """The encoding saved by :meth:`save`."""
        return cls(cls._tokenizers().Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        """Write the encoding as JSON (atomically)."""
        atomic_write_text(path, self._tok.to_str())  # type: ignore[attr-defined]

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())  # type: ignore[attr-defined]

    def normalize(self, text: str) -> str:
        """The text as the encoding sees it (NFKC, lower case): what :meth:`decode` gives back."""
        return self._tok.normalizer.normalize_str(text)  # type: ignore[attr-defined]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i >= len(SPECIALS)])  # type: ignore[attr-defined]


@dataclass
class TranslationCorpus:
    """Encoded splits and their references.

    Attributes:
        src_bpe, tgt_bpe: the Spanish and English encodings.
        data: split name (``train``, ``dev``, ``test``) -> ``[n, src_len + tgt_len]`` (module docstring).
        refs: split name -> the normalised English references, one per row of ``data``.
        src_len: source columns (longest source + EOS).
        dropped: pairs left out for having more than ``max_len`` pieces, or none, on a side.
    """

    src_bpe: BPE
    tgt_bpe: BPE
    data: dict[str, Tensor]
    refs: dict[str, list[str]]
    src_len: int
    dropped: int

    def sources(self, split: str) -> Tensor:
        """The source columns of ``split``: ``[n, src_len]``."""
        return self.data[split][:, : self.src_len]


def split_batch(batch: Tensor, src_len: int) -> tuple[Tensor, Tensor]:
    """``[B, src_len + tgt_len]`` rows -> ``(src [B, S], tgt [B, T])``, each trimmed to its longest row."""
    src, tgt = batch[:, :src_len], batch[:, src_len:]
    s = int((src != PAD).sum(1).max())
    t = int((tgt != PAD).sum(1).max())
    return src[:, : max(s, 1)], tgt[:, : max(t, 2)]


def length_batches(data: Tensor, batch: int, seed: int, epoch: int, batches_per_epoch: int) -> list[Tensor]:
    """The batches of ``epoch``, of pairs of similar length (less padding than random batches).

    Pass ``p`` over ``data`` ``[n, ...]`` draws a random order (generator seeded ``seed * 1000 + p``),
    sorts each group of ``BUCKET * batch`` consecutive pairs by length (source + target pieces),
    cuts the groups into batches of ``batch`` and shuffles the batches (same generator). Epoch ``e``
    takes the next ``batches_per_epoch`` batches, cycling through passes, so its batches depend only
    on the arguments (a resumed run sees the same ones). Every pair is in exactly one batch of a pass.
    """
    n = data.shape[0]
    lengths = (data != PAD).sum(1).cpu()
    passes: dict[int, list[Tensor]] = {}

    def batches_of_pass(p: int) -> list[Tensor]:
        if p not in passes:
            g = torch.Generator().manual_seed(seed * 1000 + p)
            order = torch.randperm(n, generator=g)
            out = []
            for start in range(0, n, BUCKET * batch):
                group = order[start: start + BUCKET * batch]
                group = group[torch.argsort(lengths[group], stable=True)]
                out += list(group.split(batch))
            passes[p] = [out[i] for i in torch.randperm(len(out), generator=g).tolist()]
        return passes[p]

    per_pass = len(batches_of_pass(0))
    first = epoch * batches_per_epoch
    return [data[batches_of_pass(k // per_pass)[k % per_pass].to(data.device)]
            for k in range(first, first + batches_per_epoch)]


def _split_of(i: int) -> str:
    return {0: "dev", 1: "test"}.get(i % 20, "train")


def build_corpus(pairs: list[VersePair], src_vocab: int, tgt_vocab: int, max_len: int,
                 bpe_dir: Path | None = None) -> TranslationCorpus:
    """Split, encode and pad the verse pairs (see the module docstring).

    Args:
        pairs: from :func:`routelab.data.load_parallel_text`.
        src_vocab, tgt_vocab: BPE sizes (specials included) of Spanish and English.
        max_len: the most pieces a side may have (EOS / BOS not counted).
        bpe_dir: where the encodings are saved (``bpe_es.json``, ``bpe_en.json``) and, when they
            exist with these sizes, read back instead of learned again.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}.")
    split_pairs: dict[str, list[VersePair]] = {"train": [], "dev": [], "test": []}
    for i, p in enumerate(pairs):
        split_pairs[_split_of(i)].append(p)
    bpes = []
    for lang, size in (("es", src_vocab), ("en", tgt_vocab)):
        path = None if bpe_dir is None else Path(bpe_dir) / f"bpe_{lang}.json"
        meta = None if path is None else path.with_suffix(".size")
        if path is not None and path.exists() and meta.exists() and json.loads(meta.read_text()) == size:
            bpes.append(BPE.load(path))
            continue
        bpe = BPE.train([getattr(p, lang) for p in split_pairs["train"]], size)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            bpe.save(path)
            atomic_write_text(meta, json.dumps(size))
        bpes.append(bpe)
    src_bpe, tgt_bpe = bpes
    encoded: dict[str, list[tuple[list[int], list[int], str]]] = {}
    dropped = 0
    for split, ps in split_pairs.items():
        rows = []
        for p in ps:
            s, t = src_bpe.encode(p.es), tgt_bpe.encode(p.en)
            if not s or not t or len(s) > max_len or len(t) > max_len:
                dropped += 1
                continue
            rows.append((s, t, tgt_bpe.normalize(p.en)))
        encoded[split] = rows
    src_len = 1 + max(len(s) for rows in encoded.values() for s, _, _ in rows)
    tgt_len = 2 + max(len(t) for rows in encoded.values() for _, t, _ in rows)
    data, refs = {}, {}
    for split, rows in encoded.items():
        x = torch.full((len(rows), src_len + tgt_len), PAD, dtype=torch.long)
        for r, (s, t, _) in enumerate(rows):
            x[r, : len(s) + 1] = torch.tensor([*s, EOS])
            x[r, src_len: src_len + len(t) + 2] = torch.tensor([BOS, *t, EOS])
        data[split] = x
        refs[split] = [ref for _, _, ref in rows]
    return TranslationCorpus(src_bpe, tgt_bpe, data, refs, src_len, dropped)
