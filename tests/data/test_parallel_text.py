"""The parallel text's parser (raw OSIS ``mod2imp`` records -> verse text) and its cache.

The parser tests run on short records in the real export's format (``mod2imp MODULE``, no ``-s``),
cut from engWEB2015eb and spaRV1909eb, and compare with the verses as printed in the World English
Bible and the Reina-Valera 1909. The tests on the installed modules are skipped where the Debian
SWORD packages are not installed.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from routelab.data import parallel_text
from routelab.data.errors import DataUnavailable
from routelab.data.parallel_text import VersePair, load_parallel_text, parse_imp, verse_text

_W = '<w lemma="strong:H0430">'  # a Strong's-tagged word's opening tag, as in the modules

# Genesis 1:1 as exported: a footnote sits between two <w> words ("God" and "created")
GEN_1_1 = (
    f'{_W}In</w> {_W}the</w> {_W}beginning</w>, {_W}God</w><note placement="foot"><reference '
    'type="annotateRef">1:1 </reference>The Hebrew word rendered “God” is “אֱלֹהִ֑ים” (Elohim).</note>'
    f'{_W}created</w> {_W}the</w> {_W}heavens</w> {_W}and</w> {_W}the</w> {_W}earth</w>.'
)
# Revelation 22:21: the book closes, then the WEB glossary follows in the same record
REV_22_21 = (
    '<div type="x-milestone" subType="x-preverse" sID="pv16039"/><div sID="gen35836" type="x-p"/>'
    f'<div type="x-milestone" subType="x-preverse" eID="pv16039"/>{_W}The</w> {_W}grace</w> {_W}of</w> '
    f'{_W}the</w> {_W}Lord</w> {_W}Jesus</w> {_W}Christ</w> {_W}be</w> {_W}with</w> {_W}all</w> {_W}the</w> '
    'saints. Amen.  <chapter eID="Rev.22"/><div eID="gen35836" type="x-p"/> '
    '<div canonical="true" eID="gen35575" osisID="Rev" type="book"/> <div sID="gen35837" type="glossary"/> '
    '<milestone n="Glossary" type="x-usfm-h"/> <title level="1" type="main">World English Bible Glossary</title> '
    '<div sID="gen35838" type="introduction"/> <div sID="gen35839" type="x-p"/> The following words used in '
    'the World English Bible (WEB) are not very common.<div eID="gen35839" type="x-p"/> <list> <item '
    'subType="x-introduction" type="x-indent-1"><seg type="keyword">Abaddon</seg> Abaddon is Hebrew for '
    'destruction.</item> </list> <div eID="gen35837" type="glossary"/>'
)


def _imp(records: dict[str, str], new_testament: dict[str, str] | None = None) -> str:
    """An ``mod2imp`` export: the module and testament headings, then ``$$$key`` records."""
    out = ["$$$[ Module Heading ]", "", "$$$[ Testament 1 Heading ]",
           '<milestone type="x-importer" subType="x-osis2mod" n="$Rev: 3769 $ (SWORD: 1.9.0)"/>']
    for key, text in records.items():
        out += [f"$$${key}", text]
    if new_testament is not None:
        out += ["$$$[ Testament 2 Heading ]", '<milestone type="x-importer"/>']
        for key, text in new_testament.items():
            out += [f"$$${key}", text]
    return "\n".join(out) + "\n"


EN_IMP = _imp(
    {
        "Genesis 0:0": '<div canonical="true" osisID="Gen" sID="gen2" type="book"/> <title level="1" '
                       'type="main">Preface to the World English Bible</title> The Holy Bible is a collection.',
        "Genesis 1:0": '<chapter n="1" osisID="Gen.1" sID="Gen.1"/>',
        "Genesis 1:1": GEN_1_1,
        "Genesis 50:26": f'{_W}So</w> Joseph died.<chapter eID="Gen.50"/> '
                         '<div canonical="true" eID="gen24" osisID="Gen" type="book"/>',
    },
    {"Revelation of John 22:21": REV_22_21},
)
ES_IMP = _imp(
    {
        "Genesis 1:1": f'{_W}EN el principio</w> {_W}crió</w> {_W}Dios</w> {_W}los cielos</w> {_W}y la tierra</w>.',
        "Genesis 50:26": f'{_W}Y murió José</w>.',
    },
    {"Revelation of John 22:21": f'{_W}La</w> {_W}gracia</w> {_W}de nuestro</w> {_W}Señor</w> '
                                 f'{_W}Jesucristo</w> {_W}sea con</w> {_W}todos</w> {_W}vosotros</w>. '
                                 f'{_W}Amén</w>.  <chapter eID="Rev.22"/> '
                                 '<div canonical="true" eID="gen1234" osisID="Rev" type="book"/>'},
)
GEN_1_1_EN = "In the beginning, God created the heavens and the earth."
REV_22_21_EN = "The grace of the Lord Jesus Christ be with all the saints. Amen."
EXPECTED = [  # (key, testament, es, en), in the English module's order
    ("Genesis 1:1", 1, "EN el principio crió Dios los cielos y la tierra.", GEN_1_1_EN),
    ("Genesis 50:26", 1, "Y murió José.", "So Joseph died."),
    ("Revelation of John 22:21", 2, "La gracia de nuestro Señor Jesucristo sea con todos vosotros. Amén.",
     REV_22_21_EN),
]


def _as_tuples(pairs: list[parallel_text.VersePair]) -> list[tuple[str, int, str, str]]:
    return [(p.key, p.testament, p.es, p.en) for p in pairs]


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``_export`` replaced by the synthetic exports above; the list records the modules exported."""
    calls: list[str] = []

    def export(module: str) -> str:
        calls.append(module)
        return {parallel_text.ENGLISH_MODULE: EN_IMP, parallel_text.SPANISH_MODULE: ES_IMP}[module]

    monkeypatch.setattr(parallel_text, "_export", export)
    return calls


