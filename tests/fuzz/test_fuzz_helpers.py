"""Fuzz tests of the helpers the assignment and routing packages export for the layers above:
routelab.assignment's amax, argmax, log_softmax (torch's, slice by slice for few experts),
rank_within_groups, sinkhorn_balance, uses_closed_form; routelab.routing's random_ranks, random_skip,
skip_correction (eq. 3) and switch_balance (both normalisations). Oracles: torch's own
reductions, loops, and the definitions.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import routelab.assignment as A
import routelab.routing as R
from fuzz_strategies import assert_not_mutated, clone_inputs, f64, fresh, fuzz, guarded, same_bits, seeds

#: The helpers covered here (test_fuzz_assignment / test_fuzz_routing require a fuzz test for
#: every public callable of their package).
COVERED_ASSIGNMENT = {"amax", "argmax", "log_softmax", "rank_within_groups", "sinkhorn_balance", "uses_closed_form"}
COVERED_ROUTING = {"random_ranks", "random_skip", "skip_correction", "switch_balance"}


@fuzz(20)
@given(k=st.integers(1, 70), enabled=st.booleans(), B=st.integers(0, 2), seed=seeds)
def test_uses_closed_form_is_the_one_switch(k, enabled, B, seed) -> None:
    """uses_closed_form(k) is k <= 2 while the switch is on, False when it is off; either way the
    balanced assignment and Sinkhorn give the same (exact) answers as with the other setting."""
    import routelab.assignment._two_experts as two

    old = two.ENABLED
    try:
        two.ENABLED = enabled
        assert A.uses_closed_form(k) is (enabled and k <= 2)
        if k <= 3:
            g = fresh(seed)
            scores = torch.randn(B, 4 * k, k, generator=g, dtype=torch.float64)
            expert = A.balanced_assignment(scores)
            log_q = A.sinkhorn(scores.log_softmax(-1), tol=1e-9) if B else None
            two.ENABLED = not enabled
            other = A.balanced_assignment(scores)
            value = scores.gather(-1, expert.unsqueeze(-1)).sum((-2, -1))
            value_other = scores.gather(-1, other.unsqueeze(-1)).sum((-2, -1))
            torch.testing.assert_close(value, value_other, rtol=0, atol=1e-9)
            if B:
                torch.testing.assert_close(log_q.exp(), A.sinkhorn(scores.log_softmax(-1), tol=1e-9).exp(),
                                           rtol=0, atol=1e-7)
    finally:
        two.ENABLED = old


@fuzz(100)
@given(
    shape=st.sampled_from(((5, 1), (4, 2), (3, 6, 3), (7, 8), (2, 9), (0, 4), (4, 33))),
    dtype=st.sampled_from((torch.float32, torch.float64)),
    kind=st.sampled_from(("normal", "ties", "neg_inf", "huge")),
    seed=seeds,
)
def test_reductions_equal_torch(shape, dtype, kind, seed) -> None:
    """amax, argmax (first maximiser) and log_softmax equal torch's over the last dimension."""
    g = fresh(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if kind == "ties":
        x = x.round()
    elif kind == "neg_inf" and x.numel() and shape[-1] > 1:
        x[..., 0] = float("-inf")
    elif kind == "huge":
        x = x * 1e30
    before = clone_inputs(x)
    top = guarded(A.amax, x, what="amax")
    assert same_bits(top, x.amax(dim=-1)), "amax != torch.amax"
    idx = guarded(A.argmax, x, what="argmax")
    assert idx.dtype == torch.long and tuple(idx.shape) == tuple(shape[:-1])
    if x.numel():
        assert torch.equal(x.gather(-1, idx.unsqueeze(-1)).squeeze(-1), top), "argmax is not a maximiser"
        first = (x == top.unsqueeze(-1)).long().argmax(dim=-1)
        assert torch.equal(idx, first), "argmax is not the first maximiser"
    lp = guarded(A.log_softmax, x, what="log_softmax")
    assert lp.dtype == dtype and lp.shape == x.shape
    ref = torch.log_softmax(f64(x), dim=-1)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lp), finite), "log_softmax has -inf where torch's does not (or vice versa)"
    tol = 8 * torch.finfo(dtype).eps * (1 + ref[finite].abs())
    assert bool(((f64(lp)[finite] - ref[finite]).abs() <= tol).all()), "log_softmax differs from torch's"
    assert_not_mutated(before, [x])


@fuzz(100)
@given(N=st.integers(0, 40), groups=st.integers(1, 6), ties=st.booleans(), seed=seeds)
def test_rank_within_groups(N, groups, ties, seed) -> None:
    """Ranks 0..count-1 inside every group, larger priority first, ties to the earlier item."""
    g = fresh(seed)
    group = torch.randint(0, groups, (N,), generator=g)
    if ties:
        priority = torch.randint(0, 3, (N,), generator=g).double()
    else:
        priority = torch.rand(N, generator=g, dtype=torch.float64)
    rank = guarded(A.rank_within_groups, group, priority, groups, what="rank_within_groups")
    for e in range(groups):
        idx = (group == e).nonzero().flatten().tolist()
        want = sorted(idx, key=lambda i: (-float(priority[i]), i))
        got = sorted(idx, key=lambda i: int(rank[i]))
        assert got == want and sorted(int(rank[i]) for i in idx) == list(range(len(idx))), f"group {e}: ranks wrong"


