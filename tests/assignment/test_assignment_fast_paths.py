"""The speed-ups inside balanced_assignment, each checked against an independent truth.

The solver's exactness rests on cycle cancelling; its speed on a warm start (approximate expert
prices from damped Newton steps on an active set of tokens), on host-side small linear algebra,
on scratch buffers reused across calls and on a cheap top-two reduction. Each of those must not
change the optimum (scipy's Hungarian oracle at sizes where the fast paths engage), must agree
with its plain counterpart, and must not leak state from one call into the next.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_balanced_assignment import check_optimal, family

from routelab.assignment import _compiled, _graph, _ops, _prices, _start, _workspace, balanced_assignment
from routelab.assignment._groups import rank_within_groups, slot_table
from routelab.assignment._tuning import TUNING

HYPOTHESIS = settings(max_examples=60, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def pure_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are the PyTorch path's speed-ups: every test here runs without the compiled kernel
    (tests/assignment/test_compiled_solver.py checks that one)."""
    monkeypatch.setattr(_compiled, "ENABLED", False)


# ----------------------------------------------------------------------------- exactness where
# the active set, the shrinking and the batched (padded) paths engage


@pytest.mark.parametrize(
    ("name", "B", "n", "k", "capacity"),
    [
        ("gaussian", 1, 2048, 64, None),
        ("gaussian", 2, 1024, 16, None),  # batched: padded active sets
        ("integer_ties", 1, 1024, 16, None),
        ("large_scale", 1, 1024, 32, None),
        ("one_dominant_expert", 1, 1024, 32, None),
        ("forbidden_pairs", 1, 1024, 16, None),
        ("gaussian", 1, 1000, 16, 70),  # slack capacity: projected Newton
        ("gaussian", 3, 4096, 4, None),
    ],
)
def test_optimal_at_sizes_where_the_fast_paths_engage(
    name: str, B: int, n: int, k: int, capacity: int | None
) -> None:
    gen = torch.Generator().manual_seed(hash((name, B, n, k)) % 2**31)
    c = n // k if capacity is None else capacity
    scores = family(name, B, n, k, c, gen).to(torch.float32)
    check_optimal(scores, balanced_assignment(scores, capacity), capacity)


def test_the_active_set_is_used_and_shrinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """At n = 4096, k = 64 most steps run on a few hundred rows, not on all 4096."""
    rows: list[int] = []
    softmax = _prices._softmax

    def spy(S, u, T, X, out):
        rows.append(S.shape[1])
        return softmax(S, u, T, X, out)

    monkeypatch.setattr(_prices, "_softmax", spy)
    S = torch.randn(1, 4096, 64, generator=torch.Generator().manual_seed(0))
    _prices.approximate_prices(S, 64)
    assert rows.count(4096) <= len(rows) // 2
    assert min(rows) < 512 and sorted(rows[-3:]) == sorted(rows)[:3]  # the last steps are the smallest


# ----------------------------------------------------------------------------- prices


@pytest.mark.parametrize(("B", "n", "k", "c"), [(1, 4096, 64, 64), (3, 2048, 16, 128), (2, 1000, 16, 70)])
def test_active_set_prices_equal_full_step_prices(B: int, n: int, k: int, c: int) -> None:
    """Frozen tokens are saturated to exp(-SATURATED_GAP): the prices barely differ."""
    S = torch.randn(B, n, k, generator=torch.Generator().manual_seed(n + k), dtype=torch.float64)
    fast = _prices.approximate_prices(S, c)
    full = _prices.approximate_prices(S, c, tuning=replace(TUNING, active_set=False))
    final_T = S.std() * _prices.default_schedule(n)[-1]
    assert (fast - full).abs().max() <= 2 * final_T


