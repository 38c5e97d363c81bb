"""given_options: what a command line set, as settings changes."""

from __future__ import annotations

import argparse

from routelab.experiments.kit.cli_options import given_options


def test_only_given_options_become_changes_and_lists_become_tuples() -> None:
    args = argparse.Namespace(seeds=[1, 2], steps=None, routers=[], device="cpu", epochs=0)
    assert given_options(args, "seeds", "steps", "routers", "epochs") == {"seeds": (1, 2), "epochs": 0}
