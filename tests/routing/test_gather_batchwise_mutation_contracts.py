"""Mutation round on gates/batchwise.py and routing/_gather.py: contracts the suite did not pin.

Batchwise gating (Shazeer et al. 2017, App. F, eq. 18-20):

* the ``r = k |X| mod n`` ceiling quotas go to the experts whose next-best score (their
  ``floor + 1``-th largest) is the largest, not their best one, and not the smallest;
* a batch smaller than ``experts / k`` (floor quota 0) still places its ``k |X|`` pairs: a batch of
  one is the row's top-k;
* ties within a column go to the earlier example at any batch size (the column sort is stable);
* thresholds of shape ``[1, experts]`` and a mask of another shape are refused, not broadcast;
* the eq. 20 loss is differentiable in the scores too (``dL/dX = M_threshold - M_batchwise``).

The gathers (their adjoint backward is forced on the CPU with ``adjoint=True`` or a monkeypatched
``_adjoint_by_default``):

* the combine's adjoint backward gives each input's gradient when only that input requires one;
* on the CPU the plain formulation is the default, and ``adjoint=False`` takes it even where the
  device default is the adjoint one;
* forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) works on both paths: the
  adjoint autograd Functions (a GPU's default) had no ``jvp`` and raised there (found by this review;
  they now have one).
"""

from __future__ import annotations

import pytest
import torch

import routelab.routing._gather as gather
from routelab.gates import batchwise_mask, batchwise_threshold_loss, threshold_mask
from routelab.routing._gather import combine_rows, dispatch_rows

# ----------------------------------------------------------------------------- batchwise (eq. 18-20)


def test_the_ceiling_quota_goes_to_the_expert_with_the_largest_next_best_score() -> None:
    """3 examples, 2 experts, k = 1: quotas 1 and 2. Expert 0's second-best score (0.8) beats
    expert 1's (0.3), so expert 0 keeps two examples, although expert 1's best score (0.95) is the
    larger one (guards the next-best read at rank ``m`` and the descending expert ranking)."""
    scores = torch.tensor([[0.90, 0.95],
                           [0.80, 0.20],
                           [0.10, 0.30]])
    mask = batchwise_mask(scores, 1)
    assert mask.tolist() == [[True, True], [True, False], [False, False]]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_batch_of_one_is_its_rows_top_k(k: int) -> None:
    """Floor quota 0, ceiling 1 (``k < experts``): the ``k`` experts with the largest (next-best =
    only) score take the example, so a batch of one is the row's top-k, never an empty mask."""
    scores = torch.tensor([[0.1, 0.4, 0.3, 0.2]])
    want = torch.zeros(1, 4, dtype=torch.bool)
    want[0, scores[0].topk(k).indices] = True
    mask = batchwise_mask(scores, k)
    assert torch.equal(mask, want)
    assert int(mask.sum()) == k


@pytest.mark.parametrize("batch", [17, 40, 101])
def test_column_ties_go_to_the_earlier_example_at_any_batch_size(batch: int) -> None:
    """All scores equal: every expert keeps the first ``m`` examples (the documented stable
    tie-break; an unstable CPU sort reorders ties from 17 rows on)."""
    experts, k = 4, 2
    scores = torch.full((batch, experts), 0.25)
    scores[::5, 1] = 0.25  # (still all equal)
    mask = batchwise_mask(scores, k)
    floor, extra = divmod(k * batch, experts)
    for e in range(experts):
        quota = floor + (1 if e < extra else 0)  # ceiling quotas to the lower expert index on ties
        want = torch.arange(batch) < quota
        assert torch.equal(mask[:, e], want), e


def test_thresholds_of_shape_one_by_experts_are_refused_not_broadcast() -> None:
    """``thresholds`` must be ``[experts]``: a ``[1, experts]`` tensor would broadcast silently."""
    scores = torch.rand(5, 3)
    with pytest.raises(ValueError, match=r"thresholds must be a tensor of shape \[experts\] = \(3,\), got \(1, 3\)"):
        threshold_mask(scores, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="thresholds must be a tensor of shape"):
        batchwise_threshold_loss(scores, torch.zeros(1, 3), batchwise_mask(scores, 1))