def _no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(module: str) -> str:
        raise DataUnavailable("mod2imp (Debian libsword-utils) is not installed")

    monkeypatch.setattr(parallel_text, "_export", unavailable)


# ---------------------------------------------------------------------------------------- the parser


def test_a_footnote_between_two_words_leaves_a_space():
    """`mod2imp -s` dropped the note and nothing else: "Godcreated" (review finding 5)."""
    assert verse_text(GEN_1_1) == GEN_1_1_EN


def test_the_glossary_after_the_last_verse_of_revelation_is_cut():
    """Rev 22:21's English side was the verse and then the whole 17.5k-character glossary."""
    assert verse_text(REV_22_21) == REV_22_21_EN


@pytest.mark.parametrize(
    ("osis", "plain"),
    [
        # a note before closing punctuation leaves no space (Exodus 30:13)
        (f"(the shekel is twenty {_W}gerahs</w><note placement=\"foot\">a gerah is about 0.5 grams</note>); "
         f"{_W}half</w>", "(the shekel is twenty gerahs); half"),
        # a note with a space after it leaves one space (Genesis 2:12)
        (f'{_W}Bdellium</w><note placement="foot">or, aromatic resin</note> {_W}and</w> {_W}onyx</w>',
         "Bdellium and onyx"),
        # a note between a comma and an opening quote (II Esdras 4:13)
        ('He answered me, and said,<note placement="foot">So the Oriental versions.</note>“A forest',
         "He answered me, and said, “A forest"),
        # quotation elements around a note (Matthew 13:25)
        (f'{_W}weeds</w></q><note placement="foot">darnel</note><q marker="" who="Jesus">{_W}also</w>',
         "weeds also"),
        # the possessive after a word element stays attached
        (f"{_W}God</w>’s Spirit", "God’s Spirit"),
        # an added word between two word elements (Galatians 1:3, Reina-Valera: "Graciasea" with -s)
        (f'{_W}Gracia</w><transChange type="added">sea</transChange>{_W}á vosotros</w>, {_W}y</w>',
         "Gracia sea á vosotros, y"),
        # an added enclitic inside a word (I Chronicles 10:13)
        (f'{_W}al pythón</w>, preguntándo<transChange type="added">le</transChange>,',
         "al pythón, preguntándole,"),
        # the psalm title before the verse and the speaker labels are not verse text (as with -s)
        ('<div type="x-milestone" subType="x-preverse" sID="pv5192"/><title canonical="true" type="psalm">'
         'By David.</title> <lg sID="gen8615"/> <l level="1" sID="gen8616"/><div type="x-milestone" '
         f'subType="x-preverse" eID="pv5192"/>{_W}Judge</w> {_W}me</w>, {_W}Yahweh</w>.',
         "Judge me, Yahweh."),
        (f'{_W}rooms</w>.<l eID="g1" level="2"/> <lg eID="g2"/> <speaker>Friends</speaker> <lg sID="g3"/> '
         '<l level="1" sID="g4"/>We will be glad', "rooms. We will be glad"),
        # poetry line markers separate words; entities are unescaped
        ('walked<l eID="g5" level="1"/><l level="2" sID="g6"/>I have &amp; trusted', "walked I have & trusted"),
        # plain text (the old `-s` export) passes, whitespace collapsed
        ("  In the beginning,\n God created  ", "In the beginning, God created"),
    ],
)
def test_verse_text_strips_the_markup(osis: str, plain: str):
    assert verse_text(osis) == plain


