"""Load a script of ``tools/`` as a module, for its tests (the scripts are not a package).

Importable from every test directory (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["TOOLS", "load_tool"]

#: The repository's ``tools/`` directory.
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/{name}.py`` as a fresh module (its top-level code runs again on every call)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # (registered before it runs, as an import does: dataclasses look their module up by name)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
