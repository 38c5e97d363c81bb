"""The Spanish-English parallel Bible (31k verse pairs) from the Debian SWORD packages.

English: World English Bible (``sword-text-web``, module ``engWEB2015eb``); Spanish: Reina-Valera
1909 (``sword-text-sparv``, module ``spaRV1909eb``); both public domain. The texts are exported
with ``mod2imp`` (``libsword-utils``) as raw OSIS: records are a ``$$$Book C:V`` line followed by
the verse's marked-up text. Verses are aligned by key; chapter/book introductions (``C:0``,
``0:0``) are dropped, and the markup is stripped by :func:`verse_text` (footnotes, headings and
anything after a book's end, such as the WEB glossary after Revelation 22:21, are dropped).

The aligned pairs are cached as gzipped JSON lines under a version header, so ``mod2imp`` runs
once per cache dir; a cache written by an older parser is rebuilt.
"""

from __future__ import annotations

import gzip
import hashlib
import html
import json
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from routelab.data.errors import DataUnavailable

__all__ = [
    "ENGLISH_MODULE",
    "INSTALL_COMMAND",
    "SPANISH_MODULE",
    "VersePair",
    "load_parallel_text",
    "pairs_fingerprint",
    "parse_imp",
    "verse_text",
]

ENGLISH_MODULE = "engWEB2015eb"
SPANISH_MODULE = "spaRV1909eb"
INSTALL_COMMAND = "apt-get install -y libsword-utils sword-text-web sword-text-sparv"
_CACHE_NAME = "parallel_text_es_en.jsonl.gz"
#: The cache's first line. Bump the version whenever the text :func:`verse_text` produces changes:
#: a cache without this exact header (version 1 had no header) is rebuilt, never served.
_CACHE_HEADER = {"routelab_parallel_text": 2}
_KEY = re.compile(r"^(?P<book>.+?) (?P<chapter>\d+):(?P<verse>\d+)$")
_TAG = re.compile(r"<[^>]*>")
_SPACE = re.compile(r"\s+")
# the closing tag of a book (<div ... eID="..." ... type="book"/>): what follows it in a verse
# record is not in the book (after Revelation 22:21: the 17.5k-character WEB glossary)
_BOOK_END = re.compile(r'<div\b(?=[^>]*\beID=)(?=[^>]*\btype="book")[^>]*>')
# elements that are not verse text, dropped with their content: footnotes, headings (the English
# psalm titles, as `mod2imp -s` drops them too), the Song of Solomon's speaker labels
_NOT_TEXT = re.compile(r"<(note|title|speaker)\b[^>]*?(?:/>|>.*?</\1\s*>)", re.DOTALL)
# the edges of a <w> element (one source word, with its Strong's number)
_WORD_EDGE = re.compile(r"</?w\b[^>]*>")
# inline phrase markup, which can sit inside a word ("preguntándo<transChange>le</transChange>")
_INLINE = re.compile(
    r"</?(?:q|transChange|divineName|hi|foreign|seg|name|reference|rdg|catchWord|abbr|index)\b[^>]*>"
)
_EDGE = "\x00"  # stands for a dropped element or a word edge until the spacing is decided
# a word edge becomes a space after a word or closing punctuation and before a word or an
# opening quote/bracket; elsewhere ("God</w>’s", "end</w>.") it vanishes
_EDGE_SPACE = re.compile(r"(?<=[\w.,;:!?”’)\]])\x00+(?=[\w“‘(\[])")


@dataclass(frozen=True)
class VersePair:
    """One aligned verse.

    Attributes:
        book: book name as in the SWORD key (``"Genesis"``).
        chapter, verse: numbers from the key (both >= 1).
        testament: 1 (Old) or 2 (New), from the module's testament headings.
        es, en: the Spanish and English text, markup stripped by :func:`verse_text`.
    """

    book: str
    chapter: int
    verse: int
    testament: int
    es: str
    en: str

    @property
    def key(self) -> str:
        """``"Book C:V"``."""
        return f"{self.book} {self.chapter}:{self.verse}"


