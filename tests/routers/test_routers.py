"""Routers against independent truth: App. F masks, noisy top-k load, BASE optimality, estimators."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from routelab.gates import batchwise_mask, batchwise_threshold_loss, threshold_mask
from routelab.routers import (
    ROUTERS,
    BASERouter,
    BatchwiseRouter,
    GumbelMatchingRouter,
    NoisyTopKRouter,
    SinkhornRouter,
    TopKRouter,
    make_router,
)
from routelab.routers.base import proposes_every_slot
from routelab.routers.losses import cv_squared, noisy_topk_load

D = 6

# ---------------------------------------------------------------- App. F functional forms


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 24), E=st.integers(1, 8), k=st.integers(1, 8), ties=st.booleans(), seed=st.integers(0, 99))
def test_batchwise_mask_keeps_exactly_the_top_m_per_expert(batch, E, k, ties, seed) -> None:
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, E, generator=g)
    if ties:
        scores = (scores * 3).floor() / 3  # many equal values
    m = k * batch // E
    mask = batchwise_mask(scores, k)
    if (k * batch) % E:  # quotas floor(m) / ceil(m): the extra examples go to the best next scores
        counts = mask.sum(0)
        assert mask.dtype == torch.bool and ((counts == m) | (counts == m + 1)).all(), counts
        best_next = scores.sort(0, descending=True).values[m]  # each expert's (m+1)-th score
        if (counts == m).any() and (counts == m + 1).any():
            assert best_next[counts == m + 1].min() >= best_next[counts == m].max()
    else:
        assert mask.dtype == torch.bool and (mask.sum(0) == m).all(), "every expert gets exactly m examples"
    assert int(mask.sum()) == k * batch, "an average of k experts per example"
    for i in range(E):  # brute force: every kept value >= every dropped value in the column
        kept, dropped = scores[mask[:, i], i], scores[~mask[:, i], i]
        if kept.numel() and dropped.numel():
            assert kept.min() >= dropped.max()
        # ties go to the earlier example
        for j in range(batch):
            if not mask[j, i] and kept.numel():
                later_equal_kept = [jj for jj in range(j + 1, batch) if mask[jj, i] and scores[jj, i] == scores[j, i]]
                assert not later_equal_kept


def test_threshold_mask_and_loss_match_eq_19_20_by_loops() -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.rand(8, 4, generator=g)
    T = torch.rand(4, generator=g)
    M = batchwise_mask(X, 2)
    thr = threshold_mask(X, T)
    loss = 0.0
    for j in range(8):
        for i in range(4):
            assert bool(thr[j, i]) == bool(X[j, i] > T[i])
            loss += (float(X[j, i] > T[i]) - float(M[j, i])) * float(X[j, i] - T[i])
    assert loss >= 0
    assert batchwise_threshold_loss(X, T, M).item() == pytest.approx(loss, rel=1e-6, abs=1e-7)


def test_threshold_loss_gradient_moves_thresholds_toward_agreement() -> None:
    X = torch.tensor([[0.9, 0.1], [0.6, 0.2], [0.3, 0.8], [0.2, 0.7]])
    M = batchwise_mask(X, 1)  # expert 0 keeps rows 0,1; expert 1 rows 2,3
    T = torch.tensor([0.1, 0.9], requires_grad=True)  # expert 0 too low, expert 1 too high
    batchwise_threshold_loss(X, T, M).backward()
    assert T.grad[0] < 0 and T.grad[1] > 0  # gradient descent raises T_0, lowers T_1


def test_functional_gates_reject_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[batch, experts\]"):
        batchwise_mask(torch.rand(4), 1)
    with pytest.raises(ValueError, match="k must be an integer"):
        batchwise_mask(torch.rand(4, 2), 3)
    with pytest.raises(ValueError, match="NaN"):
        batchwise_mask(torch.full((4, 2), float("nan")), 1)
    with pytest.raises(ValueError, match="thresholds"):
        threshold_mask(torch.rand(4, 2), torch.rand(3))
    with pytest.raises(ValueError, match="mask"):
        batchwise_threshold_loss(torch.rand(4, 2), torch.rand(2), torch.ones(3, 2, dtype=torch.bool))


def test_learned_thresholds_agree_with_the_batchwise_mask() -> None:
    """Train T on a fixed score distribution: >= 95% agreement with the batchwise mask (App. F)."""
    g = torch.Generator().manual_seed(0)
    E, k, batch = 8, 2, 256
    centre = torch.randn(E, generator=g)  # experts differ in how high they score

    def scores() -> torch.Tensor:
        return torch.softmax(centre + 1.5 * torch.randn(batch, E, generator=g), -1)

    T = torch.full((E,), 1.0 / E, requires_grad=True)
    opt = torch.optim.Adam([T], lr=1e-2)
    for _ in range(300):
        X = scores()
        loss = batchwise_threshold_loss(X, T, batchwise_mask(X, k)) / batch
        opt.zero_grad()
        loss.backward()
        opt.step()
    agree = []
    for _ in range(20):
        X = scores()
        agree.append((threshold_mask(X, T.detach()) == batchwise_mask(X, k)).float().mean())
    assert float(torch.stack(agree).mean()) >= 0.95


def test_batchwise_router_training_and_inference_masks() -> None:
    torch.manual_seed(0)
    router = BatchwiseRouter(D, 4, k=2)
    x = torch.randn(16, D)
    r = router(x)
    assert (r.keep.sum(0) == 8).all(), "training: every expert exactly k*batch/E tokens"
    torch.testing.assert_close(r.gate.sum(-1)[r.keep.any(-1)], torch.ones(int(r.keep.any(-1).sum())))
    assert "threshold" in r.aux and r.aux["threshold"].requires_grad
    router.eval()
    r1 = router(x[:1])  # batch size 1 works with the threshold mask
    probs = torch.softmax(x[:1] @ router.proj.weight.t(), -1)
    assert torch.equal(r1.keep, probs > router.thresholds.detach())
    router.inference = "batchwise"
    assert (router(x).keep.sum(0) == 8).all()


# ---------------------------------------------------------------- noisy top-k


def test_noisy_topk_load_estimator_is_unbiased_for_the_expected_load() -> None:
    """App. A: E_noise[sum_x P(x, i)] equals the expected number of tokens routed to expert i."""
    g = torch.Generator().manual_seed(0)
    n, E, k = 20, 5, 2
    clean = torch.randn(n, E, generator=g)
    std = torch.rand(n, E, generator=g) + 0.3
    est, actual = torch.zeros(E), torch.zeros(E)
    draws = 4000
    for _ in range(draws):
        noisy = clean + torch.randn(n, E, generator=g) * std
        top_values, top_index = noisy.topk(k + 1, -1)
        est += noisy_topk_load(clean, noisy, std, top_values, k)
        actual += torch.zeros(E).scatter_add_(0, top_index[:, :k].reshape(-1), torch.ones(n * k))
    est, actual = est / draws, actual / draws
    torch.testing.assert_close(est, actual, rtol=0.05, atol=0.1)


def test_noisy_topk_losses_and_noise() -> None:
    torch.manual_seed(0)
    router = NoisyTopKRouter(D, 6, k=2)
    assert not router.proj.weight.detach().any() and not router.noise.weight.detach().any()
    router.generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, D)
    r = router(x)
    assert set(r.aux) == {"importance", "load"}
    torch.testing.assert_close(r.gate.sum(-1), torch.ones(32))
    # With zero weights every logit ties: only the noise spreads tokens over experts.
    assert len(torch.unique(r.expert)) == 6
    router.eval()
    r_eval = router(x)
    assert len(torch.unique(r_eval.expert[:, 0])) == 1  # no noise at inference


def test_cv_squared() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert float(cv_squared(x)) == pytest.approx(float(np.var(x.numpy()) / np.mean(x.numpy()) ** 2), rel=1e-6)
    assert float(cv_squared(torch.ones(5))) == 0.0


# ---------------------------------------------------------------- balanced routers


def test_base_router_is_the_optimal_balanced_assignment() -> None:
    torch.manual_seed(0)
    n, E = 12, 3
    router = BASERouter(D, E)
    x = torch.randn(n, D)
    r = router(x, capacity=n // E)
    logits = (x @ router.proj.weight.t()).detach().double().numpy()
    rows, cols = linear_sum_assignment(np.repeat(logits, n // E, axis=1), maximize=True)  # scipy oracle
    best = np.repeat(logits, n // E, axis=1)[rows, cols].sum()
    ours = logits[np.arange(n), r.expert[:, 0].numpy()].sum()
    assert ours == pytest.approx(best, abs=1e-9)
    assert (torch.bincount(r.expert[:, 0], minlength=E) == n // E).all()
    torch.testing.assert_close(
        r.gate[:, 0], torch.sigmoid(torch.from_numpy(logits[np.arange(n), r.expert[:, 0].numpy()])).float()
    )
    router.eval_balanced = False
    router.eval()
    assert torch.equal(router(x).expert[:, 0], torch.from_numpy(logits.argmax(-1)))


def test_sinkhorn_router_balances_the_choice() -> None:
    torch.manual_seed(0)
    n, E = 512, 8
    x = torch.randn(n, D) + 2.0  # a shared offset makes plain top-1 unbalanced
    sk = SinkhornRouter(D, E, k=1, sweeps=50)
    top = TopKRouter(D, E, k=1)
    top.proj.weight.data.copy_(sk.proj.weight.data)
    load_sk = torch.bincount(sk(x).expert[:, 0], minlength=E).float()
    load_top = torch.bincount(top(x).expert[:, 0], minlength=E).float()
    assert float(cv_squared(load_sk)) < 0.1 * float(cv_squared(load_top))
    sk.eval()
    assert torch.equal(sk(x).expert, top(x).expert), "inference without balancing is plain top-k"


def test_gumbel_matching_router_is_balanced_and_weighted() -> None:
    torch.manual_seed(0)
    n, E = 16, 4
    router = GumbelMatchingRouter(D, E, tau=0.5)
    router.generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, D)
    r = router(x, capacity=n // E)
    assert (torch.bincount(r.expert[:, 0], minlength=E) == n // E).all()
    assert (r.weight > 0).all() and not r.weight.requires_grad
    probs = torch.softmax(x @ router.proj.weight.t(), -1)
    torch.testing.assert_close(r.gate[:, 0], probs.gather(-1, r.expert)[:, 0])


def test_gumbel_matching_router_is_the_estimator_of_sample_routes() -> None:
    """The router draws exactly what sample_routes draws (whose unbiasedness test_estimators checks)."""
    from routelab.estimators import sample_routes

    torch.manual_seed(0)
    n, E = 12, 3
    x = torch.randn(n, D)
    for method in ("gumbel_matching_iw", "sample_skip_iw", "gumbel_matching"):
        router = GumbelMatchingRouter(D, E, tau=0.7, method=method)
        router.generator = torch.Generator().manual_seed(5)
        r = router(x, capacity=n // E)
        ref = sample_routes(x @ router.proj.weight.t(), method, tau=0.7, capacity=n // E,
                            generator=torch.Generator().manual_seed(5))
        assert ref.num_slots == 1  # both records are [tokens, 1]
        assert torch.equal(r.expert, ref.expert) and torch.equal(r.keep, ref.keep)
        torch.testing.assert_close(r.weight, ref.weight)
        torch.testing.assert_close(r.log_prob, ref.log_prob)


@pytest.mark.parametrize(("name", "argument"), [
    ("topk", "balance_coef"), ("noisy_topk", "importance_coef"), ("noisy_topk", "load_coef"),
    ("noisy_topk", "noise_epsilon"), ("softmax", "importance_coef"), ("batchwise", "threshold_coef"),
    ("sinkhorn", "balance_coef"), ("gumbel_matching", "balance_coef"),
])
def test_loss_coefficients_are_checked_at_construction(name: str, argument: str) -> None:
    """A NaN, infinite, negative or non-numeric coefficient is refused naming the argument (it
    made the auxiliary loss NaN or negative, or failed in the forward blaming the input)."""
    if argument not in inspect.signature(ROUTERS[name].__init__).parameters:
        pytest.skip(f"{name} has no {argument}")
    k = 1 if name in ("softmax", "gumbel_matching") else 2
    kwargs = {} if name == "softmax" else {"k": k}
    bad = [float("nan"), float("inf"), -1.0, "0.1", True]
    if argument == "noise_epsilon":
        bad.append(0.0)
    for value in bad:
        with pytest.raises(ValueError, match=argument):
            make_router(name, D, 4, **kwargs, **{argument: value})
    for number in (np.float32(0.5), torch.tensor(0.5)):  # numpy scalars and 0-dim tensors are numbers
        router = make_router(name, D, 4, **kwargs, **{argument: number})
        assert getattr(router, argument) == 0.5 and isinstance(getattr(router, argument), float)


def test_make_router_validation() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        make_router("top2", D, 4)
    with pytest.raises(ValueError, match="top-1"):
        make_router("switch", D, 4, k=2)
    with pytest.raises(ValueError, match="k=0|positive integer"):
        make_router("topk", D, 4, k=0)
    with pytest.raises(ValueError, match="unknown method"):
        GumbelMatchingRouter(D, 4, method="nope")
    with pytest.raises(ValueError, match="tau"):
        GumbelMatchingRouter(D, 4, tau=0.0)
    with pytest.raises(ValueError, match="inference"):
        BatchwiseRouter(D, 4, inference="nope")
    with pytest.raises(ValueError, match="sweeps"):
        SinkhornRouter(D, 4, sweeps=0)
    with pytest.raises(ValueError, match="capacity_factor >= 1"):
        BASERouter(D, 4)(torch.randn(9, D), capacity=2)


def test_router_name_spellings() -> None:
    assert isinstance(make_router("noisy-topk", D, 4), NoisyTopKRouter)
    assert isinstance(make_router("Top_K", D, 4, k=2), TopKRouter)
    assert isinstance(make_router("gumbel-matching", D, 4), GumbelMatchingRouter)


def test_base_router_old_name_is_a_deprecated_alias() -> None:
    import routelab.routers as routers

    with pytest.warns(DeprecationWarning, match="BASERouter"):
        old = routers.BaseRouter
    assert old is BASERouter and routers.ROUTERS["base"] is BASERouter
    with pytest.warns(DeprecationWarning):
        from routelab.routers.balanced import BaseRouter  # noqa: F401


ROUTER_VARIANTS = [(name, {}) for name in sorted(ROUTERS)] + [
    ("gumbel_matching", {"method": method}) for method in ("sample", "sample_skip", "sample_skip_iw")]
VARIANT_IDS = [f"{name}-{kw['method']}" if kw else name for name, kw in ROUTER_VARIANTS]


@pytest.mark.parametrize(("name", "kw"), ROUTER_VARIANTS, ids=VARIANT_IDS)
def test_proposes_every_slot_is_true_only_for_routers_that_do(name, kw):
    """The flag lets a patched transformers block skip a host sync, so it must never be wrong: a
    router that sets it proposes every slot in training and eval, on skewed and tied scores."""
    torch.manual_seed(0)
    router = make_router(name, 16, 8, k=None if name in ("switch", "gumbel_matching", "base", "softmax") else 2, **kw)
    for train in (True, False):
        router.train(train)
        for x in (torch.randn(24, 16), torch.randn(24, 16) * 30, torch.zeros(24, 16)):
            keep = router(x, 6).keep
            if router.proposes_every_slot:
                assert bool(keep.all()), (name, train)
    assert make_router("batchwise", 16, 8, k=2).proposes_every_slot is False
    assert proposes_every_slot(router) == router.proposes_every_slot


def test_a_subclass_that_reroutes_is_not_trusted_to_propose_every_slot():
    """A TopKRouter subclass that drops slots in its own route() inherits the class flag; the
    reading function does not trust it unless the subclass declares it again."""

    class Dropping(TopKRouter):
        def route(self, logits, capacity):
            routes = super().route(logits, capacity)
            return dataclasses.replace(routes, keep=routes.keep & (logits.argmax(-1, keepdim=True) > 0))

    class Declared(Dropping):
        proposes_every_slot = True

    assert proposes_every_slot(TopKRouter(8, 4, k=2))
    assert not Dropping(8, 4, k=2)(torch.randn(32, 8)).keep.all()  # it does drop
    assert not proposes_every_slot(Dropping(8, 4, k=2))
    assert proposes_every_slot(Declared(8, 4, k=2))
    assert not proposes_every_slot(BatchwiseRouter(8, 4, k=2))


def test_proposes_every_slot_distrusts_whatever_could_change_the_routing():
    class ByProperty(TopKRouter):
        @property
        def proposes_every_slot(self):
            return False

    class Called(TopKRouter):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    assert not proposes_every_slot(ByProperty(8, 4, k=2))
    assert not proposes_every_slot(Called(8, 4, k=2))
    opted_out = TopKRouter(8, 4, k=2)
    opted_out.proposes_every_slot = False
    assert not proposes_every_slot(opted_out)
    rerouted = TopKRouter(8, 4, k=2)
    rerouted.route = lambda logits, capacity: None
    assert not proposes_every_slot(rerouted)
    hooked = TopKRouter(8, 4, k=2)
    handle = hooked.register_forward_hook(lambda module, args, out: out)
    assert not proposes_every_slot(hooked)
    handle.remove()
    assert proposes_every_slot(hooked)


def test_an_option_a_router_does_not_take_is_named_with_those_it_does():
    """A review case: an unknown router_kwargs key was the constructor's TypeError, naming neither
    router_kwargs nor the options; also through MoE and patch_moe, which build routers by name."""
    from routelab.layers import MoE
    from routelab.routers import router_options

    assert router_options("noisy_topk") == ("importance_coef", "load_coef", "noise_epsilon")
    with pytest.raises(ValueError, match=r"router 'topk' takes no option 'zzz' \(router_kwargs\); its options: "
                                         r"renormalize, balance_coef"):
        make_router("topk", 8, 4, k=2, zzz=1)
    with pytest.raises(ValueError, match="router 'noisy_topk' takes no option 'balance_coef'"):
        MoE(8, 16, 4, router="noisy_topk", router_kwargs={"balance_coef": 0.1})
