"""Tests for routelab.experiments.kit.store (resumable JSONL results and atomic writes) and the
results.csv cells of routelab.experiments.kit.tables."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from routelab.experiments.kit.store import (
    append_jsonl_atomic,
    atomic_write_text,
    completed_keys,
    missing_keys,
    read_jsonl,
)


def test_append_and_read_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "runs.jsonl"
    records = [{"method": "sinkhorn", "seed": s, "loss": 0.5 * s, "name": "é\u2028x"} for s in range(3)]
    for rec in records:
        append_jsonl_atomic(path, rec)
    assert read_jsonl(path) == records
    assert path.read_text(encoding="utf-8").count("\n") == 3


def test_missing_file_reads_as_empty(tmp_path: Path) -> None:
    assert read_jsonl(tmp_path / "nope.jsonl") == []
    assert completed_keys(tmp_path / "nope.jsonl", ("seed",)) == set()


def test_interrupted_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    append_jsonl_atomic(path, {"seed": 0})
    append_jsonl_atomic(path, {"seed": 1})
    with open(path, "ab") as f:  # a run killed mid-write
        f.write(b'{"seed": 2, "lo')
    assert read_jsonl(path) == [{"seed": 0}, {"seed": 1}]
    # Even a last line that parses but lacks its newline was never committed.
    with open(path, "ab") as f:
        f.write(b"}")
    assert [r["seed"] for r in read_jsonl(path)] == [0, 1]


def test_append_after_interruption_drops_the_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    append_jsonl_atomic(path, {"seed": 0})
    with open(path, "ab") as f:
        f.write(b'{"seed": 1, "lo')
    append_jsonl_atomic(path, {"seed": 1, "loss": 3.0})
    assert read_jsonl(path) == [{"seed": 0}, {"seed": 1, "loss": 3.0}]
    assert path.read_bytes().endswith(b"\n")


def test_partial_line_only(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_bytes(b'{"seed"')
    assert read_jsonl(path) == []
    append_jsonl_atomic(path, {"seed": 5})
    assert read_jsonl(path) == [{"seed": 5}]


def test_corrupt_complete_line_raises(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_text('{"seed": 0}\nnot json\n{"seed": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"runs\.jsonl:2"):
        read_jsonl(path)


def test_unencodable_record_leaves_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    append_jsonl_atomic(path, {"seed": 0})
    before = path.read_bytes()
    with pytest.raises(TypeError):
        append_jsonl_atomic(path, {"seed": 1, "bad": object()})
    assert path.read_bytes() == before


def test_resume_skips_completed_runs(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    grid = [(m, s) for m in ("greedy", "sinkhorn") for s in range(3)]
    executed: list[tuple[str, int]] = []

    def sweep(stop_after: int | None = None) -> None:
        done = completed_keys(path, ("method", "seed"))
        for i, (m, s) in enumerate(k for k in grid if k not in done):
            if stop_after is not None and i == stop_after:
                with open(path, "ab") as f:  # interrupted while writing the next record
                    f.write(b'{"method": "')
                return
            executed.append((m, s))
            append_jsonl_atomic(path, {"method": m, "seed": s, "value": s * 2})

    sweep(stop_after=4)
    assert executed == grid[:4]
    assert missing_keys(grid, path, ("method", "seed")) == grid[4:]
    sweep()
    assert executed == grid  # each run executed exactly once
    assert sorted((r["method"], r["seed"]) for r in read_jsonl(path)) == sorted(grid)


def test_completed_keys_freezes_lists_and_accepts_single_field(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    append_jsonl_atomic(path, {"sizes": [4, 8], "seed": 1})
    assert completed_keys(path, ("sizes", "seed")) == {((4, 8), 1)}
    assert completed_keys(path, "seed") == {(1,)}


def test_completed_keys_missing_field_raises(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    append_jsonl_atomic(path, {"method": "a", "seed": 0})
    with path.open("a") as f:
        f.write("\n")  # a blank line: the message names the file's line, not the record's index
    append_jsonl_atomic(path, {"seed": 1})
    with pytest.raises(ValueError, match=r"runs.jsonl:3: the record lacks key field\(s\) \['method'\]") as err:
        completed_keys(path, ("method", "seed"))
    assert err.value.line == 3


def test_atomic_write_text(tmp_path: Path) -> None:
    path = tmp_path / "out" / "report.md"
    atomic_write_text(path, "first\n")
    assert path.read_text(encoding="utf-8") == "first\n"
    atomic_write_text(path, "second\n")
    assert path.read_text(encoding="utf-8") == "second\n"
    assert os.listdir(path.parent) == ["report.md"]  # no temp files left behind
    # the mode of any new file (a review found 0600, mkstemp's): as open() gives the file beside it
    (path.parent / "plain.txt").write_text("x")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((path.parent / "plain.txt").stat().st_mode)


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "report.md"
    atomic_write_text(path, "old\n")

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new\n")
    monkeypatch.undo()
    assert path.read_text(encoding="utf-8") == "old\n"
    assert os.listdir(tmp_path) == ["report.md"]


def test_records_are_single_lines(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    append_jsonl_atomic(path, {"text": "a\nb", "nested": {"x": [1, 2]}})
    lines = path.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 2
    assert json.loads(lines[0])["text"] == "a\nb"


def test_csv_cell() -> None:
    from routelab.experiments.kit.tables import csv_cell

    assert csv_cell(None) == "" and csv_cell(0.123456789) == "0.123457" and csv_cell(3) == "3"
    assert csv_cell(True) == "True" and csv_cell("a,b") == "a,b"
