"""n x k Gumbel-Matching sampling and its conditionals (Kool et al. 2021, Sec. 2.2, App. D.3-D.5).

A Gumbel-Matching sample is the balanced assignment (eq. 4) for the perturbed scores
``s = logits / tau + g`` with i.i.d. standard Gumbel noise ``g``. Its per-token marginals are
intractable, but the conditionals given the other tokens' noise are not (eq. 7-9):

    log q(z_i = j | A, G_-i) = log_softmax_j( logits[i, j] / tau - d*[j, z_i] )

where ``z`` is the optimal assignment and ``d*`` the all-pairs shortest paths of the optimal
assignment's expert graph (:mod:`routelab.assignment.balanced`): forcing token ``i`` into expert
``j`` costs ``s[i, z_i] - s[i, j]`` plus the cheapest way ``d*[j, z_i]`` to pass a token from
``j`` back to the slot ``i`` left (eq. 7). The noise ``g_i`` cancels, so the conditionals do not
depend on it. Cost: ``O(nk + k^3)`` per instance on top of the solve, not ``n k`` re-solves.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import (
    check_generator,
    check_plain_tensor,
    check_score_matrix,
    check_score_maximum,
    check_tau,
    random_tensor,
    resolve_capacity,
)
from ._normalise import compute_dtype, ldexp, perturbed_scores
from .balanced import solve_balanced
from .shortest_paths import floyd_warshall

__all__ = ["GumbelMatching", "gumbel_matching", "base_assignment", "sample_gumbel"]

# At tau = 0, experts whose a - d* is within this many (k + 1) rounding units of the best (in the
# normalised scores, spread <= 1) count as tied maximisers: the certificate's own guard is 4.
_TIE_GUARD = 16.0


@dataclass
class GumbelMatching:
    """A Gumbel-Matching sample with everything needed for importance weights.

    Attributes:
        expert: ``[..., n]`` long, the sampled balanced assignment.
        conditional_log_probs: ``[..., n, k]``, ``log q(z_i = j | A, G_-i)`` (eq. 9); each row is a
            normalised distribution over experts; ``-inf`` for forbidden pairs.
        scores: ``[..., n, k]`` the perturbed scores ``logits / tau + gumbels`` that were maximised
            (the logits themselves at ``tau = 0``), finite at every allowed pair and ``-inf`` at
            the forbidden ones. Where that sum overflows the dtype (``|logits| / tau`` beyond
            ``finfo.max``), they are given in units of ``2 ** log2_scale`` instead, shifted per
            token (which changes no assignment): see ``log2_scale``.
        gumbels: ``[..., n, k]`` the Gumbel noise used (zeros when ``tau == 0``).
        shortest_paths: ``[..., k, k]`` ``d*`` of the optimal expert graph (float64, in the units
            of ``scores``), whose arcs move one token or release a free slot
            (:mod:`routelab.assignment.balanced`).
        capacity: capacity per expert that was enforced.
        tau: the temperature.
        log2_scale: ``[...]`` long, 0 unless ``logits / tau + gumbels`` overflows: then
            ``scores * 2 ** log2_scale`` equals it up to a constant per token.
    """

    expert: Tensor
    conditional_log_probs: Tensor
    scores: Tensor
    gumbels: Tensor
    shortest_paths: Tensor
    capacity: int
    tau: float
    log2_scale: Tensor

    def log_prob_of_sample(self) -> Tensor:
        """``[..., n]`` conditional log-probability ``log q(z_i | A, G_-i)`` of each sampled expert."""
        return self.conditional_log_probs.gather(-1, self.expert.unsqueeze(-1)).squeeze(-1)


def sample_gumbel(shape: torch.Size | tuple[int, ...], *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None, generator: torch.Generator | None = None) -> Tensor:
    """I.i.d. standard Gumbel noise ``-log(-log U)``, drawn only through ``generator``.

    ``U`` is drawn in float64 and clamped to ``[tiny, 1 - eps]`` there, so the noise is finite,
    within about ``[-6.6, 36.1]``, and then rounded to ``dtype``: a float32 ``U`` would cap the
    noise at 16.6, and a pair that only a larger draw can select would have zero probability
    while its importance weight assumes otherwise (a review finding).
    """
    check_generator(generator)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    shape = _check_shape(shape)
    wide = torch.float32 if device is not None and torch.device(device).type == "mps" else torch.float64  # (no fp64)
    u = random_tensor(torch.rand, shape, dtype=wide, device=device, generator=generator)
    g = -torch.log(-torch.log(u.clamp(min=torch.finfo(wide).tiny, max=1.0 - torch.finfo(wide).eps)))
    return g.to(dtype)


def _check_shape(shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (an int is one dimension), else a ``ValueError``."""
    dims = (shape,) if isinstance(shape, int) else shape
    try:
        if isinstance(dims, (str, bytes)) or any(isinstance(d, bool) for d in dims):
            raise TypeError
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        out = None
    if out is None or any(d < 0 for d in out):
        raise ValueError(f"shape must be a tuple of non-negative ints, e.g. (n, k), got {shape!r}")
    return out


