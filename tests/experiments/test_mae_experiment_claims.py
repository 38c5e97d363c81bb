"""MAE's fine-tuning claim is judged with the report's single-run tie threshold (audit finding)."""

from __future__ import annotations

from routelab.experiments.kit.claims import PARTLY
from routelab.experiments.mae.report import _ft_match_verdict


def test_ftg_plus_matching_ftall_uses_the_single_run_tie_threshold():
    """The committed run: FTG+ is 0.236 nats behind FTALL and only 0.027 ahead of FTG, with threshold 0.150
    (t(0.975, 8) = 2.306 x sqrt 2 x the pooled seed sd 0.0459 over 8 degrees of freedom): neither part holds.
    It was judged "holds" by the raw ordering."""
    ftg, ftg_plus, ftall = 4.9317, 4.9047, 4.6683
    assert _ft_match_verdict(ftg, ftg_plus, ftall, 0.0459, 8).startswith("does not hold")
    assert _ft_match_verdict(4.9, 4.67, 4.66, 0.0459, 8).startswith("holds")  # a match, and FTG well behind
    assert _ft_match_verdict(5.0, 4.82, 4.66, 0.0459, 8).startswith(PARTLY)  # FTG behind, FTG+ no match
    assert "no seed spread" in _ft_match_verdict(ftg, ftg_plus, ftall, None, 0)
