"""Oracle tests for two summaries that feed the reports' claims, each checked against a hand or brute-force
computation rather than against the code under test:

* ``dselect.recovery``: a run's ``recovered`` / ``mistakes`` counts (``_summary``) and the identifiability
  record's ``*_best_true_count``, which decide the App. C.2.2 recovery verdicts;
* ``mae.analyses.pmi_tokens``: the ``min_count`` filter of the PMI table (Sec. 5.1 / App. C).

(Mutation review s42: RE1, RE2, RE3 and AN4 survived the existing tests.)
"""

from __future__ import annotations

import math
from itertools import combinations

import pytest
import torch
from torch.nn import functional as F

from routelab.experiments.dselect import recovery as rc
from routelab.experiments.mae.analyses import pmi_tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- dselect recovery: run summary


TRUE = [0, 1, 5, 7]


def _weights(nonzero: dict[int, float]) -> torch.Tensor:
    """A 16-expert gate weight vector with the given nonzero entries."""
    w = torch.zeros(rc.EXPERTS)
    for i, v in nonzero.items():
        w[i] = v
    return w


@pytest.mark.parametrize("nonzero, recovered, mistakes", [
    # 4 selected: {0, 1} are true, {2, 9} are not -> 2 recovered, 2 mistakes.
    ({0: 0.25, 1: 0.25, 2: 0.25, 9: 0.25}, 2, 2),
    # only 2 selected (DSelect-k's selectors may coincide), both true -> 2 recovered, no mistake; the two true
    # experts left out (5, 7) are misses, not mistakes.
    ({0: 0.5, 1: 0.5}, 2, 0),
    # 3 selected, none true -> 0 recovered, 3 mistakes.
    ({3: 0.2, 4: 0.3, 15: 0.5}, 0, 3),
])
def test_run_summary_counts_true_experts_selected_and_wrong_ones(nonzero, recovered, mistakes) -> None:
    """Module docstring of ``dselect.recovery``: "A run counts how many of the 4 true experts the trained gate
    selects (nonzero weight)". So ``recovered = |selected ∩ true|`` and ``mistakes = |selected \\ true|``, counted
    by hand for each weight vector above. The cases with fewer or other than 4 selected experts tell these apart
    from ``|selected|`` and from ``|true \\ selected|``, which coincide with them when exactly 4 are selected."""
    s = rc._summary(_weights(nonzero), TRUE)
    assert s["selected"] == sorted(nonzero)
    assert (s["recovered"], s["mistakes"]) == (recovered, mistakes)
    assert s["mass_on_true"] == pytest.approx(sum(v for i, v in nonzero.items() if i in TRUE))


# ----------------------------------------------------------------------------- dselect recovery: identifiability