def gumbel_matching(
    logits: Tensor,
    *,
    tau: float = 1.0,
    capacity: int | None = None,
    gumbels: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> GumbelMatching:
    """Sample a balanced assignment from the n x k Gumbel-Matching distribution, with conditionals.

    Numerics: the perturbed scores are never formed for the solver; it works on their row-shifted,
    power-of-two-scaled form (:func:`routelab.assignment._normalise.perturbed_scores`), so any
    finite logits and any ``tau >= 0`` give finite, normalised conditionals (``tau = 1e-30`` or
    ``1e300``-scale float64 logits included). The assignment is the exact optimum of the perturbed
    scores while the noise ``tau * g`` stays above the solver's resolution of the scores, i.e.
    while ``tau`` is above about ``1e-11`` times a row's spread of finite logits (a review
    measured wrong assignments from a spread of ``1e12 tau``, conditionals off by 0.4 at
    ``1e15 tau``); :func:`routelab.estimators.sample_routes` floors its temperature at ``1e-9``
    times the largest row spread for that reason (``BALANCED_TAU_FLOOR``). float16/bfloat16 logits are
    computed in float32, and every floating output is then float32.

    Args:
        logits: ``[..., n, k]`` unnormalised log-probabilities ``a[i, j]`` (``-inf`` forbids a pair).
        tau: temperature (>= 0); ``tau = 0`` is the deterministic BASE-layers assignment
            (no noise; the conditionals are then the one-hot limit).
        capacity: tokens per expert; default ``n / k`` (``k`` must divide ``n``).
        gumbels: ``[..., n, k]`` noise to use instead of sampling it (for reproducing a sample or
            testing); must be finite. Ignored when ``tau == 0``.
        generator: the only source of randomness when ``gumbels`` is not given.

    Returns:
        :class:`GumbelMatching` with ``expert`` ``[..., n]`` and ``conditional_log_probs``
        ``[..., n, k]``.
    """
    check_score_matrix(logits, "logits", values=False)
    check_plain_tensor(logits, "logits", "gumbel_matching")
    given = isinstance(gumbels, Tensor) and gumbels.is_floating_point()
    # One read of every value this function checks (on a GPU, one synchronisation): the logits'
    # maximum (NaN, +inf), their largest finite magnitude (can a / tau + g overflow?), and for
    # given noise whether it is finite and its largest magnitude. The errors keep their order.
    hi, a_top, g_finite, g_top = _value_summary(logits, gumbels if given else None)
    check_score_maximum(hi, "logits")
    t = check_tau(tau)
    check_generator(generator)
    capacity = resolve_capacity(logits.shape[-2], logits.shape[-1], capacity)  # before any work
    work = compute_dtype(logits.dtype)
    a = logits.detach().to(work)
    if gumbels is not None:
        if not isinstance(gumbels, Tensor) or gumbels.shape != logits.shape:
            got = tuple(gumbels.shape) if isinstance(gumbels, Tensor) else type(gumbels).__name__
            raise ValueError(f"gumbels must be a tensor with the shape of logits {tuple(logits.shape)}, got {got}")
        if not given or not g_finite:
            raise ValueError("gumbels must be finite floats (sample them with routelab.assignment.sample_gumbel)")
    if t == 0.0:
        g = torch.zeros_like(a)  # the deterministic limit uses no noise
    elif gumbels is not None:
        g = gumbels.detach().to(dtype=work, device=logits.device)
    else:
        g = sample_gumbel(logits.shape, dtype=work, device=logits.device, generator=generator)
        g_top = _GUMBEL_BOUND
    # The solver's scores are formed in float64 and shifted per token: a / tau + g in float32 at
    # |a| / tau = 5e7 rounds the noise away (identical tokens then went to the lowest index, and the
    # conditionals, exact, no longer described the sample: a review measured z-scores of 70). They
    # stay within the logits' dtype when 2 |a| / tau + |g| is below half its range (decided on
    # the host from the summary); else _solver_scores tests them (a second read), and rescales.
    limit = torch.finfo(work).max
    fits = t == 0.0 or 2 * a_top / t + g_top <= 0.5 * limit
    n, k = logits.shape[-2], logits.shape[-1]
    batch = logits.shape[:-2]
    S, A, E, e_bound = _solver_scores(a.to(torch.float64).reshape(-1, n, k), t,
                                      g.to(torch.float64).reshape(-1, n, k), fits=fits, limit=limit)
    sol = solve_balanced(S, capacity, name="logits")
    z = sol.expert  # [B, n]
    # d* in the units of S (the solver normalised S once more by 2^log2_scale).
    d = ldexp(floyd_warshall(sol.arc_cost), sol.log2_scale, sol.log2_bound)  # [B, k, k], float64
    # d_to[b, i, j] = d*[j, z_i]: cheapest way to refill the slot token i leaves.
    d_to = d.transpose(-1, -2).gather(1, z.unsqueeze(-1).expand(-1, -1, k))
    val = A - d_to  # the a / tau - d* of eq. 9, in units of 2^E
    top = val.amax(-1, keepdim=True)
    shifted = val - torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # <= 0, 0 at the best
    if t == 0.0:
        # tau -> 0 limit of log_softmax((a - tau d) / tau): mass on the maximisers of a - d*. The
        # sampled expert is one (the certificate of the solve); others within its rounding guard
        # (relative to the spread of S, about 2^log2_scale) count as ties.
        guard = _TIE_GUARD * (k + 1) * torch.finfo(work).eps
        hit = shifted >= -ldexp(torch.full_like(top, guard), sol.log2_scale, sol.log2_bound)
        hit.scatter_(-1, z.unsqueeze(-1), True)
        log_q = torch.where(
            hit, -torch.log(hit.sum(-1, keepdim=True).to(torch.float64)), torch.full_like(val, float("-inf"))
        )
    else:
        log_q = torch.log_softmax(ldexp(shifted, E, e_bound), dim=-1)
    return GumbelMatching(
        expert=z.view(*batch, n),
        conditional_log_probs=log_q.to(work).view(*batch, n, k),
        scores=_reported_scores(a, t, g, S, a_top, g_top).view(a.shape),
        gumbels=g,
        shortest_paths=d.view(*batch, k, k),
        capacity=sol.capacity,
        tau=t,
        log2_scale=E.view(batch),
    )


#: A bound on |g| for :func:`sample_gumbel`'s noise in any dtype (within [-6.6, 36.1]).
_GUMBEL_BOUND = 40.0


def _value_summary(logits: Tensor, gumbels: Tensor | None) -> tuple[float, float, bool, float]:
    """``(max logits, largest finite |logit|, gumbels all finite, largest |gumbel|)`` in one host
    read; the noise entries are ``True, 0.0`` without ``gumbels``, and everything is neutral for
    an empty batch."""
    if logits.numel() == 0:
        return -math.inf, 0.0, True, 0.0
    def top(x: Tensor) -> Tensor:  # the largest finite magnitude
        return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax().double()

    a = logits.detach()
    parts = [a.amax().double(), top(a)]
    if gumbels is not None and gumbels.numel():
        g = gumbels.detach()
        parts += [t.to(a.device) for t in (torch.isfinite(g).all().double(), top(g))]
    hi, a_top, *rest = torch.stack(parts).tolist()
    g_finite, g_top = (bool(rest[0]), rest[1]) if rest else (True, 0.0)
    return hi, a_top, g_finite, g_top


def _reported_scores(a: Tensor, t: float, g: Tensor, S: Tensor, a_top: float, g_top: float) -> Tensor:
    """The ``scores`` field: the literal ``a / t + g`` in ``a``'s dtype where it fits that dtype,
    else the solver's scores (shifted per token, in units of ``2^log2_scale``) in it."""
    if t == 0.0:
        return a
    if a_top / t + g_top <= 0.5 * torch.finfo(a.dtype).max:
        return a / t + g
    return S.to(a.dtype)


def _solver_scores(a: Tensor, t: float, g: Tensor, *, fits: bool = False,
                   limit: float | None = None) -> tuple[Tensor, Tensor, Tensor, int | None]:
    """What the solver maximises, the noise-free part of it, and their units.

    The perturbed scores shifted per token, ``(a - max_j a) / t + g`` (exponent 0), whenever they
    are finite at every allowed pair: the same assignment as ``a / t + g``, and the shift keeps
    the noise resolved where ``|a| / t`` is large (identical tokens are equal after it). Where
    they overflow the dtype, the same problem brought to a common power-of-two exponent ``E``
    (:func:`._normalise.perturbed_scores`): ``a / t + g = 2^E S`` + per-token constants.

    Args:
        a: ``[B, n, k]`` logits (``-inf`` forbids a pair), float64 from :func:`gumbel_matching`.
        t: temperature (``0``: no noise, ``S`` the shifted ``a``).
        g: ``[B, n, k]`` the noise (zeros at ``t = 0``).
        fits: the caller knows that the shifted scores are within ``limit`` wherever ``a`` is
            not ``-inf`` (no test, no host synchronisation); else it is tested here.
        limit: the largest magnitude the literal scores may have (the logits' dtype's; default
            ``a``'s), beyond which they are rescaled (and reported so, in that dtype).

    Returns:
        ``(S, A, E, bound)``: ``[B, n, k]`` scores to solve, ``[B, n, k]`` float64 ``a / t`` in the
        same units (shifted per token), ``[B]`` long exponent, and ``max |E|`` where it is known
        on the host (0 for the literal scores; else ``None``).
    """
    B = a.shape[0]
    top = a.amax(-1, keepdim=True)
    shifted = a - torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # <= 0 per token
    A = shifted if t == 0.0 else shifted / t
    # a / t + g up to a constant per token (the same assignment); at t = 0 the logits themselves
    # (no noise to resolve, and their shift can overflow near the dtype's maximum)
    literal = a if t == 0.0 else A + g
    limit = torch.finfo(a.dtype).max if limit is None else limit
    if fits or not bool(((literal.abs() > limit) & ~torch.isneginf(a)).any()):
        return literal, A.to(torch.float64), torch.zeros(B, dtype=torch.long, device=a.device), 0
    S, A, E = perturbed_scores(a, t, g)
    return S, A.to(torch.float64), E, None


def base_assignment(logits: Tensor, capacity: int | None = None) -> Tensor:
    """The deterministic balanced assignment of BASE layers (Lewis et al. 2021).

    The ``tau -> 0`` limit of :func:`gumbel_matching`: the exact maximiser of
    ``sum_i logits[i, z_i]`` under the capacity, i.e. :func:`balanced_assignment` of the logits.

    Args:
        logits: ``[..., n, k]`` router scores.
        capacity: tokens per expert; default ``n / k``.

    Returns:
        ``[..., n]`` long expert per token.
    """
    return solve_balanced(logits, capacity, name="logits").expert.view(logits.shape[:-1])