@pytest.mark.parametrize("shape", [(3,), (1, 3), (5, 1), (3, 5)])
def test_a_mask_of_another_shape_than_the_scores_is_refused(shape: tuple[int, ...]) -> None:
    """The eq. 20 loss needs the batchwise mask of the same batch: a mask that would broadcast
    (or a transposed one) is an error naming the shapes."""
    scores = torch.rand(5, 3)
    with pytest.raises(ValueError, match=r"mask must be a tensor with the shape of scores \(5, 3\)"):
        batchwise_threshold_loss(scores, torch.zeros(3), torch.ones(shape, dtype=torch.bool))


def test_the_threshold_loss_is_differentiable_in_the_scores() -> None:
    """Eq. 20: ``L = sum (M_thr - M_bw) (X - T)``, so ``dL/dX = M_thr - M_bw`` (0 where the masks
    agree) and ``dL/dT_i = -sum_j (M_thr - M_bw)_{j,i}`` (values by hand)."""
    scores = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.55, 0.45]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.5, 0.5], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, True], [True, True], [True, False]])
    # above = [[T, F], [F, T], [T, F]]; diff = [[1, -1], [-1, 0], [0, 0]]
    loss = batchwise_threshold_loss(scores, t, mask)
    assert float(loss.detach()) == pytest.approx(0.1 + 0.1 + 0.2)
    g_scores, g_t = torch.autograd.grad(loss, (scores, t))
    assert g_scores.tolist() == [[1.0, -1.0], [-1.0, 0.0], [0.0, 0.0]]
    assert g_t.tolist() == [0.0, 1.0]


# ----------------------------------------------------------------------------- the gathers

# 3 tokens, 2 slots, 6 rows: token 1's second pair is dropped (sentinel 6), row 5 belongs to no pair.
ROW_OF_SLOT = torch.tensor([[0, 1], [2, 6], [3, 4]])
TOKEN_OF_ROW = torch.tensor([0, 0, 1, 2, 2, 3])
N, S, R, D = 3, 2, 6, 4


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    rows = torch.randn(R, D, generator=g, dtype=torch.float64)
    weight = torch.randn(N, S, generator=g, dtype=torch.float64).masked_fill(ROW_OF_SLOT == R, 0.0)
    grad_y = torch.randn(N, D, generator=g, dtype=torch.float64)
    return x, rows, weight, grad_y


