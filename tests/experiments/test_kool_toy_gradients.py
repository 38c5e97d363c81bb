"""Claim 2's expected-gradient check (``kool_toy/gradients.py``) against an exact oracle.

REINFORCE with importance weights is unbiased for ``grad E_p[(1/n) sum_i f_i]``; for the toy model
that expectation is ``(1/n) sum_i sum_j p_ij (y_i - out_j(x_i))^2``, differentiable in closed form. The
Monte Carlo estimates of Sample and Sample Skip IW must match its autograd gradient within their
Monte Carlo error; Sample Skip (no correction) is biased and need not.
"""

from __future__ import annotations

import torch

from routelab.experiments.kool_toy import claims as cl
from routelab.experiments.kool_toy.gradients import expected_gradient, gradient_check
from routelab.experiments.kool_toy.model import init_params, make_data
from routelab.experiments.kool_toy.report import collapse_markdown, gradients_markdown


def exact_gradient(seed: int) -> torch.Tensor:
    """Gradient of the expected loss over (w0, w1, b0, b1, a, c), float64."""
    x, y = make_data(seed, dtype=torch.float64)  # ToyBatch(dtype=float64) draws the same
    p0 = {k: v.clone().requires_grad_(True) for k, v in init_params(seed, dtype=torch.float64).items()}
    logits = torch.stack([torch.zeros_like(x), p0["a"] * x + p0["c"]], -1)
    p = torch.softmax(logits, -1)
    out = p0["w"] * x.unsqueeze(-1) + p0["b"]
    loss = (p * (y.unsqueeze(-1) - out) ** 2).sum(-1).mean()
    gw, gb, ga, gc = torch.autograd.grad(loss, [p0["w"], p0["b"], p0["a"], p0["c"]])
    return torch.cat([gw, gb, ga.reshape(1), gc.reshape(1)])


def test_unbiased_methods_estimate_the_exact_expected_gradient() -> None:
    for seed, tau in ((0, 1.0), (3, 0.5)):
        truth = exact_gradient(seed)
        for method in ("sample", "sample_skip_iw"):
            est = expected_gradient(method, tau, seed, copies=1_000, groups=8,
                                    generator=torch.Generator().manual_seed(seed))
            mean, se = est.mean(0), est.std(0) / est.shape[0] ** 0.5
            assert bool(((mean - truth).abs() <= 5 * se + 1e-9).all()), (method, tau, mean, truth, se)


def test_gradient_check_control_is_one_and_rows_are_complete() -> None:
    rows = gradient_check([0, 1], [1.0], copies=1_000, groups=4)
    assert len(rows) == 2
    for r in rows:
        assert abs(r["cos_iw_all"] - 1) < 0.01 and abs(r["ratio_iw_all"] - 1) < 0.05
        assert -1 <= r["cos_skip_router"] <= 1 and r["ratio_skip_router"] > 0
        assert r["copies"] == 4_000
    md = gradients_markdown(rows)
    assert md.count("\n") == 2 and "| 1 | 2 |" in md
    assert "cosine" in cl.gradient_summary(rows) and cl.gradient_summary(None) == ""


def test_collapse_table_counts_runs_with_one_preferred_expert() -> None:
    recs = [{"config": "gating", "tau": 0.01, "collapsed": c} for c in (True, False, False)]
    recs += [{"config": "gating", "tau": 1.0, "collapsed": True}]
    md = collapse_markdown(recs, ["gating", "reinforce"])
    assert "| `gating` | 1/3 | 1/1 | 2/4 |" in md and "reinforce" not in md