def test_parse_imp_keeps_verses_and_the_testament():
    """Introductions (``0:0``, ``C:0``) are dropped; the New Testament starts at its heading."""
    parsed = parse_imp(EN_IMP)
    assert parsed == {
        ("Genesis", 1, 1): (1, GEN_1_1_EN),
        ("Genesis", 50, 26): (1, "So Joseph died."),
        ("Revelation of John", 22, 21): (2, REV_22_21_EN),
    }


# ------------------------------------------------------------------------------------------ the cache


def test_the_cache_is_built_once_and_read_back(tmp_path, exports):
    pairs = load_parallel_text(tmp_path)
    assert _as_tuples(pairs) == EXPECTED
    assert load_parallel_text(tmp_path) == pairs
    assert len(exports) == 2  # exported once, then read from the cache
    assert sorted(os.listdir(tmp_path)) == ["parallel_text_es_en.jsonl.gz"]


def test_a_cache_from_the_old_parser_is_rebuilt_not_served(tmp_path, exports, monkeypatch):
    """The cache the old parser wrote (no header; "Godcreated", Rev 22:21 with the glossary) is
    rebuilt from the export; where it cannot be rebuilt, that is said instead of serving it."""
    old = tmp_path / "parallel_text_es_en.jsonl.gz"
    old_pairs = [dict(book="Genesis", chapter=1, verse=1, testament=1, es="EN el principio crió Dios los "
                      "cielos y la tierra.", en="In the beginning, Godcreated the heavens and the earth.")]
    with gzip.open(old, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in old_pairs)
    stale_copy = tmp_path / "stale.gz"
    shutil.copy(old, stale_copy)

    assert _as_tuples(load_parallel_text(tmp_path)) == EXPECTED
    assert len(exports) == 2
    _no_export(monkeypatch)  # the rebuilt cache is now served without the tools
    assert _as_tuples(load_parallel_text(tmp_path)) == EXPECTED

    shutil.copy(stale_copy, old)  # the old cache, on a machine without the tools
    with pytest.raises(DataUnavailable, match=r"cache .*parallel_text_es_en.jsonl.gz was written by an older "
                                              r"version.*cannot be rebuilt here.*mod2imp.*make gpu-data"):
        load_parallel_text(tmp_path)


