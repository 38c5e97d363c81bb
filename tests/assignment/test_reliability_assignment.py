"""Regression tests of the balanced-assignment defects found by fuzzing (issue 12: D1-D5, D8-D10, D13).

Each test is the issue's minimal repro, checked against independent truth: the Hungarian oracle on
the column-expanded matrix (``test_balanced_assignment.oracle``), the brute-force conditionals of
eq. 8-9 (``test_gumbel_matching.oracle_conditionals``) or an identity of the problem (shift and
power-of-two scale invariance). Every call runs under a wall-clock guard, so a regression to a hang
fails instead of stalling the suite.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_balanced_assignment import _np64, check_optimal, exactness_tol, objective, oracle
from test_gumbel_matching import oracle_conditionals

from hang_guard import returns_within
from routelab.assignment import balanced_assignment, base_assignment, gumbel_matching, sample_gumbel, sinkhorn
from routelab.assignment._normalise import ldexp, normalise_scores, perturbed_scores
from routelab.layers import MoE

NEG_INF = float("-inf")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- D1: no hang at any magnitude


@pytest.mark.parametrize(
    "scores",
    [
        pytest.param(lambda: torch.full((32, 16), 1e30), id="all-equal-1e30"),
        pytest.param(lambda: torch.randn(6, 3, dtype=torch.float64, generator=gen()) * 1e154, id="float64-1e154"),
        pytest.param(lambda: torch.randn(40, 8, dtype=torch.float64, generator=gen(1)) * 1e300, id="float64-1e300"),
        pytest.param(lambda: torch.randn(40, 8, generator=gen(2)).clamp(-3, 3) * 1.1e38, id="float32-near-max"),
        pytest.param(lambda: torch.randn(40, 8, generator=gen(3)) * 1e-38, id="float32-subnormal-scale"),
        pytest.param(lambda: torch.ones(7, 7, dtype=torch.float16), id="float16-ones"),
    ],
)
def test_extreme_magnitudes_return_the_optimum(scores) -> None:
    s = scores()
    with returns_within(20):
        z = balanced_assignment(s)
    n, k = s.shape
    counts = torch.bincount(z, minlength=k)
    assert int(counts.max()) <= n // k
    if s.dtype in (torch.float16, torch.bfloat16):
        s = s.float()
    # The problem is invariant under a positive power-of-two scale: judge on the rescaled values
    # (exact), which the float64 Hungarian oracle can sum without overflow.
    S = _np64(s)
    finite_max = float(np.abs(S).max())
    if finite_max > 0:
        S = S * 2.0 ** -np.frexp(finite_max)[1]
    best, _ = oracle(S, None)
    assert abs(objective(S, z.numpy()) - best) <= exactness_tol(S, s.dtype)


def test_tiny_tau_gumbel_matching_returns_a_balanced_sample() -> None:
    with returns_within(20):
        gm = gumbel_matching(torch.ones(64, 32), tau=1e-30, generator=gen())
    assert torch.bincount(gm.expert, minlength=32).tolist() == [2] * 32
    assert torch.allclose(gm.conditional_log_probs.exp().sum(-1), torch.ones(64))


@pytest.mark.parametrize("tau", [1e-3, 1e-30, 1.0])
def test_huge_float64_logits_give_the_exact_assignment(tau: float) -> None:
    """At 1e300-scale logits the noise is irrelevant for tau <= 1 (ties aside): the sample must be
    the balanced assignment of the logits themselves (a random instance has no ties)."""
    a = torch.randn(12, 4, dtype=torch.float64, generator=gen(5))
    with returns_within(20):
        gm = gumbel_matching(a * 1e300, tau=tau, generator=gen(6))
    best, _ = oracle(_np64(a), None)
    assert objective(_np64(a), gm.expert.numpy()) == pytest.approx(best, rel=1e-12)
    assert torch.allclose(gm.conditional_log_probs.exp().sum(-1), torch.ones(12, dtype=torch.float64))


def test_moe_with_base_router_on_huge_input_returns() -> None:
    torch.manual_seed(0)
    layer = MoE(16, 8, 4, router="base")
    with returns_within(20):
        out, routes = layer(torch.randn(8, 16) * 1e38)
    assert torch.isfinite(out).all()
    assert torch.bincount(routes.expert.flatten(), minlength=4).max() <= 2


# ----------------------------------------------------------------------------- D10: exact under offsets and near-ties


@pytest.mark.parametrize(
    ("offset", "scale", "instances"),
    [(1e5, 1.0, 4), (1e4, 1.0, 10), (1.0, 1e-7, 10), (-3e6, 1.0, 4)],
    ids=["offset-1e5", "offset-1e4", "near-ties", "offset-minus-3e6"],
)
def test_offset_and_near_tie_instances_are_optimal(offset: float, scale: float, instances: int) -> None:
    s = torch.randn(instances, 256, 64, generator=gen(0)) * scale + offset
    check_optimal(s, balanced_assignment(s))


def test_per_row_offsets_are_solved_exactly() -> None:
    """Different large offsets per token (the shift is per row, not global)."""
    base = torch.randn(3, 96, 8, generator=gen(1), dtype=torch.float64)
    rows = torch.randint(-10**6, 10**6, (3, 96, 1), generator=gen(2)).double() * 1e3
    check_optimal(base + rows, balanced_assignment(base + rows))


# ----------------------------------------------------------------------------- D2, D8, D9: conditionals


def test_conditionals_with_a_forbidden_column_match_the_oracle() -> None:
    lg = torch.randn(3, 3, generator=gen(), dtype=torch.float64)
    lg[:, 2] = NEG_INF
    g = torch.randn(3, 3, generator=gen(1), dtype=torch.float64)
    gm = gumbel_matching(lg, capacity=2, gumbels=g)
    expect = oracle_conditionals(_np64(lg), _np64(g), 1.0, 2)
    got = gm.conditional_log_probs.numpy()
    assert np.array_equal(np.isneginf(got), np.isneginf(expect))
    finite = np.isfinite(expect)
    np.testing.assert_allclose(got[finite], expect[finite], atol=1e-9)


def test_forbidden_last_token_conditionals_are_finite_float32() -> None:
    lg = torch.randn(3, 3, generator=gen())
    lg[:, 2] = NEG_INF
    gm = gumbel_matching(lg, capacity=2, generator=gen())
    assert not torch.isnan(gm.conditional_log_probs).any()
    assert torch.isneginf(gm.conditional_log_probs[:, 2]).all()
    assert torch.allclose(gm.conditional_log_probs.exp().sum(-1), torch.ones(3))


@pytest.mark.parametrize("tau", [1e-30, 1e-7, 1e-3])
def test_conditionals_stay_normalised_at_tiny_tau(tau: float) -> None:
    gm = gumbel_matching(torch.ones(4, 5), tau=tau, capacity=2, generator=gen())
    assert torch.allclose(gm.conditional_log_probs.exp().sum(-1), torch.ones(4))
    assert (gm.log_prob_of_sample() > NEG_INF).all()


def test_tiny_tau_conditionals_match_the_oracle() -> None:
    """Equal logits: at tau = 1e-30 the assignment is decided by the noise alone (exactly, not by
    the float32 rounding of 1e30 + g), and the conditionals are the oracle's."""
    g = torch.randn(6, 3, generator=gen(3), dtype=torch.float64)
    lg = torch.zeros(6, 3, dtype=torch.float64)
    gm = gumbel_matching(lg, tau=1e-30, gumbels=g)
    best, _ = oracle(_np64(g), None)
    assert objective(_np64(g), gm.expert.numpy()) == pytest.approx(best, abs=1e-12)
    expect = oracle_conditionals(_np64(lg), _np64(g), 1.0, 2)  # a / tau constant per row: tau drops out
    np.testing.assert_allclose(gm.conditional_log_probs.numpy(), expect, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_tau_zero_sampled_expert_always_has_positive_probability(dtype: torch.dtype) -> None:
    lg = torch.randn(200, 24, 6, generator=gen(4)).to(dtype) * 3 + 50
    gm = gumbel_matching(lg, tau=0.0, capacity=5)
    assert (gm.log_prob_of_sample() > NEG_INF).all()
    assert torch.allclose(gm.conditional_log_probs.exp().sum(-1), torch.ones((), dtype=dtype))


# ----------------------------------------------------------------------------- D3, D4, D5, D13


def test_empty_leading_batch_gives_empty_outputs() -> None:
    assert balanced_assignment(torch.randn(0, 8, 4)).shape == (0, 8)
    assert base_assignment(torch.randn(2, 0, 8, 4)).shape == (2, 0, 8)
    gm = gumbel_matching(torch.randn(0, 8, 4), generator=gen())
    assert gm.expert.shape == (0, 8)
    assert gm.conditional_log_probs.shape == (0, 8, 4)
    assert gm.shortest_paths.shape == (0, 4, 4)
    assert sinkhorn(torch.randn(0, 4, 2)).shape == (0, 4, 2)


@pytest.mark.parametrize("capacity", [float("inf"), float("nan"), 2.5, -1, True])
def test_bad_capacity_is_a_value_error_naming_it(capacity) -> None:
    with pytest.raises(ValueError, match="capacity"):
        balanced_assignment(torch.randn(8, 4), capacity=capacity)
    with pytest.raises(ValueError, match="capacity"):
        gumbel_matching(torch.randn(8, 4), capacity=capacity, generator=gen())


def test_infeasible_forbidden_pattern_is_the_documented_value_error() -> None:
    row = [NEG_INF, 1.790645956993103, -0.03499338775873184, -1.232150912284851, -0.6901221871376038]
    s = torch.tensor([row]).repeat(20, 1)
    _, feasible = oracle(_np64(s), 4)
    assert not feasible
    with returns_within(20), pytest.raises(ValueError, match="no feasible assignment"):
        balanced_assignment(s, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_is_solved_in_float32(dtype: torch.dtype) -> None:
    s = (torch.randn(5, 24, 6, generator=gen(7)) * 4).to(dtype)
    z = balanced_assignment(s)
    check_optimal(s.float(), z)
    gm = gumbel_matching(s, generator=gen(8))
    assert gm.conditional_log_probs.dtype == torch.float32
    assert torch.allclose(gm.conditional_log_probs.exp().sum(-1), torch.ones(()))


def test_wrong_generator_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="generator"):
        gumbel_matching(torch.randn(8, 4), generator=0)


# ----------------------------------------------------------------------------- the normalisation itself


def test_ldexp_survives_exponents_beyond_the_range() -> None:
    x = torch.tensor([[0.0, NEG_INF, 1.5, -1.5]], dtype=torch.float64)
    up = ldexp(x, torch.tensor([3000]))
    assert up[0, 0] == 0 and up[0, 1] == NEG_INF and up[0, 2] == float("inf") and up[0, 3] == NEG_INF
    down = ldexp(x, torch.tensor([-3000]))
    assert down[0, 0] == 0 and down[0, 1] == NEG_INF and down[0, 2] == 0 and down[0, 3] == 0
    # Exact within the range: a round trip through 2^700 and back.
    y = torch.randn(2, 5, dtype=torch.float64, generator=gen())
    assert torch.equal(ldexp(ldexp(y, torch.tensor([700, -700])), torch.tensor([-700, 700])), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_normalised_scores_are_an_exact_rescaling_of_the_row_shifted_ones(dtype: torch.dtype, scale: float) -> None:
    S = (torch.randn(3, 10, 4, generator=gen(9), dtype=torch.float64) * scale).to(dtype)
    S[0, 2, 1] = NEG_INF
    N, e = normalise_scores(S)
    shifted = S - S.amax(-1, keepdim=True)
    assert torch.equal(ldexp(N, e), shifted)
    spread = -N.masked_fill(torch.isinf(N), 0).amin(dim=(-2, -1))
    assert ((spread >= 0.5) & (spread < 1.0)).all()
    assert torch.equal(N.amax(-1), torch.zeros(3, 10, dtype=dtype))


def test_perturbed_scores_equal_logits_over_tau_plus_noise() -> None:
    a = torch.randn(2, 6, 3, dtype=torch.float64, generator=gen(10))
    g = torch.randn(2, 6, 3, dtype=torch.float64, generator=gen(11))
    for tau in (1e-3, 0.7, 1e3):
        S, A, E = perturbed_scores(a, tau, g)
        direct = a / tau + g
        direct = direct - direct.amax(-1, keepdim=True)
        rebuilt = ldexp(S, E)
        np.testing.assert_allclose(
            (rebuilt - rebuilt.amax(-1, keepdim=True)).numpy(), direct.numpy(), atol=1e-9 * float(direct.abs().max())
        )
        noise_free = ldexp(A, E)
        expect = (a - a.amax(-1, keepdim=True)) / tau
        np.testing.assert_allclose(
            noise_free.numpy(), expect.numpy(), rtol=1e-12, atol=1e-12 * float(expect.abs().max())
        )


def test_overflowing_perturbed_scores_are_returned_rescaled() -> None:
    """|logits| / tau beyond the dtype's range: ``scores`` are finite at every allowed pair, in units
    of 2 ** log2_scale, and the sample is optimal for them; ordinary input keeps literal scores."""
    a = torch.randn(6, 3, generator=gen(12)) * 1e10
    a[0, 1] = NEG_INF
    gm = gumbel_matching(a, tau=1e-30, gumbels=torch.randn(6, 3, generator=gen(13)), capacity=3)
    assert int(gm.log2_scale) > 0
    allowed = ~torch.isneginf(a)
    assert torch.isfinite(gm.scores[allowed]).all() and torch.isneginf(gm.scores[~allowed]).all()
    best, _ = oracle(_np64(gm.scores), 3)
    assert objective(_np64(gm.scores), gm.expert.numpy()) == pytest.approx(
        best, abs=exactness_tol(_np64(gm.scores), torch.float32)
    )
    # noise negligible at this temperature: also the optimum of the logits themselves
    best_a, _ = oracle(_np64(a), 3)
    assert objective(_np64(a), gm.expert.numpy()) == pytest.approx(best_a, rel=1e-6)
    x = torch.randn(2, 6, 3, generator=gen(14))
    plain = gumbel_matching(x, tau=0.5, capacity=3, generator=gen(15))
    assert not plain.log2_scale.any() and plain.log2_scale.shape == (2,)
    assert torch.equal(plain.scores, x / 0.5 + plain.gumbels)  # the literal perturbed scores


@pytest.mark.parametrize(
    ("shape", "dtype", "error"),
    [((2, -1), torch.float32, ValueError), ("2x3", torch.float32, ValueError), ((2, 3), torch.long, TypeError)],
)
def test_sample_gumbel_rejects_bad_arguments_by_name(shape, dtype, error) -> None:
    with pytest.raises(error, match="shape" if error is ValueError else "dtype"):
        sample_gumbel(shape, dtype=dtype, generator=gen())


def test_importance_weight_with_a_forbidden_column_is_p_over_q() -> None:
    """D2's second repro: ``sample_routes(..., "gumbel_matching_iw")`` with a forbidden expert that
    has free slots gives the finite weight p / q, q the sampled expert's conditional (eq. 6)."""
    from routelab.estimators import sample_routes

    lg = torch.randn(3, 3, generator=gen())
    lg[:, 2] = NEG_INF
    r = sample_routes(lg, "gumbel_matching_iw", capacity=2, generator=gen(1))
    assert r.num_slots == 1  # [n, 1]: read the one slot per token
    expert, weight = r.expert[..., 0], r.weight[..., 0]
    assert torch.isfinite(weight).all()
    gm = gumbel_matching(lg, capacity=2, generator=gen(1))  # the same noise: the same sample
    assert torch.equal(gm.expert, expert)
    p = torch.softmax(lg.double(), -1).gather(-1, expert.unsqueeze(-1)).squeeze(-1)
    q = gm.log_prob_of_sample().double().exp()
    torch.testing.assert_close(weight.double(), p / q, rtol=1e-5, atol=0)


def test_a_token_allowed_on_no_expert_is_named() -> None:
    """A review case: balanced_assignment said "some set of tokens" where sinkhorn names the row."""
    inf = float("inf")
    scores = torch.tensor([[0.0, 1.0], [-inf, -inf], [1.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="row 1 of batch instance 0 is -inf everywhere"):
        balanced_assignment(scores)


def test_numpy_integers_are_integers() -> None:
    """A review case: k=np.int64(1) took the b-matching path ([n, 1] instead of [n]), and
    check_capacity refused np.int64(0) where it takes 0."""
    from routelab._checks import check_capacity

    scores = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(balanced_assignment(scores, k=np.int64(1)), balanced_assignment(scores))
    assert check_capacity(np.int64(0)) == 0
