"""``routelab reproduce``'s combined report opens with the scoreboard, built from the experiments' claims.json
and the committed full runs' (routelab.cli + routelab.experiments.kit.scoreboard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from routelab import cli
from routelab.experiments import registry as experiment_registry
from routelab.experiments.kit.claims import CLAIMS_FILE, HOLDS, NOT_HOLD, Claim, write_claims_json
from routelab.experiments.kit.experiment import Experiment
from routelab.experiments.registry import register


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An isolated, initially empty experiment registry."""
    fresh: dict[str, Any] = {}
    monkeypatch.setattr(experiment_registry, "REGISTRY", fresh)
    return fresh


def claiming_experiment(name: str, verdict: str, fail: bool = False) -> Experiment:
    def sweep(out_dir: Path, quick: bool) -> Path:
        if fail:
            raise RuntimeError("boom")
        write_claims_json(out_dir, [Claim(text=f"{name} holds up.", measured="1.0", verdict=verdict)],
                          experiment=name, paper=f"{name} et al.", quick=quick)
        report = out_dir / "report.md"
        report.write_text(f"# {name}\n\n## Claims\n\ndetails of {name}\n", encoding="utf-8")
        return report

    return Experiment(name=name, description=f"Toy {name}.", sweep=sweep, full=False, quick_settings=True)


def test_report_opens_with_the_scoreboard(registry: dict[str, Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "docs"
    (docs / "alpha").mkdir(parents=True)
    write_claims_json(docs / "alpha", [Claim(text="alpha holds up.", measured="2.0", verdict=NOT_HOLD)],
                      experiment="alpha", paper="alpha et al.", quick=False)
    monkeypatch.setattr(cli, "committed_dir", lambda: docs)
    register(claiming_experiment("alpha", HOLDS))
    register(claiming_experiment("beta", HOLDS, fail=True))
    out = tmp_path / "results"
    (out / "beta").mkdir(parents=True)
    write_claims_json(out / "beta", [Claim(text="stale", measured="0", verdict=HOLDS)], experiment="beta",
                      paper="beta et al.", quick=True)
    assert cli.main(["reproduce", "--quick", "--out", str(out)]) == cli.EXIT_FAILED
    text = (out / "report.md").read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## Scoreboard", "## alpha", "## beta"]
    board = text.split("## Scoreboard", 1)[1].split("\n## ", 1)[0]
    assert "quick verdict" in board
    assert "| alpha et al. | alpha holds up. | holds | does not hold | [alpha](alpha/report.md) |" in board
    assert "stale" not in text and not (out / "beta" / CLAIMS_FILE).exists()
    row = next(line for line in board.splitlines() if line.endswith("| beta |"))
    assert row.startswith("| — | — | — (not run: failed: RuntimeError: boom")  # no claims, no paper known
    assert "— (no committed full run" in row
    assert text.index("## Scoreboard") < text.index("did not run**")