def _brute_force_frozen_losses(prob: dict) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Training BCE of the equal-weight gate on every 4-set of the 16 experts with the frozen generating unit,
    straight from the definition (``itertools.combinations``, float64): the mix is the mean of the 4 experts'
    outputs, fed to the logistic unit (``head_w``, ``head_b``)."""
    sets = list(combinations(range(rc.EXPERTS), rc.TRUE_EXPERTS))
    e = rc.expert_outputs(prob, prob["x_tr"]).double()                       # [N, 16, 4]
    mix = e[:, torch.tensor(sets)].mean(2)                                   # [N, 1820, 4]
    logits = mix @ prob["head_w"].double() + float(prob["head_b"])           # [N, 1820]
    y = prob["y_tr"].double()[:, None].expand_as(logits)
    loss = F.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(0)
    return sets, loss


def test_identifiability_best_true_count_is_that_of_the_lowest_loss_set() -> None:
    """``identifiability_record``'s ``frozen_best_true_count`` is the number of true experts in the set of
    LOWEST training loss (App. C.2.2 identifiability check), here found by brute force over all C(16, 4) = 1,820
    sets. Problem 0 with 400 training points is chosen because its lowest-loss set is not the true one and not
    the first set enumerated, (0, 1, 2, 3), and these three contain different numbers of true experts; the rank,
    the true set's loss and the best loss are checked against the same brute force."""
    s = rc.RecoverySettings(reps=1, epochs=1, lrs=(0.1,), entropy_regs=(0.0,), n_train=400, n_val=10)
    prob = rc.make_problem(0, s)
    true = set(prob["true"])
    sets, loss = _brute_force_frozen_losses(prob)
    order = torch.argsort(loss)
    best = sets[int(order[0])]
    assert float(loss[order[1]] - loss[order[0]]) > 1e-9  # a unique minimum: no tie for the argmin to break
    assert set(best) != true and best != sets[0]
    assert len({len(set(best) & true), len(set(sets[0]) & true), len(true)}) == 3

    rec = rc.identifiability_record(0, s, prob, fitted=False)

    assert rec["n_sets"] == math.comb(16, 4) == len(sets)
    assert rec["frozen_best_true_count"] == len(set(best) & true)
    true_loss = float(loss[sets.index(tuple(prob["true"]))])
    assert rec["frozen_true_loss"] == pytest.approx(true_loss, rel=1e-9)
    assert rec["frozen_best_loss"] == pytest.approx(float(loss[order[0]]), rel=1e-9)
    assert rec["frozen_rank"] == 1 + int((loss < true_loss).sum())
    assert rec["fitted_best_true_count"] is None  # not fitted: the fitted fields are left empty


# ----------------------------------------------------------------------------- mae: PMI table


def test_pmi_min_count_filters_by_the_tokens_total_count_not_its_joint_count() -> None:
    """``pmi_tokens``'s ``min_count``: "ignore tokens seen fewer times", i.e. a token's count over the whole
    corpus, whichever experts it went to. Corpus of n = 59 positions (in a fixed shuffled order, shape [1, 59]):

    * "a" 20 times: 19 attributed to expert 0, 1 to expert 1 (total 20 = min_count: kept for both experts,
      although each joint count is below 20);
    * "b" 20 times, all to expert 1 (kept);
    * "c" 19 times, all to expert 0 (total 19 < min_count: left out, although "c" is expert 0's most
      indicative token by PMI).

    Expert counts: e0 = 19 + 19 = 38, e1 = 1 + 20 = 21. PMI = log(c · n / (count(tok) · count(e))), by hand:
    a|e0 = log(19·59 / (20·38)), b|e1 = log(20·59 / (20·21)), a|e1 = log(1·59 / (20·21))."""
    ids = [0] * 19 + [0] + [1] * 20 + [2] * 19
    experts = [0] * 19 + [1] + [1] * 20 + [0] * 19
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor(ids)[perm].reshape(1, -1)
    # gates: the attributed expert gets 0.7, the other 0.3 (argmax attribution, Sec. 5.1)
    gates = (0.3 + 0.4 * F.one_hot(torch.tensor(experts), 2).float())[perm].reshape(1, -1, 2)

    out = pmi_tokens(tokens, gates, ["a", "b", "c"], min_count=20, top=5)

    assert len(out) == 2
    assert [(t, c) for t, _, c in out[0]] == [("a", 19)]
    assert out[0][0][1] == pytest.approx(math.log(19 * 59 / (20 * 38)))
    assert [(t, c) for t, _, c in out[1]] == [("b", 20), ("a", 1)]  # sorted by PMI, descending
    assert [p for _, p, _ in out[1]] == pytest.approx([math.log(59 / 21), math.log(59 / (20 * 21))])
    # one occurrence fewer than min_count drops "c"; at min_count=19 it is back, first for expert 0
    low = pmi_tokens(tokens, gates, ["a", "b", "c"], min_count=19, top=5)
    assert [t for t, _, _ in low[0]] == ["c", "a"]
    assert low[0][0][1] == pytest.approx(math.log(19 * 59 / (19 * 38)))
