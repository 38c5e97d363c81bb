"""Contracts of routelab.bench.assignment's host-sync sites, found by mutation testing: the counting of
torch's sync-debug warnings by the innermost frame under a package directory (``_sync_warning_sites``,
run without a GPU on warnings emitted by hand), ``host_sync_sites`` / ``count_host_syncs`` against a fake
of torch.cuda's debug-mode API, and the list of sites under the batched table (``_render_batched``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from routelab.bench import assignment as bench

SYNC = "called a synchronizing CUDA operation"  # the text of torch's sync-debug warning


def load(path: Path, source: str) -> dict[str, Any]:
    """Write ``source`` to ``path`` and run it as a module whose code is named ``path``; its globals."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    namespace: dict[str, Any] = {"__name__": f"sites_{path.stem}"}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - a test module of our own
    return namespace


WARNS = "import warnings\ndef sync():\n    warnings.warn('called a synchronizing CUDA operation')\n"


def test_a_sibling_directory_sharing_the_package_prefix_is_outside(tmp_path: Path) -> None:
    """``pkg2/`` is not inside ``pkg/``: its frames name no site, so a sync it makes is counted at the
    innermost frame of ``pkg`` that called it, or outside when there is none (guards the ``+ os.sep``)."""
    sibling = load(tmp_path / "pkg2" / "mod.py", WARNS)
    inner = load(tmp_path / "pkg" / "mod.py", "def call(f):\n    f()\n")

    def fn() -> None:
        inner["call"](sibling["sync"])  # pkg/mod.py:2 -> pkg2/mod.py:3
        sibling["sync"]()  # pkg2 alone

    sites = bench._sync_warning_sites(fn, str(tmp_path / "pkg"))
    assert sites == {"pkg/mod.py:2": 1, bench.OUTSIDE: 1}


def test_sites_in_subpackages_keep_their_directories(tmp_path: Path) -> None:
    """A site is the file's path relative to the package's parent: ``pkg/sub/deep.py:3``, not its base
    name under the package."""
    deep = load(tmp_path / "pkg" / "sub" / "deep.py", WARNS)
    sites = bench._sync_warning_sites(lambda: (deep["sync"](), deep["sync"]()), str(tmp_path / "pkg"))
    assert sites == {"pkg/sub/deep.py:3": 2}


def test_equal_counts_are_ordered_by_name_not_by_arrival(tmp_path: Path) -> None:
    """Most frequent first, then by site name, whatever order the syncs came in."""
    mods = {name: load(tmp_path / "pkg" / f"{name}.py", WARNS) for name in ("a", "b", "c")}

    def fn() -> None:
        for name in ("b", "a", "c", "c"):  # b and a once each, b first; c twice, last
            mods[name]["sync"]()

    sites = bench._sync_warning_sites(fn, str(tmp_path / "pkg"))
    assert list(sites.items()) == [("pkg/c.py:3", 2), ("pkg/a.py:3", 1), ("pkg/b.py:3", 1)]


def test_other_warnings_are_passed_on_with_their_category_text_and_location(tmp_path: Path) -> None:
    """Every other warning of ``fn`` is warned again after the call, in order, with its own category,
    message, file and line; the sync warnings are not."""
    mod = load(tmp_path / "pkg" / "mod.py", WARNS)

    def fn() -> None:
        warnings.warn_explicit("old api", DeprecationWarning, "legacy.py", 42)
        mod["sync"]()
        warnings.warn_explicit("overflow", RuntimeWarning, "numeric.py", 7)
        warnings.warn_explicit("plain", UserWarning, "user.py", 3)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sites = bench._sync_warning_sites(fn, str(tmp_path / "pkg"))
    assert sites == {"pkg/mod.py:3": 1}
    assert [(w.category, str(w.message), w.filename, w.lineno) for w in caught] == [
        (DeprecationWarning, "old api", "legacy.py", 42),
        (RuntimeWarning, "overflow", "numeric.py", 7),
        (UserWarning, "plain", "user.py", 3),
    ]


