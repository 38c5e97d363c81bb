"""The import layers of ../shared/DESIGN.md, enforced: no module imports a higher layer, and no
package reaches into another package's private (``_``-prefixed) modules.

The order (a unit may import units of strictly lower rank, and itself):

====  ===============================================================
rank  units (top-level modules and packages of ``src/routelab``)
====  ===============================================================
0     ``_checks``, ``_float32_out``, ``_autograd``, ``routes``, ``machine``
1     ``assignment``, ``replay``
2     ``gates``
3     ``routing``
4     ``estimators``
5     ``routers``
6     ``layers``
7     ``parallel``
8     ``integrations``
9     ``data``
10    ``bench``, ``experiments``
11    ``cli``
12    ``__main__``
====  ===============================================================

``routelab/__init__.py`` is the façade: it may re-export from any unit. The oracle is the source
itself, parsed with :mod:`ast` (every ``import``/``from ... import``, relative or absolute,
including imports inside functions).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import routelab

ROOT = Path(routelab.__file__).resolve().parent

RANKS: dict[str, int] = {
    "_checks": 0, "_float32_out": 0, "_autograd": 0, "routes": 0, "machine": 0,
    "assignment": 1, "replay": 1,
    "gates": 2,
    "routing": 3,
    "estimators": 4,
    "routers": 5,
    "layers": 6,
    "parallel": 7,
    "integrations": 8,
    "data": 9,
    "bench": 10, "experiments": 10,
    "cli": 11,
    "__main__": 12,
}


def _unit(path: Path) -> str:
    """The unit a source file belongs to: its top-level package or module name under routelab."""
    first = path.relative_to(ROOT).parts[0]
    return first.removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, list[str]]]:
    """``(line, dotted module path as parts)`` of every routelab import in ``path``."""
    module = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    package = module[:-1]  # the package a relative import starts from (for __init__ too)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] != "routelab":
                continue
            if len(target) == 1:  # from routelab import X: X names a unit (or a façade name)
                for alias in node.names:
                    found.append((node.lineno, ["routelab", alias.name]))
            else:
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name.split(".")
                if target[0] == "routelab" and len(target) > 1:
                    found.append((node.lineno, target))
    return found


SOURCES = sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts != ("__init__.py",))


def test_every_unit_has_a_rank() -> None:
    """A new top-level module or package must be placed in the order above (and in DESIGN.md)."""
    units = {_unit(p) for p in SOURCES}
    assert units <= set(RANKS), f"units without a rank in RANKS: {sorted(units - set(RANKS))}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_import_and_no_private_reach_in(path: Path) -> None:
    unit = _unit(path)
    problems = []
    for line, target in _imports(path):
        other = target[1]
        if other not in RANKS:  # a façade name such as routelab.Routes: resolve to its unit
            attr = getattr(routelab, other, None)
            module = getattr(attr, "__module__", "") or ""
            parts = module.split(".")
            if len(parts) < 2 or parts[0] != "routelab":
                continue
            other = parts[1]
        if other == unit:
            continue
        if RANKS[other] >= RANKS[unit]:
            problems.append(f"line {line}: {unit} (rank {RANKS[unit]}) imports {'.'.join(target)} "
                            f"(rank {RANKS[other]})")
        private = [part for part in target[2:] if part.startswith("_")]
        if private:
            problems.append(f"line {line}: {unit} reaches into the private module {'.'.join(target)}")
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_parser_sees_relative_and_absolute_imports() -> None:
    """The parser resolves the imports the check reads (a check that cannot fail is no check)."""
    parsed = [".".join(t) for _, t in _imports(ROOT / "assignment" / "balanced.py")]
    assert any(t.startswith("routelab._checks") for t in parsed), parsed
    routers = [".".join(t) for _, t in _imports(ROOT / "routers" / "base.py")]
    assert "routelab.routing.rules" in routers and "routelab.gates.protocol" in routers


def test_importing_routelab_leaves_dynamo_and_scipy_linalg_unimported() -> None:
    """``import routelab`` is about torch's own import time: torch.compile's machinery (Dynamo,
    imported by ``torch.compiler.disable`` at decoration, ~2 s on a CPU) and scipy.linalg (~0.4 s)
    load at their first use. A review measured ``import routelab`` at twice ``import torch``."""
    import subprocess
    import sys

    probe = ("import sys, routelab; "
             "print(sorted(m for m in ('torch._dynamo', 'scipy.linalg') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout
