"""The peer table's correctness checks (routelab.bench.peers), judged against scipy's optimum.

The benchmark reports, for every peer, whether its answers were feasible (every token on one
expert in ``[0, k)``, no expert above its capacity ``n / k``) on *every* instance, and its largest
optimality gap over the instances; the batched row says "same optimum" only when every answer
agrees with routelab's. Independent truth here is :func:`scipy.optimize.linear_sum_assignment` on
the column-expanded problem (each expert repeated ``n / k`` times) and assignments built by hand.
The exact peers POT and OR-Tools are optional (the ``bench`` extra): a test of one that is not
installed is skipped, naming the package. Also :func:`routelab.machine.cpu_model`, which heads
every benchmark table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from routelab import machine
from routelab.bench import peers

N, K = 32, 4  # tiny instances: capacity 8


def _instance(seed: int, n: int = N, k: int = K) -> torch.Tensor:
    """Instance ``seed`` of the peer table (the module docstring: ``torch.randn(n, k)`` from seed i)."""
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _scipy_optimum(s: torch.Tensor) -> np.ndarray:
    """The optimal balanced assignment of ``s [n, k]`` (capacity ``n / k``) by scipy, as ``[n]`` experts."""
    n, k = s.shape
    c = n // k
    rows, cols = linear_sum_assignment(np.repeat(s.double().numpy(), c, axis=1), maximize=True)
    z = np.empty(n, dtype=np.int64)
    z[rows] = cols // c
    return z


def _objective(s: torch.Tensor, z: np.ndarray) -> float:
    return float(s.double().numpy()[np.arange(len(z)), z].sum())


def _is_instance(s: torch.Tensor, seed: int) -> bool:
    return tuple(s.shape) == (N, K) and torch.equal(s, _instance(seed))


def _peer(name: str, solve: Any, exact: bool = False) -> peers.Peer:
    """A peer that gets the scores themselves (no preparation)."""
    return peers.Peer(name, exact, lambda s: s, solve)


def _round_robin(s: torch.Tensor) -> np.ndarray:
    """Token t to expert t mod k: feasible (exactly n / k each), far from optimal."""
    return np.arange(s.shape[0]) % s.shape[1]


# ------------------------------------------------------------------ feasibility of one answer


def test_feasible_means_every_token_placed_in_range_and_no_expert_over_capacity() -> None:
    """Hand-built answers for n = 32, k = 4 (capacity 8): balanced passes; one token moved to an
    expert already holding 8, a -1 (OR-Tools' unassigned token), an expert id k, or a short answer fail."""
    z = np.arange(N) % K
    assert peers._feasible(z, N, K)
    assert peers._feasible(np.sort(z), N, K)
    one_over = z.copy()
    one_over[0] = 1  # expert 1 holds 9, expert 0 holds 7
    assert np.bincount(one_over, minlength=K).tolist() == [7, 9, 8, 8]
    assert not peers._feasible(one_over, N, K)
    unassigned = z.copy()
    unassigned[0] = -1  # every expert still within capacity: only the -1 is wrong
    assert not peers._feasible(unassigned, N, K)
    out_of_range = z.copy()
    out_of_range[0] = K
    assert not peers._feasible(out_of_range, N, K)
    assert not peers._feasible(z[:-1], N, K)


# ---------------------------------------------------------------- the table's per-peer verdicts


def test_one_token_over_capacity_is_infeasible_and_does_not_set_the_best() -> None:
    """A peer returns scipy's optimum with one token moved to the expert it prefers most (that expert
    then holds 9 > 8): its objective is above the optimum. It must be reported infeasible, and the
    gaps measured against the best *feasible* answer, so routelab (exact) keeps gap 0."""
    moved = []

    def one_over(s: torch.Tensor) -> np.ndarray:
        z = _scipy_optimum(s)
        gain = s.double().numpy() - s.double().numpy()[np.arange(N), z][:, None]
        t, e = np.unravel_index(gain.argmax(), gain.shape)
        assert gain[t, e] > 0  # a random instance always has a token that would rather be elsewhere
        z[t] = e
        moved.append(np.bincount(z, minlength=K).max())
        return z

    res = peers._measure_size(N, K, 2, [_peer("one over", one_over)], {})
    assert moved and all(m == N // K + 1 for m in moved)
    assert not res.cells["one over"].feasible
    assert res.cells["routelab"].feasible and res.cells["routelab"].gap <= peers.EXACT_RTOL


def test_an_unassigned_token_is_infeasible_not_a_crash() -> None:
    """OR-Tools marks a token it did not route with -1: the table must say INFEASIBLE for that peer
    (and go on measuring), not crash counting the experts' loads."""
    def minus_one(s: torch.Tensor) -> np.ndarray:
        z = _scipy_optimum(s)
        z[0] = -1
        return z

    res = peers._measure_size(N, K, 2, [_peer("minus one", minus_one)], {})
    assert not res.cells["minus one"].feasible
    assert res.cells["routelab"].feasible and res.cells["routelab"].gap <= peers.EXACT_RTOL


def test_feasibility_is_judged_on_every_instance() -> None:
    """A peer over capacity on instance 0 only (greedy: every token to its best expert) and exact
    (scipy) on instance 1 is infeasible: one bad instance is enough, whichever comes last."""
    greedy_on = []

    def greedy_on_first(s: torch.Tensor) -> np.ndarray:
        if _is_instance(s, 0):
            z = s.argmax(-1).numpy()
            greedy_on.append(np.bincount(z, minlength=K).max() > N // K)
            return z
        return _scipy_optimum(s)

    res = peers._measure_size(N, K, 2, [_peer("greedy on 0", greedy_on_first)], {})
    assert greedy_on and all(greedy_on)  # instance 0 was solved, and greedy was over capacity there
    assert not res.cells["greedy on 0"].feasible
    # the same peer exact on every instance is feasible with gap 0 (the check is not blanket)
    res = peers._measure_size(N, K, 2, [_peer("exact", _scipy_optimum)], {})
    assert res.cells["exact"].feasible and res.cells["exact"].gap <= peers.EXACT_RTOL


def test_a_suboptimal_peer_shows_its_largest_gap() -> None:
    """Round robin is feasible and far from optimal; its gap is the largest over the instances of
    ``(optimum - objective) / |optimum|``, the optimum from scipy."""
    runs = 3
    res = peers._measure_size(N, K, runs, [_peer("round robin", _round_robin)], {})
    gaps = []
    for i in range(runs):
        s = _instance(i)
        best = _objective(s, _scipy_optimum(s))
        gaps.append((best - _objective(s, _round_robin(s))) / abs(best))
    cell = res.cells["round robin"]
    assert cell.feasible
    assert min(gaps) > 0.1 and max(gaps) > min(gaps)  # the largest differs from the smallest
    assert cell.gap == pytest.approx(max(gaps), rel=1e-9)
    assert peers._gap(cell.gap) != "0"


# ------------------------------------------------------------------------- the real exact peers


def _installed_peer(name: str, module: str, package: str) -> peers.Peer:
    pytest.importorskip(module, reason=f"the {name} peer needs {package} (the bench extra)")
    found = {p.name: p for p in peers.peers()[0]}
    assert name in found, (name, sorted(found))
    return found[name]


EXACT_PEERS = [
    ("POT ot.emd", "ot", "POT (pip install pot)"),
    ("OR-Tools min-cost flow", "ortools.graph.python.min_cost_flow", "OR-Tools (pip install ortools)"),
    ("scipy LSA", "scipy.optimize", "scipy"),
]


@pytest.mark.parametrize(("name", "module", "package"), EXACT_PEERS, ids=[p[0] for p in EXACT_PEERS])
def test_an_exact_peer_reaches_scipys_optimum(name: str, module: str, package: str) -> None:
    """Each exact peer, run as the table runs it (``solve(prepare(scores))``), returns a feasible
    answer with scipy's optimal objective (to the table's 1e-6; OR-Tools rounds the costs to 2^-24 of
    the largest), and its table cell shows gap 0; a peer maximising the wrong sign would not."""
    peer = _installed_peer(name, module, package)
    assert peer.exact
    for seed in range(3):
        s = _instance(seed)
        z = np.asarray(peer.solve(peer.prepare(s)), dtype=np.int64)
        assert z.shape == (N,) and z.min() >= 0 and z.max() < K
        assert np.bincount(z, minlength=K).tolist() == [N // K] * K
        best = _objective(s, _scipy_optimum(s))
        assert _objective(s, z) == pytest.approx(best, rel=peers.EXACT_RTOL), (name, seed)
    cell = peers._measure_size(N, K, 2, [peer], {}).cells[name]
    assert cell.feasible and cell.gap <= peers.EXACT_RTOL and peers._gap(cell.gap) == "0"


# ------------------------------------------------------------------------------ the batched row


def _batched_same_optimum(monkeypatch: pytest.MonkeyPatch, solve: Any) -> str:
    """The batched row's "same optimum" cell for a peer ``solve`` on 3 instances of (32, 4)."""
    monkeypatch.setattr(peers, "BATCH", (3, N, K))
    lines = peers._batched([_peer("probe", solve, exact=True)], "probe", 1)
    row = [line for line in lines if line.startswith("| probe, 3 calls |")]
    assert len(row) == 1, lines
    return row[0].strip("|").split("|")[-1].strip()


def test_batched_row_says_same_optimum_only_when_the_answers_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """scipy's optimum on every instance: "yes"; round robin (feasible, suboptimal): "no"."""
    assert _batched_same_optimum(monkeypatch, _scipy_optimum) == "yes"
    assert _batched_same_optimum(monkeypatch, _round_robin) == "no"


def test_batched_row_says_no_when_routelabs_answer_is_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal objectives are not enough: if routelab's batched answer were infeasible (a stand-in
    putting every token on expert 0), a peer answering the same is no "same optimum"."""
    def all_on_expert_0(s: torch.Tensor) -> np.ndarray:
        return np.zeros(s.shape[0], dtype=np.int64)

    monkeypatch.setattr(peers, "balanced_assignment", lambda scores: torch.zeros(scores.shape[:-1], dtype=torch.long))
    assert _batched_same_optimum(monkeypatch, all_on_expert_0) == "no"


# ------------------------------------------------------------------------------ the CPU's name


class _FakeCpuinfo:
    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)

    def __enter__(self) -> list[str]:
        return self.lines

    def __exit__(self, *exc: object) -> None:
        return None


def test_cpu_model_is_the_value_of_the_model_name_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The text after the first ':' of /proc/cpuinfo's first ``model name`` line, stripped (a ':' in
    the name itself stays); the table header prints it after "CPU:"."""
    cpuinfo = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) CPU: test @ 2.20GHz\n"
               "processor\t: 1\nmodel name\t: another\n")
    opened = []

    def fake_open(path: str, *args: object, **kwargs: object) -> _FakeCpuinfo:
        opened.append(path)
        return _FakeCpuinfo(cpuinfo)

    monkeypatch.setattr(machine, "open", fake_open, raising=False)
    assert machine.cpu_model() == "Intel(R) Xeon(R) CPU: test @ 2.20GHz"
    assert opened == ["/proc/cpuinfo"]
    assert "- CPU: Intel(R) Xeon(R) CPU: test @ 2.20GHz (" in "\n".join(peers._header("t", 1))


def test_cpu_model_on_this_machine() -> None:
    """Against this machine's /proc/cpuinfo read here (skipped where it has no ``model name`` line)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            names = [line.partition(":")[2].strip() for line in f if line.lower().startswith("model name")]
    except OSError:
        names = []
    if not names:
        pytest.skip("no /proc/cpuinfo with a 'model name' line on this machine")
    assert machine.cpu_model() == names[0]
    assert not machine.cpu_model().lower().startswith("model name")

