"""The results store every experiment uses: resumable JSONL records, atomic writes, failed runs.

Results are recorded as one JSON object per line, appended and fsync'ed as each run finishes.
The trailing newline is the commit marker: whatever follows the last newline (a line cut short
by an interrupted run) is ignored by :func:`read_jsonl` and removed by the next
:func:`append_jsonl_atomic`. A sweep therefore resumes where it stopped::

    done = completed_keys(path, ("method", "seed"))
    for method, seed in product(methods, seeds):
        if (method, seed) in done:
            continue
        append_jsonl_atomic(path, {"method": method, "seed": seed, **run(method, seed)})

A complete line that is not a JSON object is damage, not an interruption: :func:`read_jsonl`
raises :class:`ResultsFileError` naming the file, the line and the fix.

A run that diverged is recorded too, as a *failed record* (:func:`failed_record`: the run's key
fields plus ``status: "failed"``, ``reason`` and ``failed_step``), so that a rerun sees it as done
(training is deterministic: delete its line, or rerun with ``--fresh``, to retry it); reports
separate the two kinds with :func:`split_failed`.

The functions assume a single writer per file (one sweep at a time).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FAILED",
    "ResultsFileError",
    "append_jsonl_atomic",
    "atomic_write_text",
    "completed_keys",
    "failed_record",
    "is_failed",
    "missing_keys",
    "read_jsonl",
    "settings_key",
    "split_failed",
]

FAILED = "failed"
"""The ``status`` of a failed run's record (records of finished runs carry no ``status``)."""


class ResultsFileError(ValueError):
    """A results file that cannot be resumed from: a corrupt line, or records of another sweep.

    An interrupted write never causes it (its unfinished last line is ignored); only damage or
    a foreign file does. The message names the file (and line) and the fix; ``routelab
    reproduce`` prints it as one ``routelab: error:`` line.

    Attributes:
        path: the file.
        line: the 1-based line number, or ``None`` when the whole file is at fault.
    """

    def __init__(self, message: str, path: Path, line: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.line = line


_FIX = ("delete that line (its run is redone) or the whole file, or rerun `routelab reproduce` with "
        "`--fresh` (which moves the experiment's old results aside)")


def _fsync_dir(directory: Path) -> None:
    """Flush a directory entry to disk (so a newly created or renamed file survives a crash)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported on this platform / filesystem
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_jsonl_atomic(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path``, flushed and fsync'ed.

    The line is serialised completely before anything is written, so a record that cannot be
    encoded leaves the file untouched. If the file ends in a partial line (left by an
    interrupted run), that partial line is cut off first, so it can never fuse with the new
    record. Parent directories are created as needed.

    Args:
        path: the ``.jsonl`` file.
        record: a JSON-serialisable dict (convert tensors with ``.item()`` / ``.tolist()``).

    Raises:
        TypeError: if ``record`` is not a dict or holds a value JSON cannot encode.
    """
    if not isinstance(record, dict):
        raise TypeError(f"record must be a dict, got {type(record).__name__}.")
    line = json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n"
    data = line.encode("utf-8")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.truncate(_end_of_last_complete_line(f, size))
        f.seek(0, os.SEEK_END)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if created:
        _fsync_dir(path.parent)


def _end_of_last_complete_line(f: Any, size: int, chunk: int = 1 << 16) -> int:
    """Byte offset just after the last ``\\n`` in the open binary file ``f`` (0 if none)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        block = f.read(end - start)
        i = block.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the complete records of a JSONL file written by :func:`append_jsonl_atomic`.

    A missing file reads as no records. Text after the last newline is an interrupted write
    and is ignored; blank lines are skipped.

    Returns:
        The records, in file order.

    Raises:
        ResultsFileError: (a ``ValueError``) if a complete (newline-terminated) line is not a
            UTF-8 JSON object — that is corruption, not an interruption, and is not skipped
            silently. The message names the file and line and says how to fix it.
    """
    return [record for _, record in _numbered_records(Path(path))]


def _numbered_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """:func:`read_jsonl`'s records with their 1-based line numbers (for messages that name the line)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # drop the partial tail, if any
    records: list[tuple[int, dict[str, Any]]] = []
    for lineno, raw in enumerate(complete.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ResultsFileError(
                f"{path}:{lineno}: not UTF-8 text (byte {err.start + 1} of the line); the file is "
                f"corrupt, not just interrupted: {_FIX}.", path, lineno) from err
        except json.JSONDecodeError as err:
            raise ResultsFileError(
                f"{path}:{lineno}: not valid JSON ({err.msg}); the file is corrupt, not just "
                f"interrupted: {_FIX}.", path, lineno) from err
        if not isinstance(record, dict):
            raise ResultsFileError(
                f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}; the file is "
                f"corrupt: {_FIX}.", path, lineno)
        records.append((lineno, record))
    return records


def _freeze(value: Any) -> Any:
    """Make a JSON value hashable (lists become tuples, dicts sorted item tuples)."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def completed_keys(
    path: str | os.PathLike[str], key_fields: Sequence[str] | str
) -> set[tuple[Any, ...]]:
    """The key tuples of the runs already recorded in ``path``, to skip them on resume.

    Args:
        path: the ``.jsonl`` results file (missing means nothing is done yet).
        key_fields: the fields that identify one run, e.g. ``("method", "seed")``; a single
            string is taken as one field.

    Returns:
        ``{(record[f] for f in key_fields), ...}``; JSON lists in keys become tuples.

    Raises:
        ResultsFileError: (a ``ValueError``) if a record lacks one of ``key_fields`` (the file
            belongs to another sweep, or the key changed: use a new file).
    """
    fields: tuple[str, ...] = (key_fields,) if isinstance(key_fields, str) else tuple(key_fields)
    if not fields:
        raise ValueError("key_fields must name at least one field, e.g. ('method', 'seed').")
    keys: set[tuple[Any, ...]] = set()
    for lineno, record in _numbered_records(Path(path)):
        missing = [f for f in fields if f not in record]
        if missing:
            raise ResultsFileError(
                f"{path}:{lineno}: the record lacks key field(s) {missing} (has {sorted(record)}); "
                f"results from a different sweep? Write to a new file, or rerun `routelab "
                f"reproduce` with `--fresh` (which moves the old results aside).", Path(path), lineno
            )
        keys.add(tuple(_freeze(record[f]) for f in fields))
    return keys