def verse_text(osis: str) -> str:
    """The plain text of one raw OSIS verse record (``mod2imp MODULE`` without ``-s``).

    Cuts the record at the book's closing ``<div ... eID=... type="book"/>`` (after Revelation
    22:21 the WEB glossary follows it), drops ``<note>``, ``<title>`` and ``<speaker>`` elements
    with their content, and strips the other tags: the edge of a ``<w>`` element or of a dropped
    element separates words (``God</w><note>…</note><w>created`` -> ``God created``; ``mod2imp
    -s`` fused these into ``Godcreated``) unless punctuation is next to it; inline markup such as
    ``<transChange>`` and ``<q>`` vanishes; any other tag (line, paragraph and chapter markers)
    is a space. Entities are unescaped and whitespace is collapsed. Plain text passes unchanged
    but for the whitespace.
    """
    end = _BOOK_END.search(osis)
    if end is not None:
        osis = osis[: end.start()]
    text = _NOT_TEXT.sub(_EDGE, osis.replace(_EDGE, " "))
    text = _WORD_EDGE.sub(_EDGE, text)
    text = _TAG.sub(" ", _INLINE.sub("", text))
    text = _EDGE_SPACE.sub(" ", text).replace(_EDGE, "")
    return _SPACE.sub(" ", html.unescape(text)).strip()


def parse_imp(text: str) -> dict[tuple[str, int, int], tuple[int, str]]:
    """Parse ``mod2imp`` output into ``{(book, chapter, verse): (testament, text)}``.

    Keeps keys ending in ``C:V`` with ``C, V >= 1`` (not ``:0``), strips the markup with
    :func:`verse_text` and drops empty verses. The testament is 1 until a
    ``[ Testament 2 Heading ]`` record, then 2.
    """
    out: dict[tuple[str, int, int], tuple[int, str]] = {}
    testament = 1
    key: tuple[str, int, int] | None = None
    lines: list[str] = []

    def flush() -> None:
        if key is not None:
            plain = verse_text("\n".join(lines))
            if plain:
                out[key] = (testament, plain)

    for line in text.splitlines():
        if line.startswith("$$$"):
            flush()
            lines = []
            header = line[3:].strip()
            if "Testament 2 Heading" in header:
                testament = 2
            m = _KEY.match(header)
            key = None
            if m and int(m["verse"]) >= 1 and int(m["chapter"]) >= 1:
                key = (m["book"], int(m["chapter"]), int(m["verse"]))
        else:
            lines.append(line)
    flush()
    return out


def _export(module: str) -> str:
    """``mod2imp MODULE`` (raw OSIS) as text; DataUnavailable if the tool or module is missing."""
    exe = shutil.which("mod2imp")
    if exe is None:
        raise DataUnavailable(
            f"mod2imp (Debian libsword-utils) is not installed; install the parallel text with "
            f"`{INSTALL_COMMAND}` (or `make data`)."
        )
    proc = subprocess.run([exe, module], capture_output=True, check=False)
    text = proc.stdout.decode("utf-8", errors="replace")
    if proc.returncode != 0 or "$$$" not in text:
        raise DataUnavailable(
            f"mod2imp could not export the SWORD module {module!r} (exit {proc.returncode}); "
            f"install it with `{INSTALL_COMMAND}` (or `make data`)."
        )
    return text