def test_warning_state_is_restored_when_fn_raises(tmp_path: Path) -> None:
    """When ``fn`` raises, the error propagates and ``warnings.showwarning`` and the filters are those
    from before: later warnings are shown, not counted by a stale recorder."""
    mod = load(tmp_path / "pkg" / "mod.py", WARNS)

    def fails() -> None:
        mod["sync"]()
        raise RuntimeError("boom")

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        show, filters = warnings.showwarning, list(warnings.filters)
        with pytest.raises(RuntimeError, match="boom"):
            bench._sync_warning_sites(fails, str(tmp_path / "pkg"))
        assert warnings.showwarning is show
        assert warnings.filters == filters
    with pytest.warns(UserWarning, match="after the failure"):
        warnings.warn("after the failure", UserWarning, stacklevel=1)


def test_warning_filters_are_untouched_after_a_call(tmp_path: Path) -> None:
    """The ``"always"`` filter that lets every sync through lasts only for the call."""
    mod = load(tmp_path / "pkg" / "mod.py", WARNS)
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("error", DeprecationWarning)
        filters = list(warnings.filters)
        assert bench._sync_warning_sites(mod["sync"], str(tmp_path / "pkg")) == {"pkg/mod.py:3": 1}
        assert warnings.filters == filters


def test_relative_code_filenames_are_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame whose code file is named relative to the working directory (``pkg/mod.py``) is inside the
    (absolute) package directory and names its site like any other."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    namespace: dict[str, Any] = {"__name__": "sites_relative"}
    exec(compile(WARNS, os.path.join("pkg", "mod.py"), "exec"), namespace)  # noqa: S102
    sites = bench._sync_warning_sites(namespace["sync"], os.path.join(os.getcwd(), "pkg"))
    assert sites == {"pkg/mod.py:3": 1}


class FakeDebugMode:
    """torch.cuda's sync-debug API without a GPU: records the calls; the mode starts at ``mode``."""

    def __init__(self, mode: int) -> None:
        self.mode: int | str = mode
        self.calls: list[tuple[Any, ...]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: self.calls.append(("synchronize",)))
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: self.mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", self.set)

    def set(self, mode: int | str) -> None:
        self.calls.append(("set", mode))
        self.mode = mode


def syncing_solve(modes: list[Any], fake: FakeDebugMode) -> Callable[[torch.Tensor], torch.Tensor]:
    """A per-instance solver that warns as torch would at a read-back, noting the debug mode then."""

    def solve(x: torch.Tensor) -> torch.Tensor:
        modes.append(fake.mode)
        warnings.warn(SYNC, stacklevel=1)
        return x.argmax(-1)

    return solve


def test_host_sync_sites_and_count_under_a_fake_debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """On "cuda" (faked): pending work synchronised first, then ``fn`` runs once in mode "warn", then the
    previous mode (2) is set back; the syncs are counted (3, from routelab's ``_per_instance`` calling the
    solver on 3 instances) under sites named from routelab's parent directory (``routelab/...``)."""
    fake = FakeDebugMode(2)
    fake.install(monkeypatch)
    modes: list[Any] = []
    solve = syncing_solve(modes, fake)
    scores = torch.zeros(3, 4, 2)

    sites = bench.host_sync_sites(lambda: bench._per_instance(solve, scores), device="cuda")
    assert fake.calls == [("synchronize",), ("set", "warn"), ("set", 2)]
    assert modes == ["warn"] * 3
    assert list(sites.values()) == [3]
    assert next(iter(sites)).startswith("routelab/bench/assignment.py:"), sites

    fake.calls.clear()
    assert bench.count_host_syncs(lambda: bench._per_instance(solve, scores), device=torch.device("cuda")) == 3
    assert fake.calls == [("synchronize",), ("set", "warn"), ("set", 2)]


