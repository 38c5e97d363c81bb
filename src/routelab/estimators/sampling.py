"""Routing samples under expert capacity, with importance weights (Kool et al. 2021, Sec. 2-3).

The router's distribution is ``p = softmax(logits)``. Tokens are routed by sampling from a
*proposal*: ``softmax(logits / tau)``, first balanced by Sinkhorn when ``sinkhorn=True``
(Sec. 2.3, App. E). Capacity is respected by skipping (Sec. 2.1) or by balanced Gumbel-Matching
samples (Sec. 2.2). The importance weight of each routed token corrects for what the proposal
and the capacity did, so that for the unbiased methods and any table ``h``

    E[ sum_i keep_i * weight_i * h(i, expert_i) ] = sum_i sum_j p_ij h_ij.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .._checks import bad_tau, check_generator, check_score_matrix, resolve_capacity, tau_tensor
from ..assignment import (
    amax,
    argmax,
    gumbel_matching,
    log_softmax,
    sample_gumbel,
    sinkhorn_balance,
    uses_closed_form,
)
from ..routes import Routes
from ..routing.capacity import random_skip
from ..routing.losses import switch_balance
from ._record import MAX_WEIGHT, routes_record, score_limit, skip_correction, unreachable_mass
from .two_experts import sample_two

__all__ = ["MAX_WEIGHT", "METHODS", "UNBIASED_METHODS", "CAPPED_METHODS", "sample_routes", "switch_balance_loss"]

#: Every routing method, named as in Kool et al. (2021), Sec. 3.
METHODS: tuple[str, ...] = (
    "sample",
    "sample_skip",
    "sample_skip_iw",
    "gumbel_matching",
    "gumbel_matching_iw",
    "gumbel_matching_sh",
)
#: The methods whose weights make the estimate unbiased (with or without Sinkhorn).
UNBIASED_METHODS: tuple[str, ...] = ("sample", "sample_skip_iw", "gumbel_matching_iw")
#: Sinkhorn balancing of the proposal: relative column tolerance and most sweeps per call.
SINKHORN_TOL = 1e-6
SINKHORN_SWEEPS = 100
#: The methods that respect the expert capacity.
CAPPED_METHODS: tuple[str, ...] = METHODS[1:]
#: The smallest temperature of a balanced (Gumbel-Matching) sample, relative to the largest spread
#: of a row's finite logits (max - min per token) in the instance. Below it the Gumbel noise, of
#: size ``tau``, falls under the balanced solver's relative resolution of the scores (float64; a review measured wrong
#: assignments from a ratio of 1e12 and conditionals off by 0.4 at 1e15): the sample would no
#: longer be the Gumbel-Matching sample its conditionals describe. A floored proposal is still
#: exactly what is sampled and what the weights correct for, so every unbiased method stays
#: unbiased; at ``1e-9`` it differs from the deterministic balanced assignment only between
#: assignments whose scores agree to 1e-8 of the spread (where the noise is the fair tie-break).
BALANCED_TAU_FLOOR = 1e-9


def sample_routes(
    logits: Tensor,
    method: str,
    *,
    tau: float | Tensor = 1.0,
    capacity: int | None = None,
    sinkhorn: bool = False,
    generator: torch.Generator | None = None,
) -> Routes:
    """Route every token to one expert with ``method``, with importance weights.

    Methods (Sec. 3):

    * ``sample`` — independent samples from the proposal, no capacity (the ideal baseline);
      weight ``p / q``.
    * ``sample_skip`` — the same, then each expert keeps at most ``capacity`` of its tokens,
      chosen uniformly at random (a uniform shuffle); the kept tokens are plainly averaged:
      weight ``(p / q) * n / n_kept`` (biased).
    * ``sample_skip_iw`` — as ``sample_skip`` with the correction of eq. 3: weight
      ``(p / q) * n_z / min(n_z, capacity)`` (unbiased).
    * ``gumbel_matching`` — a balanced n x k Gumbel-Matching sample (eq. 4) of the proposal;
      weight ``p / q`` corrects for the temperature only, not the balancing (biased).
    * ``gumbel_matching_iw`` — the same sample with weight ``p / q(z_i | A, G_-i)``, the
      conditionals of eq. 6-9 (unbiased, App. D.5, wherever a conditional is positive where
      ``p`` is: when ``-inf`` pairs and the capacity force a token off an expert it has
      probability for, that mass is missed, reported in ``stats["unreachable_mass"]`` and warned
      about).
    * ``gumbel_matching_sh`` — the same sample with the Sinkhorn marginals of the proposal as
      ``q`` (a biased heuristic, Sec. 2.3).

    Numerics: the proposal is ``log_softmax((logits - max) / tau)`` per row, so neither a
    common offset nor a small ``tau`` loses the normalisation; scaled scores below
    ``-finfo.max / (16 max(n, k))`` (probability 0 in any float format) are floored there for
    the balanced methods, so that no finite pair becomes forbidden. Importance weights are
    computed in log space, ``exp(log p - log q + log correction)``, and clamped at
    :data:`MAX_WEIGHT`: a weight that large means the proposal all but missed the router's
    mass (the biased ``gumbel_matching`` and ``gumbel_matching_sh`` force tokens onto experts of
    proposal probability ``exp(-1000)`` at small ``tau``); ``stats["weights_clamped"]`` counts
    the clamped weights per instance, and an estimate with clamped weights is biased by at most
    the router mass ``p`` of those pairs. No weight is ever inf or NaN.

    Args:
        logits: ``[..., n, k]`` router logits (``-inf`` forbids a pair; every token needs at
            least one finite logit); gradients flow into ``gate``, ``log_prob`` and
            ``aux["balance"]``. float16/bfloat16 logits are computed in float32. A leading
            batch dimension of size 0 gives empty routes of the right shapes.
        method: one of :data:`METHODS`.
        tau: proposal temperature ``> 0``: a number, or a tensor of the batch shape ``[...]``
            (one temperature per instance). The Gumbel-Matching methods floor it at
            :data:`BALANCED_TAU_FLOOR` times the largest spread of a token's finite logits.
        capacity: tokens per expert for the capped methods, at least ``ceil(n / k)``; default
            ``n / k`` (then ``k`` must divide ``n``). Ignored by ``sample`` (validated all the
            same).
        sinkhorn: balance the proposal with Sinkhorn (columns ``n / k``) before sampling.
        generator: the only source of randomness (a :class:`torch.Generator` or ``None``).

    Returns:
        :class:`~routelab.routes.Routes` with one slot per token, per-slot tensors ``[..., n, 1]``
        (the layout of every router): ``expert``; ``keep`` (False where capacity skipped the token);
        ``weight`` (detached importance weight, finite, at most :data:`MAX_WEIGHT`); ``gate = p[expert]`` and
        ``log_prob = log p[expert]`` (differentiable); ``aux["balance"]`` the Switch
        load-balancing loss ``[...]``; ``stats["tokens_per_expert"]`` ``[..., k]``,
        ``stats["dropped_fraction"]`` ``[...]``, ``stats["weights_clamped"]`` ``[...]``
        (long) and ``stats["unreachable_mass"]`` ``[...]`` (the router mass per token on pairs
        the weights' reference probability gives 0, which the estimate misses; 0 whenever the
        method is unbiased). ``gate``, ``log_prob`` and ``aux["balance"]`` have the logits' dtype;
        ``weight`` has it too, except for float16/bfloat16 logits, whose weights are float32
        (importance weights need its range and resolution).

    Raises:
        ValueError: unknown method (lists the valid ones), ``tau <= 0`` or of the wrong shape,
            bad logits (NaN, +inf, a row that is all ``-inf``), or a capacity that cannot hold
            the tokens.
        TypeError: ``logits`` is not a tensor or ``generator`` is not a ``torch.Generator``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    check_generator(generator)
    check_score_matrix(logits, "logits")
    n, k = logits.shape[-2], logits.shape[-1]
    batch = logits.shape[:-2]
    if method == "sample":
        c = None if capacity is None else resolve_capacity(n, k, capacity)
    else:
        c = resolve_capacity(n, k, capacity, at_most_tokens=True)
    # Half precision is computed in float32 (the cast is differentiable).
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    a = x.detach()
    two = k == 2 and uses_closed_form(k)  # the closed forms of two_experts.py (one switch for k <= 2)
    top = None if two else amax(a)  # [..., n] row maxima, -inf only for a row without an expert
    # A balanced sample's temperature is floored relative to the logit spread (BALANCED_TAU_FLOOR).
    floor = _balanced_tau_floor(a) if method.startswith("gumbel_matching") and a.numel() else None
    # One host sync validates tau and the rows (or, for k = 2, asks whether every logit is finite).
    T, tau_value, finite = _temperature(tau, batch, x, top, check_finite=a if two else None, floor=floor)
    if finite:  # k = 2 and every logit finite
        # Closed forms on the logit difference: same distributions, half the work (two_experts.py).
        return _cast_routes(sample_two(x, method, T, c, sinkhorn, generator, sinkhorn_tol=SINKHORN_TOL,
                                       sinkhorn_sweeps=SINKHORN_SWEEPS), logits.dtype)
    if top is None:  # k = 2 with -inf logits: the rows are checked here
        top = amax(a)
        if bool((top == float("-inf")).any()):
            _dead_row(top)

    log_p = log_softmax(x)
    scaled = (a - top.unsqueeze(-1)) / T  # shift first: exact at any offset, no overflow at 0
    log_q = log_softmax(scaled)
    if sinkhorn:
        log_q = _sinkhorn(log_q)

    if a.numel() == 0:  # an empty batch: nothing to sample
        expert = torch.zeros(a.shape[:-1], dtype=torch.long, device=a.device)
        log_q_z = torch.zeros(expert.shape, dtype=a.dtype, device=a.device)
        keep = torch.ones_like(expert, dtype=torch.bool)
        correction = None
    elif method.startswith("sample"):
        # float64 noise (bounded at 36, not float32's 16.6): every pair of proposal probability
        # above about 1e-16, far below 1 / MAX_WEIGHT, can be drawn, as its importance weight assumes.
        expert = argmax(log_q + sample_gumbel(log_q.shape, dtype=torch.float64, device=log_q.device,
                                              generator=generator))
        q_ref = log_q
        log_q_z = log_q.gather(-1, expert.unsqueeze(-1)).squeeze(-1)
        keep = torch.ones_like(expert, dtype=torch.bool)
        correction = None
        if method != "sample":
            keep, load = random_skip(expert, k, c, generator, check=False)  # sampled: in range
            correction = skip_correction(method, keep, load.to(log_q.dtype), c)
    else:
        # The solver takes the temperature itself (floored above: BALANCED_TAU_FLOOR), on the
        # row-shifted logits.
        # One temperature per instance (a tau tensor) is not in gumbel_matching's contract (a
        # float): those instances are scaled here.
        # With Sinkhorn the balanced proposal is the one sampled: its column offsets change the
        # solution of eq. 4 whenever the capacity exceeds n / k (Sec. 2.3's invariance needs every
        # column exactly full), so it is solved on log_q itself (already scaled by tau).
        if sinkhorn:
            gm = gumbel_matching(_floor_scores(log_q, a), tau=1.0, capacity=c, generator=generator)
        elif tau_value is not None:
            gm = gumbel_matching(a - top.unsqueeze(-1), tau=tau_value, capacity=c, generator=generator)
        else:
            gm = gumbel_matching(_floor_scores(scaled, a), tau=1.0, capacity=c, generator=generator)
        expert = gm.expert
        if method == "gumbel_matching_iw":
            q_ref = gm.conditional_log_probs
        elif method == "gumbel_matching_sh":
            q_ref = log_q if sinkhorn else _sinkhorn(log_q)
        else:
            q_ref = log_q
        log_q_z = q_ref.gather(-1, expert.unsqueeze(-1)).squeeze(-1)
        keep = torch.ones_like(expert, dtype=torch.bool)
        correction = None

    unreachable = None if a.numel() == 0 else unreachable_mass(log_p, q_ref)
    if method == "gumbel_matching_iw" and a.numel() and float(unreachable.amax()) > 0:
        warnings.warn(
            f"gumbel_matching_iw: the -inf logits and the capacity force tokens off experts they have probability "
            f"for (up to {float(unreachable.amax()):.3g} of the router mass per token is on pairs no balanced "
            f"sample can use), so the importance-weighted estimate misses that mass: it is unbiased only for "
            f"the feasible pairs. routes.stats['unreachable_mass'] reports it; raise the capacity or forbid fewer "
            f"pairs", RuntimeWarning, stacklevel=2)
    log_p_z = log_p.gather(-1, expert.unsqueeze(-1)).squeeze(-1)
    counts = torch.zeros((*batch, k), dtype=torch.long, device=logits.device)
    counts.scatter_add_(-1, expert, keep.long())
    balance = switch_balance(log_p.exp())
    return _cast_routes(routes_record(expert, keep, log_p_z, log_q_z, correction, balance, counts, unreachable),
                        logits.dtype)