def test_an_unreadable_cache_is_named(tmp_path, exports):
    (tmp_path / "parallel_text_es_en.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"parallel_text_es_en.jsonl.gz is unreadable.*refresh=True"):
        load_parallel_text(tmp_path)
    assert _as_tuples(load_parallel_text(tmp_path, refresh=True)) == EXPECTED


def test_refresh_without_the_tools_says_so_and_keeps_the_cache(tmp_path, exports, monkeypatch):
    """refresh=True where mod2imp is missing: the error says the rebuild failed (not "no cached
    parallel text", which the cache's own error message would then contradict), and the cache
    is still served without refresh (review s42, data finding 2)."""
    assert _as_tuples(load_parallel_text(tmp_path)) == EXPECTED
    _no_export(monkeypatch)
    with pytest.raises(DataUnavailable, match=r"refresh=True rebuilds the parallel-text cache .*parallel_text_es_en"
                                              r"\.jsonl\.gz, which cannot be done here: mod2imp .*not installed"):
        load_parallel_text(tmp_path, refresh=True)
    assert _as_tuples(load_parallel_text(tmp_path)) == EXPECTED


def test_two_writers_building_the_cache_at_once_both_succeed(tmp_path, exports, monkeypatch):
    """Review finding 3: every writer wrote ``parallel_text_es_en.jsonl.tmp`` and renamed it, so the
    second rename failed with FileNotFoundError. Here both writers have finished writing before
    either renames (a barrier in ``os.replace``): the interleaving that failed."""
    real_replace = os.replace
    barrier = threading.Barrier(2, timeout=60)

    def replace_together(src, dst):
        if Path(dst).name == "parallel_text_es_en.jsonl.gz":
            barrier.wait()
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_together)
    results: list[object] = [None, None]

    def build(i: int) -> None:
        try:
            results[i] = _as_tuples(load_parallel_text(tmp_path))
        except Exception as err:  # reported by the assertion below
            results[i] = err

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [EXPECTED, EXPECTED]
    _no_export(monkeypatch)
    assert _as_tuples(load_parallel_text(tmp_path)) == EXPECTED  # the cache reads back complete
    assert sorted(os.listdir(tmp_path)) == ["parallel_text_es_en.jsonl.gz"]  # no temporary file left


def test_a_failed_write_leaves_no_temporary_file(tmp_path, exports, monkeypatch):
    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        load_parallel_text(tmp_path)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------ the installed modules


@pytest.mark.slow
def test_the_installed_modules_give_the_documented_verses(tmp_path):
    """On the real exports: the 31,077 pairs of ../shared/DATA.md; Genesis 1:1 and Revelation 22:21
    as printed; no verse longer than 600 characters (the longest, Romans 14:23 and Job 39:30, have
    542 and 575); and each verse has the same letters as SWORD's own plain-text rendering
    (``mod2imp -s``) except where that rendering kept the glossary or a speaker label."""
    try:
        pairs = load_parallel_text(tmp_path)
    except DataUnavailable as err:
        pytest.skip(f"needs mod2imp and the SWORD modules: {err}")
    assert len(pairs) == 31077
    by_key = {p.key: p for p in pairs}
    assert by_key["Genesis 1:1"].en == GEN_1_1_EN
    assert by_key["Revelation of John 22:21"].en == REV_22_21_EN
    assert max(max(len(p.en), len(p.es)) for p in pairs) < 600
    assert not [p.key for p in pairs if re.search(r"\b(God|Yahweh)(created|said|made)\b", p.en)]

    def letters(text: str) -> str:  # -s writes a word with several Strong's numbers as "<G0846>"
        return re.sub(r"\s+", "", re.sub(r"<[^>]*>", "", text))

    for side, module in (("en", parallel_text.ENGLISH_MODULE), ("es", parallel_text.SPANISH_MODULE)):
        stripped = subprocess.run(["mod2imp", module, "-s"], capture_output=True, check=True).stdout
        reference: dict[str, str] = {}
        for record in stripped.decode("utf-8").split("$$$")[1:]:
            key, _, text = record.partition("\n")
            reference[key.strip()] = text
        differ = [p.key for p in pairs if letters(getattr(p, side)) != letters(reference[p.key])]
        if side == "en":  # the glossary, and the speaker labels that -s kept inside these verses
            assert differ == ["Song of Solomon 1:4", "Song of Solomon 5:1", "Song of Solomon 6:13",
                              "Song of Solomon 8:5", "Revelation of John 22:21"]
        else:
            assert differ == []


def test_the_fingerprint_changes_with_any_field_and_only_then():
    from routelab.data.parallel_text import pairs_fingerprint

    pairs = [VersePair("Genesis", 1, v, 1, f"es {v}", f"en {v}") for v in range(1, 6)]
    fp = pairs_fingerprint(pairs)
    assert fp == pairs_fingerprint([VersePair(**vars(p)) for p in pairs]) and len(fp) == 16
    for field, value in (("book", "Exodus"), ("chapter", 2), ("verse", 9), ("testament", 2), ("es", "x"), ("en", "x")):
        changed = [dataclasses.replace(p, **{field: value}) if i == 2 else p for i, p in enumerate(pairs)]
        assert pairs_fingerprint(changed) != fp, field
    assert pairs_fingerprint(pairs[::-1]) != fp and pairs_fingerprint(pairs[:-1]) != fp
