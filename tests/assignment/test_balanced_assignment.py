"""Tests for routelab.assignment.balanced_assignment (Kool et al. 2021, eq. 4 and App. D.2).

Every optimality check compares the objective sum_i scores[i, z_i] with an independent oracle:
scipy's Hungarian solver (``linear_sum_assignment``) on the n x (k * c) matrix in which every
expert column is repeated ``c`` times (one column per slot). Objectives are compared, not
assignments, because the optimum need not be unique. Only the public API is used.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from routelab.assignment import balanced_assignment

NEG_INF = float("-inf")
DTYPES = [torch.float32, torch.float64]
# Tolerance of the objective, relative to n * max|score| (the scale of the objective).

HYPOTHESIS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


# ----------------------------------------------------------------------------- oracle


def score_spread(scores: np.ndarray) -> float:
    """``max_i (max_j s_ij - min_j s_ij)`` over the finite entries of an ``[n, k]`` instance."""
    finite = np.isfinite(scores)
    hi = np.where(finite, scores, -np.inf).max(-1)
    lo = np.where(finite, scores, np.inf).min(-1)
    rows = np.isfinite(hi)
    return float((hi[rows] - lo[rows]).max()) if rows.any() else 0.0


def exactness_tol(scores: np.ndarray, dtype: torch.dtype) -> float:
    """``n (k + 1) 8 eps(dtype) spread``: the rounding the balanced-assignment solver may leave,
    plus the float64 rounding of summing ``n`` scores for the objective."""
    n, k = scores.shape
    finite = scores[np.isfinite(scores)]
    summation = 2 * n * float(np.finfo(np.float64).eps) * (float(np.abs(finite).max()) if finite.size else 0.0)
    return n * (k + 1) * 8 * float(torch.finfo(dtype).eps) * score_spread(scores) + summation


def _np64(x: torch.Tensor) -> np.ndarray:
    """The exact values of ``x`` (float32 or float64) as a float64 numpy array."""
    return x.detach().cpu().to(torch.float64).numpy()


def oracle(scores: np.ndarray, capacity: int | None) -> tuple[float, bool]:
    """``(optimal value, feasible)`` of one ``[n, k]`` instance, by the Hungarian algorithm.

    ``-inf`` is replaced by ``-big`` with ``big`` so large that an assignment using one forbidden
    pair is worse than every assignment using none; the instance is feasible iff the optimum of
    the finite problem avoids all forbidden pairs.
    """
    n, k = scores.shape
    c = n // k if capacity is None else min(capacity, n)
    forbidden = np.isneginf(scores)
    finite = scores[~forbidden]
    m = float(np.abs(finite).max()) if finite.size else 0.0
    big = 4.0 * (n + 1) * (m + 1.0)  # (n-1) m - big < -n m <= value of any feasible assignment
    slots = np.repeat(np.where(forbidden, -big, scores), c, axis=1)  # [n, k * c]
    rows, cols = linear_sum_assignment(slots, maximize=True)
    z = np.empty(n, dtype=np.int64)
    z[rows] = cols // c
    if forbidden[np.arange(n), z].any():
        return NEG_INF, False
    return float(scores[np.arange(n), z].sum()), True


def objective(scores: np.ndarray, z: np.ndarray) -> float:
    return float(scores[np.arange(scores.shape[0]), z].sum())


def objective_tol(scores: np.ndarray, dtype: torch.dtype) -> float:
    """What "exact" promises: ``n (k + 1) 8 eps`` times the score *spread* (the largest row's
    max minus min over finite entries), independent of any offset or magnitude."""
    return exactness_tol(scores, dtype)


def check_optimal(scores: torch.Tensor, z: torch.Tensor, capacity: int | None = None) -> None:
    """``z`` is a feasible assignment whose objective equals the oracle's, for every instance."""
    n, k = scores.shape[-2:]
    assert z.dtype == torch.long
    assert z.shape == scores.shape[:-1]
    assert z.device == scores.device
    c = n // k if capacity is None else min(capacity, n)
    S = _np64(scores).reshape(-1, n, k)
    Z = z.detach().cpu().numpy().reshape(-1, n)
    for b in range(S.shape[0]):
        s, zb = S[b], Z[b]
        assert ((zb >= 0) & (zb < k)).all(), f"instance {b}: expert out of range {zb}"
        counts = np.bincount(zb, minlength=k)
        assert counts.max() <= c, f"instance {b}: capacity {c} exceeded, counts {counts}"
        assert not np.isneginf(s[np.arange(n), zb]).any(), f"instance {b}: a -inf pair was assigned"
        best, feasible = oracle(s, capacity)
        assert feasible
        got = objective(s, zb)
        tol = objective_tol(s, scores.dtype)
        assert abs(best - got) <= tol, (
            f"instance {b} ({scores.dtype}, n={n}, k={k}, c={c}): objective {got!r} vs optimum {best!r} "
            f"(gap {best - got:.3g}, tol {tol:.3g})"
        )