def pairs_fingerprint(pairs: list[VersePair]) -> str:
    """A short fingerprint of the text ``pairs`` hold (the first 16 hex digits of a SHA-256 over every pair's
    fields, in order).

    Experiments store it in every run record, so that a results directory resumed after the text changed
    (another parser, other Debian packages) is refused instead of mixing runs on two texts in one report.
    """
    h = hashlib.sha256()
    for p in pairs:
        h.update(json.dumps(asdict(p), ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:16]


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "routelab"


def _read_cache(path: Path) -> list[VersePair] | None:
    """The pairs cached at ``path``, or None if it was written by an older parser (no or another
    header); ValueError if it cannot be read."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            first = f.readline()
            if not first.strip() or json.loads(first) != _CACHE_HEADER:
                return None
            return [VersePair(**json.loads(line)) for line in f if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, ValueError, TypeError) as err:
        raise ValueError(
            f"the parallel-text cache {path} is unreadable ({type(err).__name__}: {err}); "
            f"delete it or call load_parallel_text(refresh=True) to rebuild it."
        ) from err


def _write_cache(path: Path, pairs: list[VersePair]) -> None:
    """Write the header and ``pairs`` to ``path`` atomically.

    Each writer uses its own temporary file beside ``path`` (a random name, opened with
    ``O_EXCL``), then ``os.replace``s it over ``path``; so processes building the same cache at
    once all succeed, and readers see a complete cache or none. The bytes are deterministic
    (gzip mtime 0), so which writer's file ends up at ``path`` does not matter.
    """
    lines = [json.dumps(_CACHE_HEADER)] + [json.dumps(asdict(p), ensure_ascii=False) for p in pairs]
    data = gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    # 0o666 less the umask, as a plain open() would give (tempfile.mkstemp would make it 0o600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_parallel_text(
    cache_dir: str | os.PathLike[str] | None = None, *, refresh: bool = False
) -> list[VersePair]:
    """All verses present in both translations, in canonical (English module) order.

    Args:
        cache_dir: where the aligned pairs are cached (default ``$XDG_CACHE_HOME/routelab`` or
            ``~/.cache/routelab``). Several processes may build the same cache at once.
        refresh: re-export with ``mod2imp`` even if the cache exists (where ``mod2imp`` is missing
            this raises, saying so, and the cache is left as it was).

    Returns:
        31,077 :class:`VersePair` with the Debian packages of 2026.

    Raises:
        DataUnavailable: if ``mod2imp`` or either SWORD module is not installed (the message
            gives the install command), including when the cache was written by an older
            parser and so must be rebuilt.
        ValueError: if the cache file exists but cannot be read (delete it or ``refresh``).
    """
    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    path = cache / _CACHE_NAME
    stale = False
    if path.exists() and not refresh:
        cached = _read_cache(path)
        if cached is not None:
            return cached
        stale = True
    try:
        en = parse_imp(_export(ENGLISH_MODULE))
        es = parse_imp(_export(SPANISH_MODULE))
    except DataUnavailable as err:
        if stale:
            raise DataUnavailable(
                f"the parallel-text cache {path} was written by an older version of routelab's "
                f"parser (its text has known defects), and it cannot be rebuilt here: {err} "
                f"Rebuild it where the Debian packages are (`make gpu-data` writes data-cache/) "
                f"and copy it here."
            ) from err
        if refresh and path.exists():
            raise DataUnavailable(
                f"refresh=True rebuilds the parallel-text cache {path}, which cannot be done here: {err} "
                f"Without refresh the existing cache is read."
            ) from err
        if cache_dir is None:
            raise
        # a given directory without the cache (a typo?) is said, beside how to build the cache
        raise DataUnavailable(f"no cached parallel text at {path} (is cache_dir / --data-dir right? `make gpu-data` "
                              f"writes one to data-cache/), and it cannot be built here: {err}") from err
    pairs = [
        VersePair(book, ch, v, testament, es[(book, ch, v)][1], text)
        for (book, ch, v), (testament, text) in en.items()
        if (book, ch, v) in es
    ]
    if not pairs:
        raise DataUnavailable(
            f"no verse is shared by {ENGLISH_MODULE} and {SPANISH_MODULE}; reinstall with "
            f"`{INSTALL_COMMAND}`."
        )
    cache.mkdir(parents=True, exist_ok=True)
    _write_cache(path, pairs)
    return pairs