def switch_balance_loss(probs: Tensor, expert: object = None, keep: object = None) -> Tensor:
    """Switch-Transformer load-balancing loss ``k * sum_j f_j * P_j`` (Fedus et al. 2021): the
    ``aux["balance"]`` of :func:`sample_routes`, with its argument checked.

    :func:`routelab.routing.switch_balance`, the one definition: ``f_j`` is the fraction of the
    ``n`` tokens whose router argmax is ``j`` (before any sampling, skipping or balancing; not
    differentiable) and ``P_j`` the mean router probability of ``j``. It is 1 when both are
    uniform and grows as the router concentrates -- also under Gumbel-Matching, whose sampled
    assignment is balanced by construction while the router need not be.

    Args:
        probs: ``[..., n, k]`` router probabilities (differentiable).
        expert, keep: no longer taken (``f`` used to count the sampled, kept experts, which made
            the loss the constant 1 under Gumbel-Matching); passing either is a ``TypeError``.

    Returns:
        ``[...]``.

    Raises:
        ValueError: ``probs`` not a floating ``[..., n, k]`` tensor.
        TypeError: ``expert`` or ``keep`` given.
    """
    for name, value in (("expert", expert), ("keep", keep)):
        if value is not None:
            raise TypeError(f"switch_balance_loss takes no {name} argument: f_j is the fraction of tokens whose "
                            "router argmax is j (Switch Transformer), computed from probs; call "
                            "switch_balance_loss(probs)")
    if not isinstance(probs, Tensor) or probs.ndim < 2 or not probs.is_floating_point():
        raise ValueError(f"probs must be a floating tensor [..., n, k], got {getattr(probs, 'shape', type(probs))}")
    return switch_balance(probs)