def test_prices_place_nearly_every_token() -> None:
    """What the prices are for: the best expert under them is the optimal one for almost all."""
    n, k = 4096, 64
    S = torch.randn(1, n, k, generator=torch.Generator().manual_seed(5))
    prices = _prices.approximate_prices(S, n // k)
    start = (S - prices.unsqueeze(1)).argmax(-1).view(-1)
    optimum = balanced_assignment(S[0])
    assert (start != optimum).sum() <= n // 100


def _random_newton_inputs(B: int, k: int, slack: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(B, 300, k, generator=gen) * 3, dim=-1)
    col, G = P.sum(1), P.transpose(1, 2) @ P
    grad = torch.randn(B, k, generator=gen) * 3
    T = (torch.rand(B, generator=gen) * 0.1 + 1e-3).double().numpy()
    prices = None
    if slack:  # some experts at price 0: those with a positive gradient stay there
        prices = (torch.rand(B, k, generator=gen) * (torch.rand(B, k, generator=gen) > 0.3)).double().numpy()
    return col, G, grad, T, prices


def reference_newton_step(col, G, grad, T, c, prices, step_limit):
    """The documented damped Newton step, built and solved plainly with numpy.linalg (float64)."""
    col, G, grad = (x.double().numpy() for x in (col, G, grad))
    B, k = col.shape
    out = np.empty((B, k))
    for b in range(B):
        rho = np.mean(col[b] - np.diag(G[b])) + 1e-3 * c
        rhs = grad[b] * T[b]
        if prices is None:
            A = np.diag(col[b] + 1e-6 * rho) - G[b] + rho / k
        else:
            keep = ~((prices[b] <= 0) & (grad[b] > 0))
            rhs = np.where(keep, rhs, 0.0)
            A = -G[b] * np.outer(keep, keep) + np.diag(
                np.where(keep, col[b], 0.0) + np.where(keep, 1e-6, 1.0 + 1e-6) * rho
            )
        x = np.linalg.solve(A, rhs)
        out[b] = x * min(1.0, step_limit * T[b] / max(np.abs(x).max(), 1e-30))
    return out


@pytest.mark.parametrize("slack", [False, True])
@pytest.mark.parametrize("B", [1, 4])
def test_newton_step_equals_the_plain_numpy_step(B: int, slack: bool) -> None:
    """The LAPACK step in place (no copies) is the documented system solved plainly."""
    for seed in range(5):
        col, G, grad, T, prices = _random_newton_inputs(B, 16, slack, seed)
        host, host_clipped = _prices._damped_newton_step(col, G, grad, T, 20, prices, TUNING.step_limit)
        ref = reference_newton_step(col, G, grad, T, 20, prices, TUNING.step_limit)
        np.testing.assert_allclose(host, ref, rtol=1e-6, atol=1e-9)
        if slack:  # experts at price 0 with a positive gradient do not move
            held = (prices <= 0) & (grad.numpy() > 0)
            assert held.any() and (host[held] == 0).all()


def test_newton_step_is_clipped_to_the_step_limit() -> None:
    col, G, grad, T, _ = _random_newton_inputs(2, 8, False, 0)
    step, clipped = _prices._damped_newton_step(col, G, grad * 1e6, T, 20, None, TUNING.step_limit)
    assert clipped
    np.testing.assert_allclose(np.abs(step).max(-1), TUNING.step_limit * T, rtol=1e-9)


def test_singular_hessian_falls_back_to_the_diagonal_step() -> None:
    """All-zero Gram matrix and column sums with c = 0 make the ridge 0 and the system singular:
    Cholesky fails and the step must still be finite (the diagonal fallback)."""
    k = 4
    col, G = torch.zeros(1, k), torch.zeros(1, k, k)
    grad, T = torch.ones(1, k), np.ones(1)
    step, _ = _prices._damped_newton_step(col, G, grad, T, 0, None, TUNING.step_limit)
    assert np.isfinite(step).all()


def test_default_schedule() -> None:
    for n in (1, 2, 64, 256, 1024, 4095, 4096, 16384, 1 << 20):
        levels = _prices.default_schedule(n)
        assert all(a / b == pytest.approx(TUNING.cooling) for a, b in zip(levels, levels[1:]))
        assert levels[-1] < TUNING.final_temperature_n / n  # cold enough for n tokens ...
        assert len(levels) == 1 or levels[-2] >= TUNING.final_temperature_n / n  # ... and no colder
        first = TUNING.first_temperature / (TUNING.cooling if n >= TUNING.large_n else 1.0)
        assert levels[0] == pytest.approx(first)


# ----------------------------------------------------------------------------- top two


@st.composite
def rows(draw):
    r = draw(st.integers(1, 40))
    k = draw(st.integers(1, 70))
    kind = draw(st.sampled_from(["ties", "gaussian", "near_float_range", "excluded"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":
        return torch.randint(-2, 3, (r, k), generator=gen).float()
    x = torch.randn(r, k, generator=gen)
    if kind == "excluded":  # -inf for full experts, as in the later proposal rounds
        excluded = torch.rand(r, k, generator=gen) < 0.5
        excluded[:, 0] = False
        return x.masked_fill(excluded, float("-inf"))
    return x * 10 if kind == "gaussian" else (x.clamp(-3, 3) * 1e38)


@HYPOTHESIS
@given(rows())
def test_top_two_matches_sorting(x: torch.Tensor) -> None:
    first, index, second = _ops.top_two(x, torch.empty_like(x))
    ordered = x.sort(dim=-1, descending=True).values
    assert torch.equal(first, ordered[:, 0])
    assert torch.equal(index, x.argmax(dim=-1))  # the first maximiser, as argmax
    expected_second = ordered[:, 1] if x.shape[1] > 1 else torch.full_like(first, float("-inf"))
    assert torch.equal(second, expected_second)


# ----------------------------------------------------------------------------- scratch buffers


def test_scratch_reuses_and_grows() -> None:
    _workspace.clear()
    a = _workspace.scratch("test", (4, 8), torch.float32, torch.device("cpu"))
    b = _workspace.scratch("test", (2, 8), torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr()  # the same memory, call after call
    c = _workspace.scratch("test", (64, 64), torch.float32, torch.device("cpu"))
    assert c.shape == (64, 64)
    other = _workspace.scratch("other", (4, 8), torch.float32, torch.device("cpu"))
    assert other.data_ptr() != c.data_ptr()
    _workspace.clear()


def test_huge_requests_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_workspace, "MAX_CACHED_BYTES", 1024)
    a = _workspace.scratch("huge", (1024,), torch.float32, torch.device("cpu"))
    b = _workspace.scratch("huge", (1024,), torch.float32, torch.device("cpu"))
    assert a.data_ptr() != b.data_ptr()  # two plain allocations, nothing kept
    assert ("huge", torch.float32) not in _workspace._local.slots
    from routelab.assignment import clear_scratch

    clear_scratch()
    assert balanced_assignment(torch.randn(2048, 64)).shape == (2048,)  # works with nothing kept


def test_results_do_not_alias_scratch_memory() -> None:
    gen = torch.Generator().manual_seed(3)
    first_scores = torch.randn(2048, 64, generator=gen)
    first = balanced_assignment(first_scores)
    kept = first.clone()
    balanced_assignment(torch.randn(2048, 64, generator=gen))
    assert torch.equal(first, kept)
    assert torch.equal(first, balanced_assignment(first_scores))  # and the same seed, same answer


def test_calls_inside_and_outside_inference_mode_mix() -> None:
    """A scratch buffer made under inference mode must still be writable outside it, and results
    must be usable by autograd (e.g. as gather indices)."""
    _workspace.clear()
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        balanced_assignment(torch.randn(1024, 16, generator=gen))
    logits = torch.randn(1024, 16, generator=gen, requires_grad=True)
    z = balanced_assignment(logits.detach())
    assert not z.is_inference()
    logits.gather(-1, z.unsqueeze(-1)).sum().backward()
    assert logits.grad is not None and logits.grad.sum() == 1024


def test_threads_have_their_own_scratch() -> None:
    import threading

    gen = torch.Generator().manual_seed(6)
    instances = [torch.randn(1024, 16, generator=gen) for _ in range(4)]
    expected = [balanced_assignment(s) for s in instances]
    got: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = balanced_assignment(instances[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert torch.equal(got[i], expected[i])


def test_initial_assignment_is_feasible_and_greedy() -> None:
    """The start respects the capacity and keeps every token whose best expert had room."""
    gen = torch.Generator().manual_seed(8)
    S = torch.randn(2, 512, 16, generator=gen)
    c = 32
    z = _start.initial_assignment(S, c)
    counts = torch.zeros(2, 16, dtype=torch.long).scatter_add_(1, z, torch.ones_like(z))
    assert (counts <= c).all() and (z >= 0).all()
    best = S.argmax(-1)
    proposals = torch.zeros(2, 16, dtype=torch.long).scatter_add_(1, best, torch.ones_like(best))
    uncontested = proposals.gather(1, best) <= c
    assert torch.equal(z[uncontested], best[uncontested])
    assert np.all((z == best).float().mean(-1).numpy() > 0.5)


def test_tied_best_experts_are_spread_in_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """All-equal scores: every expert is a best one for every token; the start spreads the tokens
    over them at once (taking the first maximiser would fill expert 0, then 1, ... in k rounds)."""
    n, k = 1024, 64
    rounds = []
    rank = rank_within_groups

    def spy(*args):
        rounds.append(1)
        return rank(*args)

    monkeypatch.setattr(_start, "rank_within_groups", spy)
    S = torch.zeros(1, n, k)
    z = _start.initial_assignment(S, n // k)
    assert torch.equal(torch.bincount(z.view(-1), minlength=k), torch.full((k,), n // k))
    assert len(rounds) == 0  # no expert was over-subscribed
    check_optimal(S[0], balanced_assignment(S[0]))


def test_move_arcs_without_slot_tables_equal_the_slot_table_arcs() -> None:
    """The segmented minimum the first search uses is exactly the per-slot table's minimum,
    including experts without tokens and over-full experts."""
    gen = torch.Generator().manual_seed(12)
    B, n, k, c = 3, 200, 9, 30
    S = torch.randn(B, n, k, generator=gen)
    z = torch.randint(0, k - 1, (B, n), generator=gen)  # expert k - 1 stays empty
    z[0, :40] = 0  # expert 0 of instance 0 over-full
    counts = torch.zeros(B, k, dtype=torch.long).scatter_add_(1, z, torch.ones_like(z))
    holder, counts = slot_table(z, k, max(c, int(counts.max())))
    _, expected, _ = _graph.expert_graph(S, holder, counts, c)
    got = _graph.move_arcs(S, z)
    assert torch.equal(got, expected)
    assert torch.isinf(got[:, k - 1]).all()


def test_rank_within_groups_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="group must be an integer tensor"):
        rank_within_groups(torch.tensor([0.0, 1.0]), None, 2)
    with pytest.raises(ValueError, match=r"group must be 1-D \[N\]"):
        rank_within_groups(torch.zeros(2, 2, dtype=torch.long), None, 2)
    with pytest.raises(ValueError, match="priority must be None or a tensor of group's shape"):
        rank_within_groups(torch.tensor([0, 1]), torch.zeros(3), 2)
    with pytest.raises(ValueError, match="num_groups must be an integer >= 1"):
        rank_within_groups(torch.tensor([0, 1]), None, 0)
    assert rank_within_groups(torch.tensor([1, 0, 1], dtype=torch.int32), None, 2).tolist() == [0, 0, 1]


# ----------------------------------------------------------------------------- host syncs of the PyTorch path


def test_the_price_steps_copy_to_the_host_once_each() -> None:
    """On a GPU every copy to the host is a synchronisation: the Newton steps make one each (the
    ``k x k`` system is solved on the host), plus one for the starting prices and spreads."""
    from host_syncs import record_host_syncs
    from routelab.assignment._prices import approximate_prices

    S = torch.randn(4, 512, 16, generator=torch.Generator().manual_seed(0))
    for steps in (1, 3, 5):
        with record_host_syncs() as found:
            approximate_prices(S, 32, schedule=(0.3, 0.06, 0.012, 0.0024, 0.0005), max_steps=steps)
        # (.cpu().numpy() is one copy: the numpy view of a host tensor reads no device)
        syncs = [f for f in found if f.op != "Tensor.numpy"]
        copies = [f for f in syncs if f.op == "Tensor.cpu"]
        assert len(copies) == steps + 1, [str(f) for f in found]
        # the prices and temperatures go back to the device without a blocking copy (on CUDA each
        # would wait for the stream: 25 of the bench's 151 syncs a call at 64 x 4096 x 64 did)
        assert not [f for f in syncs if "host data" in f.op], [str(f) for f in syncs]
        # the rest: the active set's size when a step freezes rows, at most once a step
        assert len(syncs) - len(copies) <= steps, [str(f) for f in syncs]


def test_a_bellman_ford_check_synchronises_once() -> None:
    """``find_negative_cycles`` tests on the host only whether any instance still runs, once per check."""
    from host_syncs import record_host_syncs
    from routelab.assignment._cycles import find_negative_cycles
    from routelab.assignment._tuning import TUNING

    gen = torch.Generator().manual_seed(1)
    B, m = 6, 8
    arc = torch.rand(B, m, m, generator=gen, dtype=torch.float64) - 0.3  # negative cycles in most instances
    arc.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    tol = torch.full((B, 1), 1e-12, dtype=torch.float64)
    running = torch.ones(B, dtype=torch.bool)
    with record_host_syncs() as found:
        optimal, cycle_nodes, _, _ = find_negative_cycles(arc, tol, running, torch.zeros(B, m, dtype=torch.float64))
    assert bool((optimal | cycle_nodes.any(-1)).all())  # every instance ended one way or the other
    sweeps = 2 * m + 4 + 6
    assert 1 <= len(found) <= sweeps // TUNING.check_every + 1, [str(f) for f in found]
    assert len({f.where for f in found}) == 1, [str(f) for f in found]  # the one test, once per check


@pytest.mark.parametrize(("m", "shift"), [(8, 0.3), (8, 0.0), (64, 0.02), (64, 0.0)])
def test_a_bellman_ford_search_keeps_its_launch_budget(m: int, shift: float) -> None:
    """On a GPU the PyTorch path's time is set by its operator launches (about 20 us each on the
    H200, against a few bytes per operator), so ``find_negative_cycles`` has a budget: a sweep is 6
    operators (the relaxation's 2, then the test, the labels and the predecessors in place), a
    check every ``check_every`` sweeps at most 30 (the predecessor cycles' pointer doubling
    included), plus 10 to set up. The version of 2026-11-26 (8 a sweep, about 45 a check) made the
    64 x 4096 x 64 benchmark 72 -> 94 ms; views are not counted (they launch nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from routelab.assignment import _cycles
    from routelab.assignment._tuning import TUNING

    class Launches(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            free = (torch.ops.aten.resolve_conj.default, torch.ops.aten.resolve_neg.default)  # (no-ops)
            if not func.is_view and func not in free:
                Launches.count += 1
            return func(*args, **(kwargs or {}))

    sweeps = 0
    relax = _cycles.relax

    def counted(*args):  # noqa: ANN202
        nonlocal sweeps
        sweeps += 1
        return relax(*args)

    gen = torch.Generator().manual_seed(1)
    B = 4
    arc = torch.rand(B, m, m, generator=gen, dtype=torch.float64) - shift  # shift > 0: negative cycles
    arc.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    tol = torch.full((B, 1), 1e-12, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cycles, "relax", counted)
        with Launches():
            optimal, cycle_nodes, _, _ = _cycles.find_negative_cycles(
                arc, tol, torch.ones(B, dtype=torch.bool), torch.zeros(B, m, dtype=torch.float64))
    assert bool((optimal | cycle_nodes.any(-1)).all())
    assert bool(cycle_nodes.any()) == (shift > 0)
    checks = sweeps // TUNING.check_every
    assert Launches.count <= 6 * sweeps + 30 * checks + 10, (Launches.count, sweeps, checks)


@pytest.mark.parametrize("rank_one", [False, True])
def test_a_cancelling_round_synchronises_three_times_outside_bellman_ford(rank_one: bool) -> None:
    """Outside its Bellman-Ford searches, a round of cycle cancelling reads the host three times:
    the cycles' nodes (``nonzero``), the number of single-unit arcs and of unit moves together, and
    the experts to refresh (``unique``); plus the loop's own test per round. Boolean indexing of
    the arcs (a ``nonzero`` per tensor indexed) cost 151 syncs per call at 64 x 4096 x 64 on the
    PyTorch path, now 106 (counted by this recorder). Rank-one scores make multi-unit cycles."""
    from host_syncs import record_host_syncs
    from routelab.assignment import _cycles

    gen = torch.Generator().manual_seed(3)
    B, n, k = 4, 512, 16
    S = torch.randn(B, n, k, generator=gen)
    if rank_one:
        S = torch.randn(B, n, 1, generator=gen) * torch.randn(B, 1, k, generator=gen)
    z = S.argmax(-1)  # over capacity: cycles through release arcs as well as of moves alone
    searches = []
    original = _cycles.find_negative_cycles

    def counted(*args, **kwargs):  # noqa: ANN202
        with record_host_syncs() as inner:
            out = original(*args, **kwargs)
        searches.append(len(inner))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cycles, "find_negative_cycles", counted)
        with record_host_syncs() as found:
            z_opt, _, rounds = _cycles.cancel_negative_cycles(S, z, n // k)
    assert rounds >= 2
    outside = len(found) - sum(searches)
    # the scale's and tolerances' reads before the loop: at most 2
    assert outside <= 4 * rounds + 1 + 2, [str(f) for f in found]
    counts = torch.zeros(B, k, dtype=torch.long).scatter_add_(-1, z_opt, torch.ones_like(z_opt))
    assert bool((counts <= n // k).all())


@pytest.mark.parametrize("m", [1, 5, 33])
def test_floyd_warshall_equals_scipys(m: int) -> None:
    """The in-place Floyd-Warshall (one scratch tensor, not a fresh pair per step) against scipy's,
    on batched graphs with missing arcs (+inf) and negative arcs without negative cycles (arc
    costs ``c[a, b] = w[a, b] + p[a] - p[b]`` with ``w >= 0``: potentials keep every cycle >= 0)."""
    from scipy.sparse.csgraph import floyd_warshall as scipy_floyd_warshall

    from routelab.assignment.shortest_paths import floyd_warshall

    g = torch.Generator().manual_seed(m)
    w = torch.rand(3, m, m, generator=g, dtype=torch.float64)
    p = torch.randn(3, m, generator=g, dtype=torch.float64) * 3
    cost = w + p.unsqueeze(-1) - p.unsqueeze(-2)
    cost = cost.masked_fill(torch.rand(3, m, m, generator=g) < 0.5, float("inf"))
    got = floyd_warshall(cost)
    for b in range(3):
        dense = cost[b].clone()
        dense.fill_diagonal_(0.0)
        want = scipy_floyd_warshall(dense.numpy(), directed=True)  # inf: no arc
        torch.testing.assert_close(got[b], torch.from_numpy(want), rtol=0, atol=1e-12)


def test_structured_scores_need_few_cancelling_rounds() -> None:
    """The PyTorch path (GPU-sized problems) on rank-one scores: a review measured ~1450 rounds at
    16384 x 64, one token per cycle arc per round. A cycle of move arcs is now cancelled as many
    times as it stays negative. Oracle: for ``s = u v^T`` (supermodular) the monotone coupling is
    optimal, tokens sorted by ``u`` filling experts sorted by ``v`` in blocks of the capacity (the
    rearrangement inequality); the rounds stay few (measured at 4096 x 64: 27, where one unit per
    round took 498)."""
    from routelab.assignment.balanced import solve_balanced

    rng = np.random.default_rng(1)
    n, E = 4096, 64
    u, v = rng.normal(size=n), rng.normal(size=E)
    scores = torch.from_numpy(np.outer(u, v))
    solution = solve_balanced(scores, on_host=False)
    z = solution.expert.view(n).numpy()
    assert (np.bincount(z, minlength=E) == n // E).all()
    best = float((np.sort(u).reshape(E, n // E).sum(-1) * np.sort(v)).sum())
    got = float(np.outer(u, v)[np.arange(n), z].sum())
    assert got >= best - 1e-9 * np.abs(np.outer(u, v)).sum() and got <= best + 1e-9 * abs(best)
    assert solution.rounds <= 60, solution.rounds


def test_forbidden_pairs_with_tied_rows_are_exact_on_the_pytorch_path() -> None:
    """The same review case for k = 1 on the PyTorch path (8 of 4000 feasible instances raised
    'cycle cancelling did not terminate'). Oracle: scipy's assignment on the expanded cost."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n, E = int(rng.integers(4, 40)), int(rng.integers(2, 8))
        c = -(-n // E) + int(rng.integers(0, 2))
        s = np.tile(rng.random(E), (n, 1))
        s[rng.random((n, E)) < 0.2] += 1
        forbid = rng.random((n, E)) < 0.15
        forbid[np.arange(n), rng.integers(0, E, n)] = False
        s[forbid] = -np.inf
        scores = torch.from_numpy(s)
        try:
            z = balanced_assignment(scores, c)
        except ValueError:
            from scipy.optimize import linear_sum_assignment

            expanded = np.repeat(s, c, 1)
            rows, cols = linear_sum_assignment(np.where(np.isfinite(expanded), -expanded, 1e9))
            assert np.where(np.isfinite(expanded), -expanded, 1e9)[rows, cols].max() >= 1e8  # truly infeasible
            continue
        check_optimal(scores, z, c)
