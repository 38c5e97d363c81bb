"""The start of the exact b-matching (:mod:`.b_matching`): every token's ``k`` best experts under
approximate expert prices.

**Prices.** At prices ``u`` every token takes its ``k`` best experts under ``s[i, j] - u_j``;
token ``i`` takes ``j`` iff ``s[i, j] - u_j`` beats ``theta[i, j]``, the ``k``-th best of its
*other* reduced scores. Expert ``j``'s best response to the other prices is therefore the price at
which exactly its quota ``q`` of tokens clear that bar: between the ``q``-th and ``(q + 1)``-th
largest of ``s[i, j] - theta[i, j]`` over the tokens (coordinate descent on the dual
``sum_i top-k-sum_j (s[i, j] - u_j) + q sum_j u_j``). Damped Jacobi steps towards the best
responses give prices that place most pairs; the start with the smallest quota violation is
kept. Under a capacity alone (``lo = 0``) a second trajectory starts from no prices, every
token's own ``k`` best: the optimum itself when no expert is over capacity (the centred-means
start moved hundreds of pairs off their best experts there, one cancelling round per few pairs),
and the better start where a few experts are popular; tokens that share one preference converge
from the centred means (:data:`NO_PRICE_PREFERENCE` decides between them). The prices only speed
up the start: exactness comes from the cycle cancelling that follows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._groups import rank_within_groups

__all__ = ["initial_b_matching", "repair_quotas", "start_b_matching"]


def start_b_matching(
    S: Tensor, k: int, lo: int, hi: int, steps: int = 4, damping: float = 0.7
) -> tuple[Tensor, Tensor]:
    """The start for the finite scores ``S``: approximate prices and the b-matching they give.

    Args:
        S: ``[B, n, E]`` finite scores, ``k < E``.
        k: experts per token.
        lo, hi: the quotas; ``lo = 0`` is a capacity-only bound (prices then stay ``>= 0``).
        steps: Jacobi steps (a fixed budget).
        damping: fraction of the way to the best responses each step goes.

    Returns:
        ``(prices, held)``: ``[B, E]`` prices and the ``[B, n, E]`` bool start
        (:func:`initial_b_matching` of them) with the smallest residual among the ``steps + 1``
        iterates (:func:`_jacobi`; under a capacity alone, of the trajectory chosen).
    """
    n, E = S.shape[-2:]
    slack = lo == 0 and hi * E > k * n
    q = min(hi if lo == 0 else round(k * n / E), n - 1)
    u = S.mean(dim=1)
    u = u - (u.amin(dim=-1, keepdim=True) if slack else u.mean(dim=-1, keepdim=True))
    if not slack:
        return _jacobi(S, u, k, lo, hi, q, steps, damping, slack=False)[:2]
    # Under a capacity alone, two trajectories: from no prices (every token's own top k: the optimum
    # itself when no expert is over capacity; popular experts converge from there), and from the
    # centred means (tokens that share one preference converge from there). The first is kept
    # unless the second's residual is below 1 / NO_PRICE_PREFERENCE of its own.
    u0, held0, bad0 = _jacobi(S, torch.zeros_like(u), k, lo, hi, q, steps, damping, slack=True)
    if not bool(bad0.any()):
        return u0, held0
    u1, held1, bad1 = _jacobi(S, u, k, lo, hi, q, steps, damping, slack=True)
    second = NO_PRICE_PREFERENCE * bad1 < bad0  # [B]
    return (torch.where(second.unsqueeze(-1), u1, u0), torch.where(second.view(-1, 1, 1), held1, held0))


#: How much smaller the centred-means start's residual must be to be taken over the no-price start
#: under a capacity alone. Measured (rounds of the cancelling that follows): popular experts
#: (``randn + linspace(2, 0, E)``, capacity 1.1 k n / E) took 128 and 86 rounds from the no-price
#: start against 192 and 128 from the centred means, whose residual was only 1.1-1.2x smaller; a
#: shared preference (``tile(randn(E)) + 0.01 randn``, capacity k n / E + 1) took 33-70 rounds from
#: the centred means, residual 45 against 30908, and 215-326 from no prices.
NO_PRICE_PREFERENCE = 4


def _jacobi(S: Tensor, u: Tensor, k: int, lo: int, hi: int, q: int, steps: int, damping: float, *,
            slack: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``steps`` damped Jacobi steps from prices ``u [B, E]``; ``(prices, held, residual)`` of the
    iterate with the smallest residual (``[B]`` each instance its own), stopping once every
    instance has residual 0. The residual: pairs outside the quotas; under a capacity alone
    (``slack``) the residual of its optimality conditions, the pairs over capacity plus the room
    left at experts with a positive price (a count of violations alone preferred over-priced
    starts that overfill nothing)."""
    best_u = best_held = best_bad = None
    for step in range(steps + 1):
        held, top = _top_k(S, u, k)
        loads = held.sum(1)
        if slack:
            bad = ((loads - hi).clamp(min=0) + torch.where(u > 0, (hi - loads).clamp(min=0), 0)).sum(-1)
        else:
            bad = ((loads - hi).clamp(min=0) + (lo - loads).clamp(min=0)).sum(-1)  # [B]
        if best_bad is None:
            best_u, best_held, best_bad = u, held, bad
        else:
            better = bad < best_bad
            best_u = torch.where(better.unsqueeze(-1), u, best_u)
            best_held = torch.where(better.view(-1, 1, 1), held, best_held)
            best_bad = torch.minimum(bad, best_bad)
        if step == steps or not bool(best_bad.any()):
            break
        kth, next_ = top[..., k - 1 : k], top[..., k : k + 1]
        chosen = S - u.unsqueeze(1) >= kth
        # theta: the k-th best of the other experts (the (k+1)-th if j itself is among the k best)
        d = S - torch.where(chosen, next_, kth)
        if q == 0:
            response = d.amax(dim=1) + 1.0
        else:
            pair = d.topk(q + 1, dim=1).values  # [B, q + 1, E]
            response = 0.5 * (pair[:, q - 1] + pair[:, q])
        if slack:
            response = response.clamp(min=0.0)
        u = u + damping * (response - u)
    return best_u, best_held, best_bad


