"""routelab.routing.capacity against independent truth.

Oracles:

* ``expert_capacity``: the documented formula ``ceil(cf * n * slots / E)`` clamped to
  ``[1, n]`` (``n`` when dropless), evaluated in exact rational arithmetic on hand-picked cases.
* ``apply_capacity``: plain-Python loop references of the drop policies written from the
  docstrings ("position": first slots before second slots, then earlier tokens; "score": the
  ``C`` largest scores, ties to the earlier (slot, token)); "random": every subset of
  ``min(n_z, C)`` candidates equally likely (chi-square over all subsets, Monte Carlo), seed
  determinism, and no use of the global RNG.
* ``skip_correction`` / eq. 3 of Kool et al. (2021): with uniformly random drops, the
  per-expert sum of ``keep * n_z / min(n_z, C) * h`` is an unbiased estimate of the sum over all
  candidates (Monte Carlo against the exact sum; the uncorrected and the position-policy sums
  serve as negative controls that the same bound rejects).
* ``random_ranks`` / ``random_skip``: every ordering within a group equally likely (chi-square
  over all permutations), keep = rank < C, load = n_z.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from routelab.routing import apply_capacity, expert_capacity, random_ranks, random_skip, skip_correction

FAST = settings(max_examples=40, deadline=None)
#: Chi-square tail probability below which a uniformity test fails (fixed seeds: deterministic).
ALPHA = 1e-6


# ------------------------------------------------------------------------- loop references


def ref_position(expert: list[list[int]], candidate: list[list[bool]], C: int, E: int) -> list[list[bool]]:
    """Keep the first C candidates of every expert in slot-major, then token, order."""
    n = len(expert)
    s = len(expert[0]) if n else 0
    keep = [[False] * s for _ in range(n)]
    taken = [0] * E
    for j in range(s):
        for t in range(n):
            if candidate[t][j] and taken[expert[t][j]] < C:
                keep[t][j] = True
                taken[expert[t][j]] += 1
    return keep


def ref_score(expert, candidate, score, C: int, E: int) -> list[list[bool]]:
    """Keep the C largest scores of every expert; ties to the earlier (slot, token)."""
    n = len(expert)
    s = len(expert[0]) if n else 0
    keep = [[False] * s for _ in range(n)]
    for e in range(E):
        pairs = [(t, j) for j in range(s) for t in range(n) if candidate[t][j] and expert[t][j] == e]
        pairs.sort(key=lambda tj: (-score[tj[0]][tj[1]], tj[1], tj[0]))
        for t, j in pairs[:C]:
            keep[t][j] = True
    return keep


def ref_stats(expert, candidate, keep, C: int, E: int):
    """(load n_z, kept min(n_z, C), skip weight n_z / min(n_z, C) on kept pairs and 0 elsewhere)."""
    n = len(expert)
    s = len(expert[0]) if n else 0
    load = [0] * E
    for t in range(n):
        for j in range(s):
            if candidate[t][j]:
                load[expert[t][j]] += 1
    kept = [min(z, C) for z in load]
    sw = [[load[expert[t][j]] / kept[expert[t][j]] if keep[t][j] else 0.0 for j in range(s)] for t in range(n)]
    return load, kept, sw


def routing_problem(draw_seed: int, n: int, s: int, E: int, cand_p: float):
    g = torch.Generator().manual_seed(draw_seed)
    expert = torch.randint(0, E, (n, s), generator=g)
    candidate = torch.rand(n, s, generator=g) < cand_p
    return expert, candidate


def check_decision(d, expert, candidate, want_keep, C, E) -> None:
    e_l, c_l = expert.tolist(), candidate.tolist()
    assert d.keep.tolist() == want_keep
    load, kept, sw = ref_stats(e_l, c_l, want_keep, C, E)
    assert d.load.tolist() == load
    assert d.kept.tolist() == kept
    torch.testing.assert_close(d.skip_weight.double(), torch.tensor(sw, dtype=torch.float64).reshape(expert.shape),
                               rtol=1e-6, atol=0)
    # Kept pairs occupy distinct rows of their expert's buffer, inside [0, C).
    rows = [(e_l[t][j], int(d.position[t, j])) for t in range(len(e_l)) for j in range(len(e_l[0])) if want_keep[t][j]]
    assert all(0 <= p < C for _, p in rows)
    assert len(set(rows)) == len(rows)


# ------------------------------------------------------------------------- expert_capacity


@pytest.mark.parametrize("n, E, slots, cf, want", [
    (8, 4, 1, 1.0, 2),
    (8, 4, 2, 1.0, 4),
    (8, 4, 2, 1.25, 5),      # 1.25 * 16 / 4 = 5 exactly
    (10, 4, 1, 1.0, 3),      # ceil(2.5)
    (100, 10, 1, 1.1, 11),   # 1.1 * 100 / 10 is 11 (float rounding gives 11.000000000000002)
    (3, 8, 1, 1.0, 1),       # at least one row with tokens
    (3, 8, 1, 0.01, 1),
    (10, 2, 1, 100.0, 10),   # never more than the tokens
    (0, 4, 1, 1.0, 0),       # empty batch
    (7, 3, 1, None, 7),      # dropless
    (12, 3, 2, 0.5, 4),
])
def test_expert_capacity_formula(n, E, slots, cf, want) -> None:
    assert expert_capacity(n, E, slots, cf) == want
    if cf is not None and n:
        exact = Fraction(str(cf)) * n * slots / E  # decimal reading of the factor
        assert want == min(max(math.ceil(exact), 1), n)


# ------------------------------------------------------------------------- apply_capacity: position / score


@FAST
@given(n=st.integers(0, 9), s=st.integers(1, 3), E=st.integers(1, 4), C=st.integers(0, 6),
       cand_p=st.sampled_from((1.0, 0.6)), seed=st.integers(0, 2**31 - 1))
def test_position_policy_equals_loop_reference(n, s, E, C, cand_p, seed) -> None:
    expert, candidate = routing_problem(seed, n, s, E, cand_p)
    d = apply_capacity(expert, candidate, C, E, policy="position")
    want = ref_position(expert.tolist(), candidate.tolist(), C, E)
    check_decision(d, expert, candidate, want, C, E)


@FAST
@given(n=st.integers(0, 12), s=st.integers(1, 3), E=st.integers(1, 4), extra=st.sampled_from((0, 5)),
       policy=st.sampled_from(("position", "score", "random")), seed=st.integers(0, 2**31 - 1))
def test_a_capacity_of_every_pair_drops_nothing_on_every_policy(n, s, E, extra, policy, seed) -> None:
    """``C >= n * s`` (the dropless layers' limit) skips the dropping steps: the decision is the
    loop reference's, duplicate experts per token included (random: every candidate kept)."""
    expert, candidate = routing_problem(seed, n, s, E, 0.7)
    C = n * s + extra
    score = torch.randn(n, s, generator=torch.Generator().manual_seed(seed))
    d = apply_capacity(expert, candidate, C, E, policy=policy, score=score,
                       generator=torch.Generator().manual_seed(seed))
    check_decision(d, expert, candidate, candidate.tolist(), C, E)
    assert d.skip_weight.dtype == torch.float32


def test_position_policy_is_slot_major_not_token_major() -> None:
    """Token 0's second choice competes after token 1's first choice (a token-major bug keeps it)."""
    expert = torch.tensor([[1, 0], [0, 1]])
    d = apply_capacity(expert, torch.ones(2, 2, dtype=torch.bool), 1, 2)
    assert d.keep.tolist() == [[True, False], [True, False]]


@FAST
@given(n=st.integers(0, 9), s=st.integers(1, 3), E=st.integers(1, 4), C=st.integers(0, 6),
       cand_p=st.sampled_from((1.0, 0.6)), kind=st.sampled_from(("distinct", "ties", "inf", "int")),
       seed=st.integers(0, 2**31 - 1))
def test_score_policy_equals_loop_reference(n, s, E, C, cand_p, kind, seed) -> None:
    expert, candidate = routing_problem(seed, n, s, E, cand_p)
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "distinct":
        score = torch.randn(n, s, generator=g)
    elif kind == "ties":  # many ties: the (slot, token) tie-break decides
        score = torch.randint(0, 3, (n, s), generator=g).float()
    elif kind == "inf":
        score = torch.randn(n, s, generator=g)
        score[torch.rand(n, s, generator=g) < 0.3] = float("inf")
        score[torch.rand(n, s, generator=g) < 0.3] = float("-inf")
    else:
        score = torch.randint(-5, 5, (n, s), generator=g)
    d = apply_capacity(expert, candidate, C, E, policy="score", score=score)
    want = ref_score(expert.tolist(), candidate.tolist(), score.tolist(), C, E)
    check_decision(d, expert, candidate, want, C, E)


def test_score_policy_keeps_largest_not_earliest() -> None:
    expert = torch.zeros(4, 1, dtype=torch.long)
    score = torch.tensor([[0.1], [0.9], [0.5], [0.7]])
    d = apply_capacity(expert, torch.ones(4, 1, dtype=torch.bool), 2, 1, policy="score", score=score)
    assert d.keep[:, 0].tolist() == [False, True, False, True]
    # The score's gradient graph is irrelevant: a score that requires grad works the same.
    d2 = apply_capacity(expert, torch.ones(4, 1, dtype=torch.bool), 2, 1, policy="score",
                        score=score.clone().requires_grad_(True))
    assert torch.equal(d.keep, d2.keep)


# ------------------------------------------------------------------------- apply_capacity: random


def _subset_counts(draws: int, expert, candidate, C, E, generator) -> dict[int, Counter]:
    """For each expert, how often each subset (frozenset of (t, j)) of its candidates was kept."""
    counts: dict[int, Counter] = {e: Counter() for e in range(E)}
    n, s = expert.shape
    for _ in range(draws):
        d = apply_capacity(expert, candidate, C, E, policy="random", generator=generator)
        keep = d.keep.tolist()
        assert not bool((d.keep & ~candidate).any())
        for e in range(E):
            mine = frozenset((t, j) for t in range(n) for j in range(s) if keep[t][j] and int(expert[t, j]) == e)
            counts[e][mine] += 1
    return counts


def _chi2_uniform_pvalue(counter: Counter, support: list) -> float:
    obs = np.array([counter[x] for x in support], dtype=np.float64)
    assert obs.sum() == sum(counter.values()), "a subset outside the support was kept"
    if len(support) == 1:
        return 1.0
    exp = obs.sum() / len(support)
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(chi2.sf(stat, len(support) - 1))


def test_random_policy_keeps_every_subset_equally_often() -> None:
    """Expert 0: 5 candidates across both slots (one token twice; plus non-candidates on it),
    C = 2 -> 10 subsets; expert 1: 4 candidates -> 6 subsets; expert 2: 1 candidate, always kept."""
    expert = torch.tensor([[0, 1], [1, 0], [0, 0], [2, 0], [0, 1], [1, 0]])
    candidate = torch.tensor([[True, True], [True, True], [True, True], [True, True], [False, True],
                              [True, False]])
    C, E = 2, 3
    draws = 2000
    counts = _subset_counts(draws, expert, candidate, C, E, torch.Generator().manual_seed(1234))
    cands = {e: [(t, j) for t in range(6) for j in range(2) if candidate[t, j] and int(expert[t, j]) == e]
             for e in range(E)}
    assert len(cands[0]) == 5 and len(cands[1]) == 4 and len(cands[2]) == 1
    for e in range(E):
        support = [frozenset(c) for c in itertools.combinations(cands[e], min(C, len(cands[e])))]
        p = _chi2_uniform_pvalue(counts[e], support)
        assert p > ALPHA, f"expert {e}: kept subsets are not uniform (chi-square p = {p:.2e})"


def test_uniformity_oracle_rejects_a_biased_rule() -> None:
    """The chi-square check above is able to fail: a rule that keeps the first candidate with
    probability 1/2 instead of 2/5 (a plausible off-by-one in the priorities) is rejected."""
    rng = np.random.default_rng(0)
    cands = list(range(5))
    support = [frozenset(c) for c in itertools.combinations(cands, 2)]
    counter: Counter = Counter()
    for _ in range(3000):
        if rng.random() < 0.5:  # biased: item 0 in half the subsets
            counter[frozenset((0, int(rng.integers(1, 5))))] += 1
        else:
            counter[frozenset(rng.choice(np.arange(1, 5), 2, replace=False).tolist())] += 1
    assert _chi2_uniform_pvalue(counter, support) < ALPHA


def test_random_policy_is_determined_by_the_generator_alone() -> None:
    g = torch.Generator().manual_seed(7)
    expert, candidate = routing_problem(3, 12, 2, 3, 0.9)
    a = apply_capacity(expert, candidate, 2, 3, policy="random", generator=torch.Generator().manual_seed(99))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    b = apply_capacity(expert, candidate, 2, 3, policy="random", generator=torch.Generator().manual_seed(99))
    assert torch.equal(torch.get_rng_state(), state), "the global RNG was used despite a generator"
    torch.manual_seed(12345)  # a different global state changes nothing
    c = apply_capacity(expert, candidate, 2, 3, policy="random", generator=torch.Generator().manual_seed(99))
    for x in (b, c):
        assert torch.equal(a.keep, x.keep) and torch.equal(a.position, x.position)
        assert torch.equal(a.skip_weight, x.skip_weight)
    # Different seeds (or a generator that advances) give different drops.
    seen = {tuple(apply_capacity(expert, candidate, 2, 3, policy="random", generator=g).keep.reshape(-1).tolist())
            for _ in range(20)}
    assert len(seen) > 1, "the random policy ignores its generator"
    # Whatever the draw, it is a valid decision with the documented counts.
    e_l, c_l = expert.tolist(), candidate.tolist()
    want_counts = ref_stats(e_l, c_l, ref_position(e_l, c_l, 2, 3), 2, 3)
    assert a.load.tolist() == want_counts[0] and a.kept.tolist() == want_counts[1]


# ------------------------------------------------------------------------- eq. 3 (skip correction)


def _skip_estimates(policy: str, draws: int, corrected: bool = True):
    g = torch.Generator().manual_seed(2021)
    n, s, E, C = 10, 2, 3, 3
    expert, candidate = routing_problem(11, n, s, E, 0.85)
    h = torch.randn(n, s, generator=g, dtype=torch.float64) + 1.0  # h(x_i, z_i), non-zero mean
    onehot = torch.nn.functional.one_hot(expert, E).double()  # [n, s, E]
    truth = (candidate.double().unsqueeze(-1) * h.unsqueeze(-1) * onehot).sum((0, 1))
    est = torch.empty(draws, E, dtype=torch.float64)
    score = torch.randn(n, s, generator=g)
    for i in range(draws):
        d = apply_capacity(expert, candidate, C, E, policy=policy, generator=g,
                           score=score if policy == "score" else None)
        w = d.skip_weight.double() if corrected else d.keep.double()
        est[i] = (w.unsqueeze(-1) * h.unsqueeze(-1) * onehot).sum((0, 1))
    load = torch.bincount(expert[candidate], minlength=E)
    assert int(load.max()) > C, "the test needs an expert over capacity"
    return est, truth, load


def test_skip_correction_makes_random_drops_unbiased() -> None:
    """E_delta[sum_i delta_i n_z / min(n_z, C) h_i] = sum_i h_i, per expert (Kool et al. App. C)."""
    est, truth, load = _skip_estimates("random", 2000)
    mean = est.mean(0)
    se = est.std(0) / math.sqrt(est.shape[0])
    assert bool(((mean - truth).abs() <= 5 * se + 1e-12).all()), (mean, truth, se)
    # Negative control: the uncorrected sum over the kept pairs is biased, and the bound sees it.
    raw, truth2, _ = _skip_estimates("random", 1000, corrected=False)
    over = load > 3
    gap = (raw.mean(0) - truth2).abs()
    assert bool((gap[over] > 5 * raw.std(0)[over] / math.sqrt(raw.shape[0])).all())


def test_skip_correction_is_not_unbiased_for_deterministic_drops() -> None:
    """Eq. 3 needs uniform subsampling: with the 'score' policy the same correction is biased on
    some over-capacity expert (so the Monte Carlo check above can tell the difference)."""
    est, truth, load = _skip_estimates("score", 1)  # deterministic: one draw is the expectation
    over = load > 3
    assert bool(((est[0] - truth).abs()[over] > 1e-3).any())


def test_skip_correction_inclusion_probability() -> None:
    """Each candidate of expert z is kept with probability min(n_z, C) / n_z, so the expected
    correction keep * n_z / min(n_z, C) is exactly 1 for every candidate."""
    n, s, E, C = 8, 1, 2, 3
    expert = torch.tensor([[0], [0], [0], [0], [0], [1], [1], [0]])
    candidate = torch.ones(n, s, dtype=torch.bool)
    g = torch.Generator().manual_seed(5)
    draws = 2000
    total = torch.zeros(n, s, dtype=torch.float64)
    kept = torch.zeros(n, s, dtype=torch.float64)
    for _ in range(draws):
        d = apply_capacity(expert, candidate, C, E, policy="random", generator=g)
        total += d.skip_weight.double()
        kept += d.keep.double()
    p = kept / draws
    want = torch.where(expert == 0, C / 6.0, 1.0).double()
    se = torch.sqrt(want * (1 - want) / draws)
    assert bool(((p - want).abs() <= 5 * se + 1e-12).all()), p
    mean_w = total / draws
    assert bool(((mean_w - 1.0).abs() <= 5 * se * 2.0 + 1e-12).all()), mean_w  # weight 2 on expert 0


@FAST
@given(load=st.lists(st.integers(0, 40), max_size=6), C=st.integers(0, 12))
def test_skip_correction_formula(load, C) -> None:
    got = skip_correction(torch.tensor(load, dtype=torch.float64), C).tolist()
    want = [0.0 if z == 0 else z / min(z, C) if min(z, C) else float(z) for z in load]
    assert got == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------- random_ranks / random_skip


def test_random_ranks_every_order_equally_likely() -> None:
    """One group of 4 interleaved with another of 2 (and batched rows): all 4! orders of the
    first group and both orders of the second occur equally often (chi-square)."""
    group = torch.tensor([0, 1, 0, 0, 1, 0])
    B = 12000
    ranks = random_ranks(group.expand(B, 6), 2, torch.Generator().manual_seed(3))
    assert ranks.shape == (B, 6) and ranks.dtype == torch.long
    g0 = ranks[:, group == 0].tolist()
    g1 = ranks[:, group == 1].tolist()
    c0 = Counter(tuple(r) for r in g0)
    c1 = Counter(tuple(r) for r in g1)
    assert set(c0) <= set(itertools.permutations(range(4))), "ranks within a group are not 0..n_z-1"
    assert set(c1) <= set(itertools.permutations(range(2)))
    assert _chi2_uniform_pvalue(c0, list(itertools.permutations(range(4)))) > ALPHA
    assert _chi2_uniform_pvalue(c1, list(itertools.permutations(range(2)))) > ALPHA
    # counts= is only a shortcut: the same generator gives the same ranks.
    counts = torch.bincount(group, minlength=2).expand(B, 2)
    again = random_ranks(group.expand(B, 6), 2, torch.Generator().manual_seed(3), counts=counts)
    assert torch.equal(ranks, again)


def test_random_skip_keeps_low_ranks_with_uniform_inclusion() -> None:
    expert = torch.tensor([2, 0, 0, 1, 0, 0, 0, 2])
    B, C = 8000, 2
    keep, load = random_skip(expert.expand(B, 8), 3, C, torch.Generator().manual_seed(8))
    assert keep.dtype == torch.bool and load.dtype == torch.long
    assert torch.equal(load, torch.tensor([2, 5, 5, 1, 5, 5, 5, 2]).expand(B, 8))
    ranks = random_ranks(expert.expand(B, 8), 3, torch.Generator().manual_seed(8))
    assert torch.equal(keep, ranks < C)
    rate = keep.double().mean(0)
    want = torch.tensor([1.0, 0.4, 0.4, 1.0, 0.4, 0.4, 0.4, 1.0], dtype=torch.float64)
    se = torch.sqrt(want * (1 - want) / B)
    assert bool(((rate - want).abs() <= 5 * se + 1e-12).all()), rate
    # Exactly min(n_z, C) per expert in every row.
    per = torch.zeros(B, 3, dtype=torch.long).scatter_add_(1, expert.expand(B, 8), keep.long())
    assert torch.equal(per, torch.tensor([2, 1, 2]).expand(B, 3))