def test_the_previous_debug_mode_is_restored_when_fn_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing ``fn`` leaves the debug mode as it found it (1 here) and its error propagates."""
    fake = FakeDebugMode(1)
    fake.install(monkeypatch)

    def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bench.count_host_syncs(fails, device="cuda")
    assert fake.calls == [("synchronize",), ("set", "warn"), ("set", 1)]
    assert fake.mode == 1


def test_a_sync_is_sited_at_the_routelab_line_that_called_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented site: the innermost frame of routelab's source when torch warned, here the line of
    ``_per_instance`` that calls the solver (the solver itself is outside routelab), not the recorder's own
    frame (which is in routelab too: a review found every sync sited there)."""
    import inspect

    fake = FakeDebugMode(0)
    fake.install(monkeypatch)
    lines, first = inspect.getsourcelines(bench._per_instance)
    line = first + next(i for i, text in enumerate(lines) if "solve(scores[j])" in text)
    solve = syncing_solve([], fake)
    sites = bench.host_sync_sites(lambda: bench._per_instance(solve, torch.zeros(3, 4, 2)), device="cuda")
    assert sites == {f"routelab/bench/assignment.py:{line}": 3}


# ----------------------------------------------------------------------------- the list under the table


def method(name: str, sites: dict[str, int] | None, **kwargs: Any) -> bench.BatchedMethod:
    syncs = None if sites is None else sum(sites.values())
    return bench.BatchedMethod(name, timing=bench.Timing(median_ms=2.0, runs=1), host_syncs=syncs,
                               sync_sites=sites, feasible=True, **kwargs)


def site_lines(size: bench.BatchedSize) -> list[str]:
    """The lines after the table (empty when nothing is listed)."""
    lines = bench._render_batched(size)
    table = [i for i, line in enumerate(lines) if line.startswith("|")]
    assert table == list(range(len(table)))
    return lines[len(table):]


def test_only_the_batched_rows_list_their_sites() -> None:
    """Sites are listed for the batched, on-device and host rows, in the table's order; the per-instance
    rows (loop, auction) are not, even with sites."""
    size = bench.BatchedSize(b=2, n=8, k=2, methods={
        "batched": method("B", {"routelab/a.py:1": 1}),
        "device": method("D", {"routelab/d.py:2": 2}),
        "loop": method("L", {"routelab/l.py:3": 3}, per_instance_calls=True),
        "auction": method("A", {"routelab/x.py:4": 4}, per_instance_calls=True),
        "host": method("H", {"routelab/h.py:5": 5}),
    })
    assert site_lines(size) == [
        "", "Host syncs by the line of routelab that made them (one untimed call):", "",
        "- B: `routelab/a.py:1` 1", "- D: `routelab/d.py:2` 2", "- H: `routelab/h.py:5` 5",
    ]


def test_a_row_without_syncs_lists_no_sites() -> None:
    """A row whose call made no sync (``{}``) has no line; with no such line there is no heading either."""
    size = bench.BatchedSize(b=2, n=8, k=2, methods={"batched": method("B", {}), "host": method("H", None)})
    assert site_lines(size) == []
    size.methods["device"] = method("D", {"routelab/d.py:2": 2})
    assert site_lines(size)[3:] == ["- D: `routelab/d.py:2` 2"]


@pytest.mark.parametrize(("count", "more"),
                         [(11, ""), (12, ""), (13, ", and 1 more sites"), (15, ", and 3 more sites")])
def test_at_most_twelve_sites_are_shown_per_row(count: int, more: str) -> None:
    """The first 12 sites (most frequent first, as given) are shown, then how many more there are."""
    sites = {f"routelab/f{i:02d}.py:{i}": 100 - i for i in range(count)}
    size = bench.BatchedSize(b=2, n=8, k=2, methods={"batched": method("B", sites)})
    shown = ", ".join(f"`routelab/f{i:02d}.py:{i}` {100 - i}" for i in range(min(count, 12)))
    assert site_lines(size)[3:] == [f"- B: {shown}{more}"]