def _padded(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


def _combine_by_hand(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(N, rows.shape[1], dtype=rows.dtype)
    for t in range(N):
        for s in range(S):
            r = int(ROW_OF_SLOT[t, s])
            if r < R:
                y[t] += weight[t, s] * rows[r]
    return y


@pytest.mark.parametrize("which", ["rows", "weight"])
def test_the_adjoint_combine_gives_the_gradient_of_the_one_input_that_requires_it(which: str) -> None:
    """Only ``rows`` (or only ``weight``) requires a gradient: the adjoint backward still returns
    it, ``grad_rows[r] = w[pair of r] grad_y[token of r]`` (0 for a row of no pair) and
    ``grad_w[t, s] = <rows[row_of_slot[t, s]], grad_y[t]>`` (0 for a dropped pair)."""
    _, rows, weight, grad_y = _data(1)
    rows.requires_grad_(which == "rows")
    weight.requires_grad_(which == "weight")
    y = combine_rows(rows, weight, ROW_OF_SLOT, TOKEN_OF_ROW, adjoint=True)
    torch.testing.assert_close(y, _combine_by_hand(rows.detach(), weight.detach()), rtol=1e-12, atol=1e-12)
    (got,) = torch.autograd.grad(y, rows if which == "rows" else weight, grad_y)
    if which == "rows":
        want = torch.zeros(R, D, dtype=torch.float64)
        for t in range(N):
            for s in range(S):
                r = int(ROW_OF_SLOT[t, s])
                if r < R:
                    want[r] = weight[t, s] * grad_y[t]
    else:
        want = (_padded(rows.detach())[ROW_OF_SLOT] * grad_y.unsqueeze(1)).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _jvps(adjoint: bool | None):
    x, rows, weight, _ = _data(2)
    g = torch.Generator().manual_seed(3)
    tx, trows, tw = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (x, rows, weight))
    tw = tw.masked_fill(ROW_OF_SLOT == R, 0.0)
    out, d_out = torch.func.jvp(lambda a: dispatch_rows(a, TOKEN_OF_ROW, ROW_OF_SLOT, adjoint=adjoint), (x,), (tx,))
    torch.testing.assert_close(out, _padded(x)[TOKEN_OF_ROW], rtol=0, atol=0)
    torch.testing.assert_close(d_out, _padded(tx)[TOKEN_OF_ROW], rtol=0, atol=0)
    y, dy = torch.func.jvp(lambda a, b: combine_rows(a, b, ROW_OF_SLOT, TOKEN_OF_ROW, adjoint=adjoint),
                           (rows, weight), (trows, tw))
    torch.testing.assert_close(y, _combine_by_hand(rows, weight), rtol=1e-12, atol=1e-12)
    # The product rule: d(w r) = dw r + w dr.
    want = _combine_by_hand(rows, tw) + _combine_by_hand(trows, weight)
    torch.testing.assert_close(dy, want, rtol=1e-12, atol=1e-12)


def test_the_cpu_default_is_the_plain_formulation_which_supports_forward_mode() -> None:
    """On the CPU ``adjoint=None`` takes the plain ``index_select`` / ``bmm`` path (measured faster
    there, ``_adjoint_by_default``): its grad_fns are autograd's own, and ``torch.func.jvp`` works
    through it with the tangents of the gathers (linear maps) and the product rule."""
    x, rows, weight, _ = _data(0)
    x.requires_grad_(True)
    rows.requires_grad_(True)
    assert not gather._adjoint_by_default(x)
    names = (type(dispatch_rows(x, TOKEN_OF_ROW, ROW_OF_SLOT).grad_fn).__name__,
             type(combine_rows(rows, weight, ROW_OF_SLOT, TOKEN_OF_ROW).grad_fn).__name__)
    assert not any("Dispatch" in n or "Combine" in n for n in names), names
    _jvps(None)


def test_adjoint_false_takes_the_plain_path_where_the_default_is_adjoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """``adjoint=False`` overrides a device whose default is the adjoint gathers (a GPU, forced here):
    autograd's formulation, forward mode included."""
    monkeypatch.setattr(gather, "_adjoint_by_default", lambda t: True)
    x, rows, weight, _ = _data(0)
    x.requires_grad_(True)
    rows.requires_grad_(True)
    assert "Dispatch" in type(dispatch_rows(x, TOKEN_OF_ROW, ROW_OF_SLOT).grad_fn).__name__  # the default
    assert "Dispatch" not in type(dispatch_rows(x, TOKEN_OF_ROW, ROW_OF_SLOT, adjoint=False).grad_fn).__name__
    assert "Combine" not in type(combine_rows(rows, weight, ROW_OF_SLOT, TOKEN_OF_ROW, adjoint=False).grad_fn).__name__
    _jvps(False)


def test_the_adjoint_gathers_support_forward_mode() -> None:
    """The adjoint Functions' ``jvp``: dispatch's tangent is the gather of the input's tangent, the
    combine's the product rule, with both tangents or either alone (``forward_ad``, where the other
    input has none)."""
    import torch.autograd.forward_ad as fwAD

    _jvps(True)
    _, rows, weight, _ = _data(4)
    g = torch.Generator().manual_seed(5)
    trows, tw = torch.randn(rows.shape, generator=g, dtype=torch.float64), torch.randn(weight.shape, generator=g,
                                                                                         dtype=torch.float64)
    for tangent_of in ("rows", "weight"):
        with fwAD.dual_level():
            a = fwAD.make_dual(rows, trows) if tangent_of == "rows" else rows
            b = fwAD.make_dual(weight, tw) if tangent_of == "weight" else weight
            tangent = fwAD.unpack_dual(combine_rows(a, b, ROW_OF_SLOT, TOKEN_OF_ROW, adjoint=True)).tangent
        want = _combine_by_hand(trows, weight) if tangent_of == "rows" else _combine_by_hand(rows, tw)
        torch.testing.assert_close(tangent, want, rtol=1e-12, atol=1e-12)


def test_a_layer_on_the_gpus_gathers_has_the_plain_layers_forward_derivative(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.func.jvp`` through the MoE layer with the adjoint gathers as the default (every GPU; it
    raised NotImplementedError there) equals the same layer's on the plain path."""
    from routelab.layers import MoE

    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router="topk", k=2, capacity_factor=1.0, check_finite=False, dtype=torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64)
    v = torch.randn(10, 8, dtype=torch.float64)
    plain = torch.func.jvp(lambda a: moe(a)[0], (x,), (v,))
    monkeypatch.setattr(gather, "_adjoint_by_default", lambda t: True)
    adjoint = torch.func.jvp(lambda a: moe(a)[0], (x,), (v,))
    for got, want in zip(adjoint, plain):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