@fuzz(60)
@given(B=st.integers(0, 3), n=st.integers(1, 12), k=st.integers(1, 5),
       dtype=st.sampled_from((torch.float32, torch.float64)), seed=seeds)
def test_sinkhorn_balance(B, n, k, dtype, seed) -> None:
    """Rows of the iterate sum to 1 whatever the budget; err is its largest column error; with a
    generous budget it is balanced (columns n / k)."""
    g = fresh(seed)
    log_p = torch.log_softmax(torch.randn(B, n, k, generator=g, dtype=torch.float64), -1).to(dtype)
    target = torch.full((k,), n / k, dtype=dtype)
    for max_iter, tol in ((1, 1e-12), (2000, 1e-3 * n)):
        x, err = guarded(A.sinkhorn_balance, log_p, target, tol=tol, max_iter=max_iter, what="sinkhorn_balance")
        assert x.shape == log_p.shape and x.dtype == dtype
        if B == 0:
            continue
        rows = f64(x).exp().sum(-1)
        assert torch.allclose(rows, torch.ones_like(rows), atol=1e-4 if dtype == torch.float32 else 1e-10), "rows != 1"
        cols = f64(x).exp().sum(-2)
        assert abs(float((cols - n / k).abs().amax()) - err) <= 1e-3 * max(1.0, n / k), "err is not the column error"
        if max_iter > 1:
            assert err <= tol * 1.0001, f"not balanced after {max_iter} sweeps: err {err}"


@fuzz(100)
@given(B=st.integers(0, 3), n=st.integers(0, 30), k=st.integers(1, 6), capacity=st.integers(0, 12), seed=seeds)
def test_random_skip_and_ranks(B, n, k, capacity, seed) -> None:
    """Every expert keeps min(n_z, C) of its tokens, load is n_z, the ranks are a permutation of
    0..n_z-1 within every group, and the same generator gives the same bits."""
    g = fresh(seed)
    expert = torch.randint(0, k, (B, n), generator=g)
    before = clone_inputs(expert)
    keep, load = guarded(R.random_skip, expert, k, capacity, fresh(seed + 1), what="random_skip")
    keep2, _ = R.random_skip(expert, k, capacity, fresh(seed + 1))
    assert same_bits(keep, keep2), "same generator, different keep"
    assert keep.dtype == torch.bool and load.dtype == torch.long and keep.shape == expert.shape == load.shape
    rank = guarded(R.random_ranks, expert, k, fresh(seed + 1), what="random_ranks")
    assert torch.equal(keep, rank < capacity), "random_skip does not keep the ranks below the capacity"
    for b in range(B):
        for e in range(k):
            mine = expert[b] == e
            n_z = int(mine.sum())
            assert bool((load[b][mine] == n_z).all()), "load is not n_z"
            assert int(keep[b][mine].sum()) == min(n_z, capacity), "an expert kept the wrong number of tokens"
            assert sorted(rank[b][mine].tolist()) == list(range(n_z)), "ranks are not 0..n_z-1 within an expert"
    assert_not_mutated(before, [expert])


@fuzz(60)
@given(load=st.lists(st.integers(0, 50), min_size=0, max_size=8), capacity=st.integers(0, 20),
       dtype=st.sampled_from((torch.float32, torch.float64)))
def test_skip_correction(load, capacity, dtype) -> None:
    """n_z / min(n_z, C) (eq. 3), 0 for an empty expert and n_z when C = 0."""
    t = torch.tensor(load, dtype=dtype)
    w = guarded(R.skip_correction, t, capacity, what="skip_correction")
    want = [0.0 if z == 0 else z / max(min(z, capacity), 1) for z in load]
    assert w.dtype == dtype, f"dtype {w.dtype}"
    assert torch.allclose(f64(w), torch.tensor(want, dtype=torch.float64)), f"{w.tolist()} != {want}"


@fuzz(80)
@given(B=st.integers(0, 2), n=st.integers(0, 12), E=st.integers(1, 5), scale=st.sampled_from((0.0, 1.0, 30.0)),
       seed=seeds)
def test_switch_balance(B, n, E, scale, seed) -> None:
    """E * sum_e f_e P_e with f_e the share of tokens whose argmax is e (ties: lower index, which
    scale 0 makes every token); 1 for a uniform router; the gradient reaches only P (f is detached)."""
    g = fresh(seed)
    probs = torch.softmax(scale * torch.randn(B, n, E, generator=g, dtype=torch.float64), -1).requires_grad_(True)
    loss = guarded(R.switch_balance, probs, what="switch_balance")
    assert tuple(loss.shape) == (B,)
    value = loss.detach()
    for b in range(B):
        if n == 0:
            assert float(value[b]) == 0.0
            continue
        P = probs[b].detach().tolist()
        counts = [0.0] * E
        for row in P:
            counts[max(range(E), key=lambda e: (row[e], -e))] += 1  # first maximiser
        want = E * sum(counts[e] / n * sum(r[e] for r in P) / n for e in range(E))
        assert abs(float(value[b]) - want) <= 1e-12 * max(1.0, abs(want)), f"{float(value[b])} != {want}"
    if B and n:
        loss.sum().backward()
        assert probs.grad is not None and torch.isfinite(probs.grad).all()
    uniform = torch.full((4, E), 1.0 / E, dtype=torch.float64)
    assert abs(float(R.switch_balance(uniform)) - 1.0) < 1e-12