def _temperature(tau: float | Tensor, batch: torch.Size, like: Tensor, top: Tensor | None = None,
                 check_finite: Tensor | None = None, floor: Tensor | None = None) -> tuple[Tensor, float | None, bool]:
    """``(T, value, finite)``: ``tau`` as a ``[..., 1, 1]`` tensor, validated ``> 0`` in one host sync.

    ``value`` is ``tau`` as a float when it is one temperature for every instance (a number or a
    0-dim tensor), else ``None``. The same sync also checks, given ``top`` (the row maxima of the
    logits), that no row is all ``-inf``, and reports whether every entry of ``check_finite`` is
    finite (False if not given). ``floor`` (``[..., 1, 1]``, optional): the smallest temperature
    of each instance; ``T`` is raised to it, and ``value`` is then ``None`` where it bites.
    """
    T, invalid = tau_tensor(tau, batch, like)  # the temperature contract (routelab._checks)
    scalar = not isinstance(tau, Tensor) or tau.ndim == 0
    flags = [invalid.to(torch.float64)]
    given = T
    if floor is not None:
        T = torch.maximum(given, floor.to(given.dtype))
        if scalar:  # one temperature no longer, where some instance's floor bites
            flags.append((given < floor).any().to(torch.float64))
    if top is not None:
        flags.append((top == float("-inf")).any().to(torch.float64))
    if check_finite is not None:
        flags.append(torch.isfinite(check_finite).all().to(torch.float64))
    if scalar and isinstance(tau, Tensor):
        flags.append(given.reshape(()).to(torch.float64))
    bad, *rest = torch.stack(flags).tolist()
    if bad:
        raise bad_tau(tau, dtype=like.dtype)
    bites = bool(rest.pop(0)) if floor is not None and scalar else False
    if top is not None and rest.pop(0):
        _dead_row(top)
    finite = bool(rest.pop(0)) if check_finite is not None else False
    value = (rest.pop(0) if isinstance(tau, Tensor) else float(tau)) if scalar and not bites else None
    return T, value, finite


