"""The compiled (numba) balanced-assignment kernel against the pure-PyTorch solver and the oracle.

Both paths must reach the optimum (scipy's Hungarian oracle, :func:`check_optimal`), on every
instance family of test_balanced_assignment.py and at the sizes the benchmark times; the
compiled path's expert graph must be the graph of its own assignment (the conditionals of
Gumbel-Matching read it); and the switch that turns the kernel off must be honoured.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_balanced_assignment import FAMILIES, SHAPES, check_optimal, exactness_tol, family

from routelab.assignment import _compiled, balanced_assignment
from routelab.assignment._graph import release_weight
from routelab.assignment._normalise import normalise_scores
from routelab.assignment.balanced import _graph_of, _working_scores, solve_balanced

HYPOTHESIS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.skipif(not _compiled.HAVE_NUMBA, reason="numba is not installed")


def _solve(scores: torch.Tensor, capacity: int | None, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(_compiled, "ENABLED", compiled)
    return balanced_assignment(scores, capacity)


def _objective(scores: torch.Tensor, z: torch.Tensor) -> np.ndarray:
    return scores.double().gather(-1, z.unsqueeze(-1)).squeeze(-1).sum(-1).numpy()


def test_the_compiled_path_is_taken_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compiled, "ENABLED", True)  # whatever ROUTELAB_PURE_TORCH says (a review ran the suite so)
    calls = []
    original = _compiled.solve_scores

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_compiled, "solve_scores", spy)
    scores = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    balanced_assignment(scores)
    assert calls == [1]
    monkeypatch.setattr(_compiled, "ENABLED", False)
    balanced_assignment(scores)
    assert calls == [1]  # switched off: the PyTorch path


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", FAMILIES)
def test_both_paths_match_the_oracle_on_every_family(
    name: str, dtype: torch.dtype, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(7000 + FAMILIES.index(name))
    for n, k, cap in SHAPES:
        c = n // k if cap is None else min(cap, n)
        scores = family(name, 1 if n == 1 else 8, n, k, c, gen).to(dtype)
        check_optimal(scores, _solve(scores, cap, compiled, monkeypatch), cap)


@pytest.mark.parametrize(
    ("name", "B", "n", "k", "capacity"),
    [
        ("gaussian", 1, 256, 16, None),
        ("gaussian", 4, 256, 64, None),
        ("gaussian", 1, 1024, 64, None),
        ("gaussian", 1, 2048, 4, None),
        ("integer_ties", 2, 512, 16, None),
        ("large_scale", 1, 1024, 32, None),
        ("one_dominant_expert", 1, 1024, 32, None),
        ("forbidden_pairs", 2, 512, 16, None),
        ("forbidden_integer_ties", 1, 512, 8, None),
        ("gaussian", 1, 1000, 16, 70),  # slack capacity
    ],
)
def test_compiled_equals_pytorch_at_benchmark_sizes(
    name: str, B: int, n: int, k: int, capacity: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same optimum (to the exactness tolerance) as the PyTorch path, instance by instance."""
    c = n // k if capacity is None else capacity
    scores = family(name, B, n, k, c, torch.Generator().manual_seed(n + k + B)).float()
    fast = _solve(scores, capacity, True, monkeypatch)
    plain = _solve(scores, capacity, False, monkeypatch)
    for b in range(B):
        assert torch.bincount(fast[b], minlength=k).max() <= c
        s = scores[b].double().numpy()
        tol = exactness_tol(s, scores.dtype)
        assert abs(_objective(scores[b], fast[b]) - _objective(scores[b], plain[b])) <= tol
    if n * c <= 2048 * 128:  # the Hungarian oracle on n x n at most ~2048
        check_optimal(scores[:1], fast[:1], capacity)


@HYPOTHESIS
@given(
    n=st.integers(1, 40),
    k=st.integers(3, 9),
    slack=st.integers(0, 3),
    ties=st.booleans(),
    forbidden=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**31 - 1),
)
def test_compiled_graph_is_the_graph_of_its_assignment(
    n: int, k: int, slack: int, ties: bool, forbidden: float, seed: int
) -> None:
    """The kernel returns the optimum and the (float64) expert graph that the PyTorch code builds
    for that assignment; ``rounds`` counts cancelled cycles."""
    gen = torch.Generator().manual_seed(seed)
    c = -(-n // k) + slack
    s = torch.randint(-2, 3, (2, n, k), generator=gen).float() if ties else torch.randn(2, n, k, generator=gen)
    keep = torch.rand(2, n, k, generator=gen) >= forbidden
    keep[..., 0] = True  # every token may take expert 0 ...
    if n > c:  # ... and, where expert 0 cannot take all, every expert
        keep[:] = True
    scores = s.masked_fill(~keep, float("-inf"))
    sol = solve_balanced(scores, c)
    assert sol.rounds >= 0
    check_optimal(scores, sol.expert, c)
    normalised, _ = normalise_scores(scores.clone())
    S, _, _ = _working_scores(normalised)
    expected = _graph_of(normalised if bool(torch.isinf(scores).any()) else S, sol.expert, c, release_weight(S))
    torch.testing.assert_close(sol.arc_cost, expected, rtol=0, atol=0)


def _in_subprocess(code: str, seconds: float = 120.0) -> str:
    """Run ``code`` in a fresh interpreter with a time limit (a hang fails the test instead of the suite)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=seconds)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_scores_whose_row_spread_overflows_are_solved_not_hung():
    """Audit finding: with |scores| near finfo.max the row shift overflowed to -inf, numba's "ninf"
    fastmath folded the overflow test away and the auction never ended. Truth: token 2 must take
    expert 1; tokens 0 and 1 share experts 0 and 2."""
    out = _in_subprocess(
        "import torch\n"
        "from routelab.assignment import balanced_assignment, gumbel_matching\n"
        "for dtype in (torch.float32, torch.float64):\n"
        "    M = torch.finfo(dtype).max\n"
        "    s = torch.tensor([[M, -M, -M], [M, -M, -M], [-M, M, 0.0]], dtype=dtype)\n"
        "    print(balanced_assignment(s, 1).tolist())\n"
        "    print(gumbel_matching(s, tau=0.0, capacity=1).expert.tolist())\n")
    answers = out.split()
    lines = out.strip().splitlines()
    assert len(lines) == 4 and all(line in ("[0, 2, 1]", "[2, 0, 1]") for line in lines), answers
