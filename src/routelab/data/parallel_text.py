"""The Spanish-English parallel Bible (31k verse pairs) from the Debian SWORD packages.

English: World English Bible (``sword-text-web``, module ``engWEB2015eb``); Spanish: Reina-Valera
1909 (``sword-text-sparv``, module ``spaRV1909eb``); both public domain. The texts are exported
with ``mod2imp`` (``libsword-utils``): records are a ``$$$Book C:V`` line followed by the verse
text. Verses are aligned by key; chapter/book introductions (``C:0``, ``0:0``) are dropped, and
``<...>`` tags (Strong's numbers in the Spanish) are stripped.

The aligned pairs are cached as gzipped JSON lines, so ``mod2imp`` runs once per cache dir.
"""

from __future__ import annotations

import gzip
import json
import os
import re
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
    "parse_imp",
]

ENGLISH_MODULE = "engWEB2015eb"
SPANISH_MODULE = "spaRV1909eb"
INSTALL_COMMAND = "apt-get install -y libsword-utils sword-text-web sword-text-sparv"
_CACHE_NAME = "parallel_text_es_en.jsonl.gz"
_KEY = re.compile(r"^(?P<book>.+?) (?P<chapter>\d+):(?P<verse>\d+)$")
_TAG = re.compile(r"<[^>]*>")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class VersePair:
    """One aligned verse.

    Attributes:
        book: book name as in the SWORD key (``"Genesis"``).
        chapter, verse: numbers from the key (both >= 1).
        testament: 1 (Old) or 2 (New), from the module's testament headings.
        es, en: the Spanish and English text, tags stripped, whitespace collapsed.
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


def parse_imp(text: str) -> dict[tuple[str, int, int], tuple[int, str]]:
    """Parse ``mod2imp`` output into ``{(book, chapter, verse): (testament, text)}``.

    Keeps keys ending in ``C:V`` with ``V >= 1`` (not ``:0``), strips ``<...>`` tags, collapses
    whitespace and drops empty verses. The testament is 1 until a ``[ Testament 2 Heading ]``
    record, then 2.
    """
    out: dict[tuple[str, int, int], tuple[int, str]] = {}
    testament = 1
    key: tuple[str, int, int] | None = None
    lines: list[str] = []

    def flush() -> None:
        if key is not None:
            verse_text = _SPACE.sub(" ", _TAG.sub(" ", " ".join(lines))).strip()
            if verse_text:
                out[key] = (testament, verse_text)

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
    """``mod2imp MODULE -s`` as text; DataUnavailable if the tool or module is missing."""
    exe = shutil.which("mod2imp")
    if exe is None:
        raise DataUnavailable(
            f"mod2imp (Debian libsword-utils) is not installed; install the parallel text with "
            f"`{INSTALL_COMMAND}` (or `make data`)."
        )
    proc = subprocess.run([exe, module, "-s"], capture_output=True, check=False)
    text = proc.stdout.decode("utf-8", errors="replace")
    if proc.returncode != 0 or "$$$" not in text:
        raise DataUnavailable(
            f"mod2imp could not export the SWORD module {module!r} (exit {proc.returncode}); "
            f"install it with `{INSTALL_COMMAND}` (or `make data`)."
        )
    return text


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "routelab"


def load_parallel_text(
    cache_dir: str | os.PathLike[str] | None = None, *, refresh: bool = False
) -> list[VersePair]:
    """All verses present in both translations, in canonical (English module) order.

    Args:
        cache_dir: where the aligned pairs are cached (default ``$XDG_CACHE_HOME/routelab`` or
            ``~/.cache/routelab``).
        refresh: re-export with ``mod2imp`` even if the cache exists.

    Returns:
        About 31k :class:`VersePair`.

    Raises:
        DataUnavailable: if ``mod2imp`` or either SWORD module is not installed (the message
            gives the install command).
        ValueError: if the cache file exists but cannot be read (delete it or ``refresh``).
    """
    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    path = cache / _CACHE_NAME
    if path.exists() and not refresh:
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return [VersePair(**json.loads(line)) for line in f if line.strip()]
        except (OSError, EOFError, UnicodeDecodeError, ValueError, TypeError) as err:
            raise ValueError(
                f"the parallel-text cache {path} is unreadable ({type(err).__name__}: {err}); "
                f"delete it or call load_parallel_text(refresh=True) to rebuild it."
            ) from err
    try:
        en = parse_imp(_export(ENGLISH_MODULE))
        es = parse_imp(_export(SPANISH_MODULE))
    except DataUnavailable as err:
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
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for p in pairs:
            f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return pairs
