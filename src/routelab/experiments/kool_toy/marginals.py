"""Sec. 2.3 check: Sinkhorn marginals approximate the Gumbel-Matching marginals for n >= 4.

For each ``n`` (k = 2 experts, capacity ``n / 2``) we draw a few random logit matrices, take many
Gumbel-Matching samples of each in one batched :func:`~routelab.assignment.gumbel_matching` call
(``tau = 1``), and compare the empirical per-token marginals ``P(z_i = j)`` with the Sinkhorn
balanced matrix ``exp(sinkhorn(log_softmax(logits)))``. The Monte Carlo standard error of an
empirical marginal ``m`` from ``S`` samples is ``sqrt(m (1 - m) / S)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from ...assignment import gumbel_matching, sinkhorn

__all__ = ["marginals_check"]


def marginals_check(
    ns: Sequence[int] = (2, 4, 8, 16, 32),
    *,
    matrices: int = 8,
    samples: int = 20_000,
    logit_std: float = 1.0,
    seed: int = 0,
    max_instances: int = 200_000,
) -> list[dict]:
    """Compare Gumbel-Matching marginals (Monte Carlo) with Sinkhorn marginals.

    Args:
        ns: numbers of tokens (even: capacity ``n / 2`` for ``k = 2``).
        matrices: random logit matrices per ``n`` (entries ``N(0, logit_std^2)``).
        samples: Gumbel-Matching samples per matrix.
        seed: seeds the logits and the Gumbel noise.
        max_instances: at most this many ``n x 2`` instances per ``gumbel_matching`` call
            (memory bound); the samples of one ``n`` are split into as few calls as that allows.

    Returns:
        One dict per ``n``: ``n``, ``matrices``, ``samples``, ``max_abs_diff``, ``mean_abs_diff``
        (over all matrices, tokens and experts), ``mean_se`` and ``max_se`` (Monte Carlo standard
        errors of the empirical marginals), ``se_of_max`` (the standard error at the entry with
        the largest difference), ``mean_abs_diff_unbalanced`` (the empirical marginals against
        the unbalanced softmax, for scale), ``seconds``.
    """
    if matrices < 1 or samples < 2:
        raise ValueError(f"need matrices >= 1 and samples >= 2, got {matrices}, {samples}")
    rows = []
    for n in ns:
        if n < 2 or n % 2:
            raise ValueError(f"every n must be an even number >= 2 (capacity n/2 with k=2), got {n}")
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(seed * 1000 + n)
        logits = torch.randn(matrices, n, 2, generator=g, dtype=torch.float64) * logit_std
        counts = torch.zeros(matrices, n, 2, dtype=torch.float64)
        per_call = max(1, max_instances // matrices)
        done = 0
        while done < samples:
            s = min(per_call, samples - done)
            batch = logits.unsqueeze(0).expand(s, matrices, n, 2)
            gm = gumbel_matching(batch, tau=1.0, generator=g)
            counts += torch.nn.functional.one_hot(gm.expert, 2).to(torch.float64).sum(0)
            done += s
        emp = counts / samples
        sk = sinkhorn(torch.log_softmax(logits, dim=-1), tol=1e-10).exp()
        diff = (emp - sk).abs()
        se = (emp * (1 - emp) / samples).sqrt()
        flat = int(diff.argmax())
        rows.append(
            {
                "n": n,
                "matrices": matrices,
                "samples": samples,
                "max_abs_diff": float(diff.max()),
                "mean_abs_diff": float(diff.mean()),
                "mean_se": float(se.mean()),
                "max_se": float(se.max()),
                "se_of_max": float(se.flatten()[flat]),
                # the mean of |diff| has a noise floor of about sqrt(2/pi) * SE
                "noise_floor": float(se.mean()) * math.sqrt(2 / math.pi),
                "mean_abs_diff_unbalanced": float((emp - torch.softmax(logits, -1)).abs().mean()),
                "seconds": time.perf_counter() - t0,
            }
        )
    return rows
