"""Claim 2's mechanism, measured: the expected REINFORCE gradient of Sample Skip against Sample.

Kool et al. (2021, Fig. 2b) report that Sample Skip -- skipping the tokens over capacity without
the importance-weight correction of eq. 3 -- does not match Sample. The correction makes the
estimator unbiased; without it the estimate is biased. Whether the bias *matters* for learning
depends on the direction of the expected gradient, not only on its size: Adam divides each
coordinate by its own running scale, so a gradient that keeps its direction but changes its length
trains almost as well.

:func:`gradient_check` measures this directly. At a parameter point (a seed's initialisation) it
estimates the expected gradient of the training objective over the six parameters ``(w_0, w_1,
b_0, b_1, a, c)`` for each method by Monte Carlo: ``R`` independent copies of the same run draw
their own routes in one batched :class:`~.model.ToyBatch`, and the per-copy gradients are averaged.
It reports the cosine between Sample Skip's and Sample's expected gradients and the ratio of their
norms, with Sample Skip IW (unbiased, so cosine 1 and ratio 1 up to Monte Carlo error) as the
control. The baseline is the same constant for every copy of a method (the mean observed loss of
its copies), so it adds no Monte Carlo noise of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .model import RunSpec, ToyBatch, _seed_generator

__all__ = ["GRADIENT_METHODS", "PARTS", "expected_gradient", "gradient_check"]

#: the parameter blocks compared: all six, and the router's ``(a, c)`` alone
PARTS = {"all": slice(0, 6), "router": slice(4, 6)}

#: the methods compared: Sample (reference), Sample Skip (biased), Sample Skip IW (control)
GRADIENT_METHODS = ("sample", "sample_skip", "sample_skip_iw")


def expected_gradient(method: str, tau: float, seed: int, *, copies: int, groups: int,
                      generator: torch.Generator) -> torch.Tensor:
    """Monte Carlo estimates of the expected REINFORCE gradient at ``seed``'s initial parameters.

    Args:
        method: a method of :func:`routelab.estimators.sample_routes`.
        tau: proposal temperature.
        seed: the run's seed (its data and initial parameters, :func:`~.model.init_params`).
        copies: independent route draws per group.
        groups: independent groups (their spread is the Monte Carlo error).
        generator: the sampling noise.

    Returns:
        ``[groups, 6]``: each group's mean gradient over ``(w_0, w_1, b_0, b_1, a, c)``.
    """
    batch = ToyBatch([RunSpec("reinforce", method, tau, seed)] * (copies * groups), dtype=torch.float64)
    routes = batch.sample(batch.logits(), {(False, method): generator})
    _, observed = batch.objective(routes, baseline=torch.zeros(batch.R, dtype=torch.float64))
    obj, _ = batch.objective(routes, baseline=observed.mean().expand(batch.R))
    grads = torch.autograd.grad(obj.sum(), batch.parameters())
    flat = torch.cat([grads[0], grads[1], grads[2].unsqueeze(-1), grads[3].unsqueeze(-1)], dim=-1)  # [R, 6]
    return flat.reshape(groups, copies, 6).mean(1)


def _cosine(u: torch.Tensor, v: torch.Tensor) -> float:
    return float((u @ v) / (u.norm() * v.norm()).clamp(min=1e-300))


def gradient_check(seeds: Sequence[int], taus: Sequence[float], *, copies: int = 2_000, groups: int = 8,
                   seed: int = 0) -> list[dict]:
    """Cosine and norm ratio of Sample Skip's (and Sample Skip IW's) expected gradient to Sample's.

    Returns:
        One row per ``(seed, tau)``, for each ``part`` of :data:`PARTS`: ``cos_skip_{part}`` /
        ``ratio_skip_{part}`` (Sample Skip vs Sample), ``cos_iw_{part}`` / ``ratio_iw_{part}``
        (Sample Skip IW vs Sample), each with its Monte Carlo standard
        error (``*_se``: the spread over the ``groups`` groups of each group's statistic against
        Sample's pooled estimate, over ``sqrt(groups)``; a group's statistic is noisier than the
        pooled one, so this errs on the large side).
    """
    rows = []
    for s in seeds:
        for t in taus:
            g = _seed_generator(seed * 1_000_003 + s, f"gradients:{t:g}")
            est = {m: expected_gradient(m, t, s, copies=copies, groups=groups, generator=g) for m in GRADIENT_METHODS}
            row: dict = {"seed": s, "tau": t, "copies": copies * groups}
            for part, cols in PARTS.items():
                ref = est["sample"][:, cols].mean(0)
                for name, m in (("skip", "sample_skip"), ("iw", "sample_skip_iw")):
                    e = est[m][:, cols]
                    per_cos = torch.tensor([_cosine(g_, ref) for g_ in e], dtype=torch.float64)
                    per_ratio = e.norm(dim=-1) / ref.norm()
                    key = f"{name}_{part}"
                    row[f"cos_{key}"] = _cosine(e.mean(0), ref)
                    row[f"ratio_{key}"] = float(e.mean(0).norm() / ref.norm())
                    row[f"cos_{key}_se"] = float(per_cos.std() / math.sqrt(groups))
                    row[f"ratio_{key}_se"] = float(per_ratio.std() / math.sqrt(groups))
            rows.append(row)
    return rows