def _balanced_tau_floor(a: Tensor) -> Tensor:
    """``[..., 1, 1]``: :data:`BALANCED_TAU_FLOOR` times the largest spread of a row's finite logits
    in each instance (``max - min`` per row: the solver sees row-shifted scores, and a constant
    added to one token's logits changes no distribution, so it must not change the floor either).

    Scaled before the subtraction, so that a spread beyond the dtype's range still gives a finite floor.
    """
    finite = torch.isfinite(a)
    hi = torch.where(finite, a, float("-inf")).amax(-1) * BALANCED_TAU_FLOOR
    lo = torch.where(finite, a, float("inf")).amin(-1) * BALANCED_TAU_FLOOR
    spread = (hi - lo).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # (rows without a finite logit: 0)
    return spread.amax(-1).clamp_(min=0.0)[..., None, None]


def _dead_row(top: Tensor) -> None:
    """The ValueError for logits with a row that is all ``-inf`` (``top``: the row maxima)."""
    where = tuple((top == float("-inf")).nonzero()[0].tolist())
    entry = f" of batch entry {where[:-1]}" if len(where) > 1 else ""
    raise ValueError(
        f"logits has a row that is all -inf (row {where[-1]}{entry}): that token has no allowed expert; "
        f"give every token at least one finite logit"
    )