def _read_umask() -> int:
    """The process's umask (read by setting it, as there is no other way, and restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The umask at import, read once (reading it sets it for an instant, which another thread could see).
_UMASK = _read_umask()


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically: readers see the old file or the new, never half.

    Writes a temporary file in the same directory, fsyncs it, then ``os.replace``s it over
    ``path``. Parent directories are created as needed.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline="") as f:
            # mkstemp makes the file 0600: give it the mode any new file gets here (0666 less the umask)
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def missing_keys(
    all_keys: Iterable[tuple[Any, ...]], path: str | os.PathLike[str], key_fields: Sequence[str]
) -> list[tuple[Any, ...]]:
    """The keys of ``all_keys`` not yet recorded in ``path``, in their original order.

    A convenience over :func:`completed_keys` for the usual resume loop.
    """
    done = completed_keys(path, key_fields)
    return [k for k in all_keys if _freeze(list(k)) not in done]


# ----------------------------------------------------------------------------- failed runs


def settings_key(settings: Any, exclude: Sequence[str] = ("reps", "quick")) -> str:
    """What one run's result depends on, as a string to store in its record: the fields of the
    dataclass ``settings`` but ``exclude`` (by default the number of repetitions, which only
    extends a sweep, and the quick flag), as sorted JSON. Records under another key are not
    resumed from or reported (a quick run and a full run into one directory stay apart)."""
    fields = {name: value for name, value in dataclasses.asdict(settings).items() if name not in set(exclude)}
    return json.dumps(fields, sort_keys=True, default=str)


def failed_record(key: Mapping[str, Any], reason: str, step: int | None = None) -> dict[str, Any]:
    """The record of a failed run: its key fields, ``status: "failed"``, ``reason``, ``failed_step``."""
    return {**key, "status": FAILED, "reason": reason, "failed_step": step}


def is_failed(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` is a failed run's record."""
    return record.get("status") == FAILED


def split_failed(records: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(finished, failed)`` records, each in the original order."""
    done, failed = [], []
    for r in records:
        (failed if is_failed(r) else done).append(r)
    return done, failed
