"""Fixtures shared by several test modules."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from routelab.experiments import registry as experiment_registry


@pytest.fixture
def one_thread():
    """Run the test with one torch intra-op thread (repeatable timings and reductions), then restore."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An isolated, initially empty experiment registry (the CLI and experiment tests register toys)."""
    fresh: dict[str, Any] = {}
    monkeypatch.setattr(experiment_registry, "REGISTRY", fresh)
    return fresh