def _floor_scores(scaled: Tensor, a: Tensor) -> Tensor:
    """``scaled`` with finite pairs floored at ``-finfo.max / (16 max(n, k))``, forbidden pairs ``-inf``.

    A tiny ``tau`` sends the scaled scores of unlikely pairs to ``-inf``, which the balanced
    solvers would read as forbidden (and then perhaps infeasible); the floor keeps them finite
    (and any sum of ``n`` of them too) while they keep probability 0.
    """
    floor = -score_limit(a.dtype, a.shape[-2], a.shape[-1])
    return torch.where(a == float("-inf"), a, scaled.clamp(min=floor))


def _cast_routes(routes: Routes, dtype: torch.dtype) -> Routes:
    """``routes`` with gate, log_prob and the balance loss in ``dtype`` (half-precision logits);
    the weight stays in float32."""
    if routes.gate.dtype == dtype:
        return routes
    routes.gate = routes.gate.to(dtype)
    routes.log_prob = routes.log_prob.to(dtype)
    routes.aux = {name: v.to(dtype) for name, v in routes.aux.items()}
    return routes


def _sinkhorn(log_q: Tensor) -> Tensor:
    """The proposal balanced by Sinkhorn towards columns ``n / k`` (at most SINKHORN_SWEEPS sweeps).

    Only the balance of the proposal depends on convergence: its rows are exact distributions
    after every sweep, and the importance weights use exactly this proposal, so the unbiased
    methods stay unbiased even when a very peaked proposal (low ``tau``) is not fully balanced.
    """
    n, k = log_q.shape[-2], log_q.shape[-1]
    target = torch.full((k,), n / k, dtype=log_q.dtype, device=log_q.device)
    rel = max(SINKHORN_TOL, 4 * torch.finfo(log_q.dtype).eps * n**0.5)  # what the dtype resolves
    x, _ = sinkhorn_balance(log_q, target, tol=rel * n / k, max_iter=SINKHORN_SWEEPS)
    return x