# ----------------------------------------------------------------------------- instance families


def hidden_feasible_mask(B: int, n: int, k: int, c: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """``[B, n, k]`` random forbidden pattern that keeps a random feasible assignment allowed."""
    mask = torch.rand(B, n, k, generator=gen) < density
    slots = torch.arange(k).repeat_interleave(c)  # k * c slots, expert of each slot
    for b in range(B):
        z0 = slots[torch.randperm(k * c, generator=gen)[:n]]
        mask[b, torch.arange(n), z0] = False
    return mask


def family(name: str, B: int, n: int, k: int, c: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, n, k]`` float64 scores of a named family."""
    if name == "gaussian":
        return torch.randn(B, n, k, generator=gen, dtype=torch.float64)
    if name == "integer_ties":
        return torch.randint(-2, 3, (B, n, k), generator=gen).to(torch.float64)
    if name == "large_scale":
        return torch.randn(B, n, k, generator=gen, dtype=torch.float64) * 1e4
    if name == "tiny_scale":
        return torch.randn(B, n, k, generator=gen, dtype=torch.float64) * 1e-4
    if name == "one_dominant_expert":
        s = torch.randn(B, n, k, generator=gen, dtype=torch.float64)
        s[..., 0] += 100.0
        return s
    if name == "forbidden_pairs":
        s = torch.randn(B, n, k, generator=gen, dtype=torch.float64)
        return s.masked_fill(hidden_feasible_mask(B, n, k, c, 0.5, gen), NEG_INF)
    if name == "forbidden_integer_ties":
        s = torch.randint(-2, 3, (B, n, k), generator=gen).to(torch.float64)
        return s.masked_fill(hidden_feasible_mask(B, n, k, c, 0.4, gen), NEG_INF)
    raise AssertionError(name)


# (n, k, capacity): balanced, slack, capacity >= n, k = 1, n = k, n = 1, k > n
SHAPES = [
    (12, 3, None),
    (24, 4, None),
    (30, 5, None),
    (16, 8, None),
    (10, 3, 4),  # n not divisible by k: capacity ceil(n/k)
    (12, 4, 5),  # slack
    (9, 3, 9),  # capacity == n
    (7, 3, 100),  # capacity larger than the number of tokens
    (6, 1, None),  # k = 1
    (5, 5, None),  # n = k: linear assignment (permutation)
    (1, 4, 1),  # n = 1: argmax
    (2, 5, 1),  # k > n
]
FAMILIES = [
    "gaussian",
    "integer_ties",
    "large_scale",
    "tiny_scale",
    "one_dominant_expert",
    "forbidden_pairs",
    "forbidden_integer_ties",
]

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "name",
    [pytest.param(f, id=f) for f in FAMILIES],
)
def test_objective_matches_hungarian_oracle(name: str, dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    gen = torch.Generator().manual_seed(1000 + FAMILIES.index(name) * 10 + DTYPES.index(dtype))
    for n, k, cap in SHAPES:
        c = n // k if cap is None else min(cap, n)
        B = 1 if n == 1 else 25
        scores = family(name, B, n, k, c, gen).to(dtype)
        z = balanced_assignment(scores, capacity=cap)
        check_optimal(scores, z, cap)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        pytest.param(torch.float32, 1e-7, id="float32"),
        pytest.param(torch.float64, 1e-16, id="float64"),
    ],
)
def test_optimum_is_scale_invariant_for_tiny_scores(dtype: torch.dtype, scale: float) -> None:
    """Integer matrices M (exact optimum known) solved as M * scale: the maximiser of a positively
    rescaled problem is the same, so its value on M must be M's optimum."""
    M = torch.randint(0, 10, (500, 8, 4), generator=torch.Generator().manual_seed(1)).to(dtype)
    z_unit = balanced_assignment(M)
    z_tiny = balanced_assignment(M * scale)
    S = _np64(M)
    for b in range(500):
        best, _ = oracle(S[b], None)
        assert objective(S[b], z_unit[b].numpy()) == best  # scale 1 is fine
        assert objective(S[b], z_tiny[b].numpy()) == best, f"instance {b}: {M[b].int().tolist()}"


def test_many_instances_one_call() -> None:
    """Hundreds of mixed instances solved in one batched call."""
    gen = torch.Generator().manual_seed(7)
    n, k = 20, 4
    s = torch.randn(400, n, k, generator=gen, dtype=torch.float64)
    s[:100] = torch.randint(0, 3, (100, n, k), generator=gen).to(torch.float64)  # ties
    s[100:200] *= 1e3
    s[200:300] = s[200:300].masked_fill(hidden_feasible_mask(100, n, k, n // k, 0.6, gen), NEG_INF)
    check_optimal(s, balanced_assignment(s))


# ----------------------------------------------------------------------------- structure of the solution


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k_equals_one_assigns_everything_to_expert_zero(dtype: torch.dtype) -> None:
    s = torch.randn(3, 7, 1, generator=torch.Generator().manual_seed(1), dtype=dtype)
    assert torch.equal(balanced_assignment(s), torch.zeros(3, 7, dtype=torch.long))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_token_takes_its_argmax(dtype: torch.dtype) -> None:
    s = torch.randn(50, 1, 6, generator=torch.Generator().manual_seed(2), dtype=dtype)
    assert torch.equal(balanced_assignment(s, capacity=1), s.argmax(-1))
    assert torch.equal(balanced_assignment(s, capacity=3), s.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_n_equals_k_is_a_permutation(dtype: torch.dtype) -> None:
    s = torch.randn(40, 6, 6, generator=torch.Generator().manual_seed(3), dtype=dtype)
    z = balanced_assignment(s)
    assert torch.equal(z.sort(-1).values, torch.arange(6).expand(40, 6))
    check_optimal(s, z)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unconstrained_capacity_is_the_row_argmax(dtype: torch.dtype) -> None:
    """With capacity >= n the constraint is void: the optimum is each token's argmax."""
    s = torch.randn(30, 9, 4, generator=torch.Generator().manual_seed(4), dtype=dtype)
    for cap in (9, 50):
        assert torch.equal(balanced_assignment(s, capacity=cap), s.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), [(2, 2), (3, 3), (4, 2), (12, 4), (30, 6)])
def test_already_balanced_argmax_is_returned(n: int, k: int, dtype: torch.dtype) -> None:
    """Each token has a clear favourite and the favourites respect the capacity: the optimum is the
    row argmax (clear preferences saturate any softmax-based warm start)."""
    gen = torch.Generator().manual_seed(n * k)
    fav = torch.stack([torch.arange(n) % k for _ in range(10)])
    fav = fav.gather(1, torch.stack([torch.randperm(n, generator=gen) for _ in range(10)]))
    s = torch.nn.functional.one_hot(fav, k).to(dtype) * 10 + torch.rand(10, n, k, generator=gen, dtype=dtype)
    assert torch.equal(balanced_assignment(s), fav)
    assert torch.equal(balanced_assignment(torch.nn.functional.one_hot(fav, k).to(dtype)), fav)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_equal_scores_fill_every_expert_exactly(dtype: torch.dtype) -> None:
    s = torch.full((4, 12, 3), 0.25, dtype=dtype)
    z = balanced_assignment(s)
    assert torch.equal(torch.nn.functional.one_hot(z, 3).sum(-2), torch.full((4, 3), 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dominant_expert_gets_exactly_capacity_best_tokens(dtype: torch.dtype) -> None:
    """Everyone prefers expert 0 by far; it takes exactly c tokens, those that lose most elsewhere."""
    gen = torch.Generator().manual_seed(5)
    n, k = 12, 3
    s = torch.randn(20, n, k, generator=gen, dtype=dtype)
    s[..., 0] += 100.0
    z = balanced_assignment(s)
    assert ((z == 0).sum(-1) == n // k).all()
    check_optimal(s, z)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_balance_when_capacity_is_n_over_k(dtype: torch.dtype) -> None:
    """With c = n/k every slot is used: each expert gets exactly n/k tokens."""
    s = torch.randn(50, 15, 5, generator=torch.Generator().manual_seed(6), dtype=dtype)
    counts = torch.nn.functional.one_hot(balanced_assignment(s), 5).sum(-2)
    assert (counts == 3).all()


# ----------------------------------------------------------------------------- forbidden pairs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forced_assignment_by_forbidden_pairs(dtype: torch.dtype) -> None:
    """Only one feasible assignment exists: it must be found even against strong scores."""
    s = torch.tensor(
        [[100.0, NEG_INF, NEG_INF], [NEG_INF, -50.0, 100.0], [NEG_INF, NEG_INF, 3.0]], dtype=dtype
    )
    assert balanced_assignment(s).tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("scores", "capacity"),
    [
        pytest.param([[0.0, NEG_INF], [1.0, NEG_INF], [2.0, NEG_INF]], 2, id="3-tokens-only-on-expert-0-capacity-2"),
        pytest.param([[0.0, 1.0], [NEG_INF, NEG_INF]], None, id="token-with-all-minus-inf"),
        pytest.param(
            [[0.0, NEG_INF, NEG_INF]] * 3 + [[1.0, 2.0, 3.0]] * 3, None, id="hall-violation-3-on-1-expert-c2"
        ),
        pytest.param([[NEG_INF] * 3] * 3, None, id="all-minus-inf"),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_infeasible_forbidden_pattern_raises(scores: list, capacity: int | None, dtype: torch.dtype) -> None:
    s = torch.tensor(scores, dtype=dtype)
    assert not oracle(_np64(s), capacity)[1]  # the oracle agrees it is infeasible
    with pytest.raises(ValueError, match="no feasible assignment"):
        balanced_assignment(s, capacity=capacity)


def test_one_infeasible_instance_in_a_batch_raises() -> None:
    s = torch.randn(5, 4, 2, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    s[3, :3, 1] = NEG_INF  # three tokens on expert 0 with capacity 2
    with pytest.raises(ValueError, match="no feasible assignment"):
        balanced_assignment(s)


def test_an_infeasible_pattern_at_scale_is_refused_before_the_solve() -> None:
    """Review: 2048 tokens allowed only on 4 of 8 experts of capacity 511 (2044 places) took the
    compiled solver ~50 s (its auction raises the allowed experts' prices to the penalty in epsilon
    steps; minutes at 4096) before the right error; the max-flow check refuses it before the solve,
    naming the deficient set (the oracle: 2048 tokens, 4 x 511 places)."""
    n, k, c = 2048, 8, 511
    s = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    s[:, k // 2:] = NEG_INF
    with pytest.raises(ValueError, match=rf"no feasible assignment with capacity {c} \(batch instance 0\): "
                                         rf"{n} tokens are allowed only on 4 experts, which hold {4 * c}"):
        balanced_assignment(s, capacity=c)
    s[:4, k // 2:] = 0.0  # four tokens may go elsewhere: feasible, and exact
    check_optimal(s, balanced_assignment(s, capacity=c), c)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("scores", "capacity", "match"),
    [
        pytest.param(torch.tensor([[0.0, float("nan")], [1.0, 2.0]]), None, "NaN", id="nan"),
        pytest.param(torch.tensor([[0.0, float("inf")], [1.0, 2.0]]), None, r"\+inf", id="plus-inf"),
        pytest.param(torch.zeros(4), None, "at least 2 dimensions", id="1-d"),
        pytest.param(torch.zeros(5, 2), None, "not divisible", id="n-not-divisible"),
        pytest.param(torch.zeros(2, 5), None, "not divisible", id="k-larger-than-n"),
        pytest.param(torch.zeros(7, 3), 2, r"capacity=2 .* holds only 6", id="capacity-times-k-below-n"),
        pytest.param(torch.zeros(4, 2), 0, "positive integer", id="capacity-zero"),
        pytest.param(torch.zeros(4, 2), -3, "positive integer", id="capacity-negative"),
        pytest.param(torch.zeros(4, 2), 2.5, "positive integer", id="capacity-fractional"),
        pytest.param(torch.zeros(4, 2, dtype=torch.long), None, "floating", id="integer-dtype"),
        pytest.param(torch.zeros(0, 2), None, "at least one token", id="no-tokens"),
        pytest.param(torch.zeros(3, 0), None, "at least one token", id="no-experts"),
    ],
)
def test_bad_input_raises_helpful_value_error(scores: torch.Tensor, capacity, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        balanced_assignment(scores, capacity=capacity)


def test_boolean_capacity_is_rejected() -> None:
    try:
        balanced_assignment(torch.zeros(2, 2), capacity=True)
    except ValueError as err:
        assert "capacity" in str(err)
    else:
        raise AssertionError("capacity=True was accepted")


def test_k_larger_than_n_with_explicit_capacity() -> None:
    s = torch.randn(20, 2, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    z = balanced_assignment(s, capacity=1)
    assert (z[:, 0] != z[:, 1]).all()
    check_optimal(s, z, 1)


def test_integral_float_capacity_is_accepted() -> None:
    s = torch.randn(10, 6, 3, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    assert torch.equal(balanced_assignment(s, capacity=3.0), balanced_assignment(s, capacity=3))


# ----------------------------------------------------------------------------- batching


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_matches_per_instance(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    s = torch.randn(3, 4, 10, 5, generator=gen, dtype=dtype)  # [B1, B2, n, k], capacity 2
    s[0, 1, :4, 0] = NEG_INF
    z = balanced_assignment(s)
    assert z.shape == (3, 4, 10)
    for b1 in range(3):
        for b2 in range(4):
            single = balanced_assignment(s[b1, b2])
            # continuous scores: the optimum is unique almost surely, so the assignments agree
            assert torch.equal(z[b1, b2], single)
    check_optimal(s, z)
    flat = balanced_assignment(s.reshape(12, 10, 5))
    assert torch.equal(flat.view(3, 4, 10), z)


def test_non_contiguous_input() -> None:
    gen = torch.Generator().manual_seed(12)
    base = torch.randn(6, 4, 12, generator=gen, dtype=torch.float64)  # [B, k, n]
    s = base.transpose(-1, -2)  # [B, n, k], not contiguous
    assert not s.is_contiguous()
    assert torch.equal(balanced_assignment(s), balanced_assignment(s.contiguous()))
    check_optimal(s, balanced_assignment(s))


def test_deterministic_and_does_not_modify_input() -> None:
    gen = torch.Generator().manual_seed(13)
    s = torch.randint(0, 2, (30, 12, 4), generator=gen).to(torch.float32)  # heavy ties
    s[:, 0, 1] = NEG_INF
    before = s.clone()
    z1 = balanced_assignment(s)
    z2 = balanced_assignment(s)
    assert torch.equal(z1, z2)
    assert torch.equal(s, before)


def test_accepts_tensor_requiring_grad() -> None:
    s = torch.randn(8, 4, generator=torch.Generator().manual_seed(14), dtype=torch.float64, requires_grad=True)
    z = balanced_assignment(s)
    check_optimal(s.detach(), z)


# ----------------------------------------------------------------------------- property tests


@st.composite
def instances(draw, allow_forbidden: bool = True):
    k = draw(st.integers(1, 5))
    n = draw(st.integers(1, 12))
    cap_kind = draw(st.sampled_from(["default", "tight", "slack", "huge"]))
    if cap_kind == "default" and n % k == 0:
        cap = None
    else:
        cap = math.ceil(n / k) + {"default": 0, "tight": 0, "slack": draw(st.integers(1, 3)), "huge": 100}[cap_kind]
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["gaussian", "integers", "scaled"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        s = torch.randn(n, k, generator=gen, dtype=torch.float64)
    elif kind == "integers":
        s = torch.randint(-3, 4, (n, k), generator=gen).to(torch.float64)
    else:
        s = torch.randn(n, k, generator=gen, dtype=torch.float64) * draw(st.sampled_from([1e-2, 1e2, 1e5]))
    if allow_forbidden:
        density = draw(st.sampled_from([0.0, 0.0, 0.2, 0.5]))
        s = s.masked_fill(torch.rand(n, k, generator=gen) < density, NEG_INF)
    return s.to(dtype), cap


@HYPOTHESIS
@given(instances())
def test_property_optimal_or_infeasible(inst) -> None:
    s, cap = inst
    _, feasible = oracle(_np64(s), cap)
    event("feasible" if feasible else "infeasible")
    if not feasible:
        with pytest.raises(ValueError, match="no feasible assignment"):
            balanced_assignment(s, capacity=cap)
    else:
        check_optimal(s, balanced_assignment(s, capacity=cap), cap)


@HYPOTHESIS
@given(instances(allow_forbidden=False), st.data())
def test_property_invariances(inst, data) -> None:
    """Per-token shifts, per-expert shifts (c = n/k), token permutations and positive rescaling
    keep the optimal assignment optimal: the solver's value on the transformed problem, measured
    on the original scores, equals the original optimum."""
    s, cap = inst
    n, k = s.shape
    dtype = s.dtype
    S = _np64(s)
    best, _ = oracle(S, cap)
    tol = objective_tol(S, dtype)
    # Adding an integer in [-8, 8] rounds every entry by at most eps (|s| + 8): n of them per value.
    rounding = 2 * n * float(torch.finfo(dtype).eps) * (float(np.abs(S).max()) + 8.0)
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)

    # per-token constant: value shifts by sum of the constants, the argmax set is unchanged
    r = torch.randint(-4, 5, (n, 1), generator=gen).to(dtype)
    z = balanced_assignment(s + r, capacity=cap)
    shifted = _np64(s + r)
    assert (
        abs(objective(shifted, z.numpy()) - (best + float(_np64(r).sum())))
        <= objective_tol(shifted, dtype) + rounding
    )
    assert abs(objective(S, z.numpy()) - best) <= objective_tol(shifted, dtype) + rounding

    # per-expert constant when every slot is used: value shifts by c * sum of the constants
    c = n // k if cap is None else min(cap, n)
    if c * k == n:
        col = torch.randint(-4, 5, (1, k), generator=gen).to(dtype)
        z = balanced_assignment(s + col, capacity=cap)
        shifted = _np64(s + col)
        expect = best + c * float(_np64(col).sum())
        assert abs(objective(shifted, z.numpy()) - expect) <= objective_tol(shifted, dtype) + rounding
        assert abs(objective(S, z.numpy()) - best) <= objective_tol(shifted, dtype) + rounding

    # permuting tokens: the optimal value is unchanged
    perm = torch.randperm(n, generator=gen)
    z = balanced_assignment(s[perm], capacity=cap)
    assert abs(objective(S[perm.numpy()], z.numpy()) - best) <= tol

    # permuting experts: the optimal value is unchanged
    eperm = torch.randperm(k, generator=gen)
    z = balanced_assignment(s[:, eperm], capacity=cap)
    assert abs(objective(S[:, eperm.numpy()], z.numpy()) - best) <= tol

    # positive rescaling by a power of two (exact in floating point): same optimum
    alpha = 2.0 ** data.draw(st.integers(-6, 6), label="log2 alpha")
    z = balanced_assignment(s * alpha, capacity=cap)
    assert abs(objective(S, z.numpy()) - best) <= tol


# ----------------------------------------------------------------------------- CUDA


class TestWhereAGpuSolves:
    """``on_host``: where scores on a GPU are solved (the CUDA half is in :class:`TestCuda`)."""

    @pytest.mark.parametrize("bad", [1, "yes", 0.0])
    def test_on_host_must_be_none_or_a_bool(self, bad: object) -> None:
        with pytest.raises(TypeError, match="on_host must be None"):
            balanced_assignment(torch.randn(4, 2), on_host=bad)

    @pytest.mark.parametrize("on_host", [None, True, False])
    @pytest.mark.parametrize("k", [1, 2])
    def test_cpu_scores_ignore_it(self, on_host: bool | None, k: int) -> None:
        s = torch.randn(3, 12, 4, generator=torch.Generator().manual_seed(0))
        assert torch.equal(balanced_assignment(s, k=k, on_host=on_host), balanced_assignment(s, k=k))

    def test_cpu_scores_never_pay_for_a_copy(self) -> None:
        from routelab.assignment.balanced import host_solve_pays

        assert not host_solve_pays(torch.randn(2, 8, 4))

    def test_the_results_travel_back_in_one_bit_exact_copy(self) -> None:
        from routelab.assignment.balanced import _to_device

        expert = torch.arange(6).view(2, 3)
        arc = torch.randn(2, 4, 4, dtype=torch.float64)
        arc[0, 0, 0], arc[1, 2, 3], arc[1, 1, 1] = float("inf"), float("-inf"), -0.0
        scale = torch.tensor([3, -2])
        got = _to_device((expert, arc, scale), torch.device("cpu"))
        for a, b in zip(got, (expert, arc, scale)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.int64), b.view(torch.int64))  # bit for bit (the sign of -0 too)

    def test_the_bound_sits_between_the_measured_sizes(self) -> None:
        # The two batched sizes measured on an H200 (docs/bench-assignment-gpu.md): the host won at
        # 64 x 256 x 16 and lost at 64 x 4096 x 64.
        from routelab.assignment._tuning import TUNING

        assert 64 * 256 * 16 <= TUNING.host_max_scores < 64 * 4096 * 64


@pytest.mark.requires_cuda
class TestCuda:
    @pytest.mark.parametrize("on_host", [None, False, True], ids=["auto", "device", "host"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("name", ["gaussian", "integer_ties", "large_scale", "forbidden_pairs"])
    def test_objective_matches_oracle_on_cuda(self, name: str, dtype: torch.dtype, on_host: bool | None) -> None:
        gen = torch.Generator().manual_seed(2000 + FAMILIES.index(name))
        for n, k, cap in SHAPES:
            c = n // k if cap is None else min(cap, n)
            s = family(name, 1 if n == 1 else 25, n, k, c, gen).to(dtype)
            z = balanced_assignment(s.cuda(), capacity=cap, on_host=on_host)
            assert z.is_cuda
            check_optimal(s.cuda(), z, cap)
            # Not compared entry by entry with the CPU answer: where two assignments tie within the
            # dtype's rounding, the PyTorch (CUDA) path and the compiled CPU path may pick either
            # (documented in balanced_assignment; found on an H200, gaussian float32).
            check_optimal(s, balanced_assignment(s, capacity=cap), cap)

    @pytest.mark.parametrize("on_host", [None, False, True], ids=["auto", "device", "host"])
    def test_infeasible_raises_on_cuda(self, on_host: bool | None) -> None:
        s = torch.tensor([[0.0, NEG_INF], [1.0, NEG_INF], [2.0, NEG_INF]], device="cuda")
        with pytest.raises(ValueError, match="no feasible assignment"):
            balanced_assignment(s, capacity=2, on_host=on_host)

    @pytest.mark.parametrize("on_host", [None, False, True], ids=["auto", "device", "host"])
    def test_bad_input_raises_on_cuda(self, on_host: bool | None) -> None:
        with pytest.raises(ValueError, match="NaN"):
            balanced_assignment(torch.tensor([[float("nan"), 0.0], [0.0, 0.0]], device="cuda"), on_host=on_host)

    def test_a_small_batch_is_solved_on_the_host_with_two_syncs(self) -> None:
        from routelab.assignment._compiled import HAVE_NUMBA
        from routelab.bench.assignment import count_host_syncs

        if not HAVE_NUMBA:
            pytest.skip("the host path needs numba (the compiled CPU solver)")
        s = torch.randn(64, 256, 16, generator=torch.Generator().manual_seed(1)).cuda()
        auto, device = balanced_assignment(s), balanced_assignment(s, on_host=False)
        check_optimal(s, auto, None)
        check_optimal(s, device, None)
        assert count_host_syncs(lambda: balanced_assignment(s), device="cuda") <= 2
        assert count_host_syncs(lambda: balanced_assignment(s, on_host=False), device="cuda") > 2

    def test_half_precision_and_b_matching_on_the_host(self) -> None:
        s = torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(2))
        for dtype in (torch.float16, torch.bfloat16):
            z = balanced_assignment(s.to("cuda", dtype), on_host=True)
            assert z.is_cuda
            check_optimal(s.to(dtype).float().cuda(), z, None)
        pairs = balanced_assignment(s.cuda(), k=2, on_host=True)
        assert pairs.is_cuda
        assert torch.equal(pairs.cpu(), balanced_assignment(s, k=2))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3, 1e6])
@pytest.mark.parametrize("length", [4, 7, 12])
def test_a_chain_of_forbidden_pairs_with_one_feasible_assignment_is_solved(monkeypatch, compiled, scale, length):
    """A mutation review: a penalty for -inf pairs of ``lo - (spread + 1)`` (not ``* (n + 1)``) survived the
    suite, and refused this feasible instance. Token 0 may only take expert 0; token i prefers expert i - 1
    (score 10) but may take expert i (score 0): at capacity 1 the identity is the only feasible assignment,
    though every token but the first would gain by moving to its preferred expert."""
    from routelab.assignment import _compiled

    monkeypatch.setattr(_compiled, "ENABLED", compiled)
    s = torch.full((length, length), float("-inf"), dtype=torch.float64)
    s[0, 0] = 0.0
    for i in range(1, length):
        s[i, i - 1], s[i, i] = 10.0 * scale, 0.0
    assert balanced_assignment(s, 1).tolist() == list(range(length))