def initial_b_matching(S: Tensor, prices: Tensor, k: int) -> Tensor:
    """``[B, n, E]`` bool: every token's ``k`` best experts under ``S - prices``.

    Ties at the ``k``-th place would send every tied token to the same experts (all-equal scores:
    all ``n`` tokens to experts ``0..k-1``), leaving the cycle cancelling ``O(k n / E)`` rounds of
    repairs; token ``i`` breaks them in the rotated expert order ``i k, i k + 1, ...`` (mod
    ``E``) instead, which spreads them evenly. Any tie-break is as good for the objective.

    Args:
        S: ``[B, n, E]`` finite scores, ``k < E``.
        prices: ``[B, E]`` expert prices.
        k: experts per token.
    """
    return _top_k(S, prices, k)[0]


def _top_k(S: Tensor, prices: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`initial_b_matching`, and the ``[B, n, k + 1]`` best reduced scores of every token."""
    E = S.shape[-1]
    R = S - prices.unsqueeze(1)
    top = R.topk(k + 1, dim=-1)
    held = torch.zeros(S.shape, dtype=torch.bool, device=S.device).scatter_(-1, top.indices[..., :k], True)
    tied = (top.values[..., k - 1] == top.values[..., k]).nonzero(as_tuple=True)
    if tied[0].numel():
        b, i = tied
        rotate = (i.unsqueeze(-1) * k + torch.arange(E, device=S.device)) % E  # [r, E] expert order
        rows = R[b, i].gather(-1, rotate)
        pick = rotate.gather(-1, torch.argsort(rows, dim=-1, descending=True, stable=True)[:, :k])
        held[b, i] = torch.zeros((b.numel(), E), dtype=torch.bool, device=S.device).scatter_(-1, pick, True)
    return held, top.values


def repair_quotas(S: Tensor, held: Tensor, lo: int, hi: int, max_rounds: int) -> Tensor:
    """Bring the loads of a b-matching into ``[lo, hi]`` by rounds of bulk moves (greedy).

    While an expert is above ``hi``, the *givers* are the experts above ``hi`` (each may shed its
    excess) and the *receivers* those below ``hi``; otherwise, while one is below ``lo``, the
    givers are those above ``lo`` and the receivers those below ``lo`` (each may take its
    deficit). Every token proposes its cheapest move ``a -> b`` from a giver it holds to a
    receiver it does not, cost ``s[i, a] - s[i, b]``; each giver accepts its cheapest proposals
    up to what it may shed, then each receiver the cheapest of those up to what it may take.
    A token moves at most once per round, so it keeps ``k`` distinct experts. An expert above
    ``hi >= load_b + 1`` holds a token that ``b`` does not (and an expert below ``lo`` lacks
    one of an expert above it), so every round moves at least one pair and the violation
    falls by at least one. This only shortens the exact phase, which repairs whatever is left
    after ``max_rounds`` (and may undo greedy moves; its certificate does not depend on them).

    Args:
        S: ``[B, n, E]`` finite scores.
        held: ``[B, n, E]`` bool b-matching (not modified).
        lo, hi: the quotas.
        max_rounds: a bound on the rounds.

    Returns:
        ``[B, n, E]`` bool, the repaired b-matching.
    """
    B, _, E = S.shape
    held = held.clone()
    inf = torch.full((), float("inf"), dtype=S.dtype, device=S.device)
    for _ in range(max_rounds):
        loads = held.sum(1)  # [B, E]
        shed = (loads > hi).any(-1, keepdim=True)  # [B, 1]: shed excess first, then fill deficits
        give = torch.where(shed, loads - hi, loads - lo).clamp(min=0)
        take = torch.where(shed, hi - loads, lo - loads).clamp(min=0)
        if not bool(((loads > hi) | (loads < lo)).any()):
            return held
        from_cost = torch.where(held & (give > 0).unsqueeze(1), S, inf)  # s[i, a] for the givers held
        to_gain = torch.where(~held & (take > 0).unsqueeze(1), S, -inf)  # s[i, b] for the receivers open
        s_a, a = from_cost.min(dim=-1)
        s_b, b = to_gain.max(dim=-1)
        cost = s_a - s_b  # [B, n]; +inf without a candidate
        inst, tok = torch.isfinite(cost).nonzero(as_tuple=True)
        a, b, c = a[inst, tok], b[inst, tok], cost[inst, tok]
        ok = rank_within_groups(inst * E + a, -c, B * E) < give[inst, a]
        inst, tok, a, b, c = inst[ok], tok[ok], a[ok], b[ok], c[ok]
        ok = rank_within_groups(inst * E + b, -c, B * E) < take[inst, b]
        inst, tok, a, b = inst[ok], tok[ok], a[ok], b[ok]
        held[inst, tok, a] = False
        held[inst, tok, b] = True
    return held
