"""The options an experiment's ``python -m`` entry point was given, as changes to its settings."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["given_options"]


def given_options(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """``{name: value}`` for each of ``names`` the command line set (not None, not empty); list values
    become tuples, as the frozen settings dataclasses hold them. Pass the result to ``settings.with_``."""
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name)
        if value is None or value == [] or value == ():
            continue
        out[name] = tuple(value) if isinstance(value, list) else value
    return out
