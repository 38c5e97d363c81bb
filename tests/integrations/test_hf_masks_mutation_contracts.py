"""Contracts of routelab.integrations.hf_masks (how patch_moe carries a call's attention mask to the
patched gates) that the other integration tests left unchecked, found by a mutation review of
hf_masks.py (each test here fails on a mutant the rest of the suite let through).

* Sources: a module taking ``attention_mask`` and only one of ``input_ids`` / ``inputs_embeds`` is a
  source; only a 2-D mask is a padding mask; the innermost call in progress decides; a call that
  returns pops what was left above it, and a source re-entered after an interrupted call drops the
  stale entry.
* The block's tokens: a token count that is no multiple of the batch is routed whole, with a warning.
* Recomputation: a tensor given to a carrier twice under equal masks is not ambiguous; a forward
  forgets the previous backward's recomputed call; copies and pickles start with no records.

Independent truths: hand-built masks (the real tokens are known by construction), the docstrings'
contracts, an unpatched block, and ``pickle`` itself. Recomputation is simulated by calling the hooks
inside a backward pass (a tensor hook), where ``routelab.replay.in_backward`` is true.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from routelab.integrations.hf_masks import CallMasks, mask_sources, takes_attention_mask

pytest.importorskip("transformers")

from test_hf_contracts import D, K, ids, left_padded, mixtral  # noqa: E402 (after the importorskip)


def routed_pairs(model: nn.Module, name: str) -> int:
    import routelab

    return int(routelab.routing_stats(model)[name]["tokens_per_expert"].sum())


def enter(masks: CallMasks, module: nn.Module, mask: torch.Tensor | None, seq: int = 4) -> None:
    """A source call of ``module`` with ``attention_mask=mask`` and ``input_ids [batch, seq]``."""
    batch = 2 if mask is None else mask.shape[0]
    masks.enter_call(module, (), {"attention_mask": mask, "input_ids": torch.zeros(batch, seq, dtype=torch.long)})


def in_backward(fn):
    """Run ``fn()`` inside a backward pass (where checkpointing recomputes) and return its result."""
    out = []
    x = torch.ones(1, requires_grad=True)
    y = x * 1.0
    y.register_hook(lambda grad: out.append(fn()))
    y.sum().backward()
    return out[0]


def record_forward(masks: CallMasks, source: nn.Module, carrier: nn.Module, mask: torch.Tensor,
                   inputs: tuple, kwargs: dict | None = None) -> None:
    """One source call under ``mask`` in which ``carrier`` receives ``inputs`` (and ``kwargs``)."""
    enter(masks, source, mask)
    masks.enter_carrier(carrier, inputs, kwargs or {})
    masks.leave_call(source, (), None)


def recomputed_tokens(masks: CallMasks, carrier: nn.Module, inputs: tuple, kwargs: dict | None = None,
                      *, quiet: bool = False) -> torch.Tensor | None:
    """The real-token mask a recomputation of ``carrier`` on ``inputs`` routes under (inside a
    backward pass); ``quiet``: any warning (e.g. "ambiguous") is an error."""
    def recompute():
        masks.enter_carrier(carrier, inputs, kwargs or {})
        return masks.tokens(8)

    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("error")
        return in_backward(recompute)


MASK_A = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
MASK_B = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])


# -- sources ----------------------------------------------------------------------------------------


def test_a_module_that_takes_a_mask_and_either_input_is_a_source():
    """takes_attention_mask: ``attention_mask`` and ``input_ids`` *or* ``inputs_embeds`` (a model that
    takes only one of them is still a source). Oracle: the signatures, built by hand."""

    class IdsOnly(nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    class EmbedsOnly(nn.Module):
        def forward(self, inputs_embeds, attention_mask=None):
            return inputs_embeds

    class MaskOnly(nn.Module):
        def forward(self, hidden_states, attention_mask=None):
            return hidden_states

    assert takes_attention_mask(IdsOnly()) and takes_attention_mask(EmbedsOnly())
    assert not takes_attention_mask(MaskOnly())
    root = nn.Module()
    root.a, root.b, root.c = IdsOnly(), EmbedsOnly(), MaskOnly()
    assert mask_sources(root) == [root, root.a, root.b]


def test_only_a_two_dimensional_attention_mask_is_a_padding_mask():
    """A call with a 4-D attention mask (an additive ``[batch, 1, q, k]`` mask a user built) carries no
    padding mask: every token is routed, instead of reading the 4-D tensor as ``[batch, positions]``."""
    masks = CallMasks()
    source = nn.Module()
    four_d = torch.zeros(2, 1, 4, 4)
    four_d[1, :, :, 0] = float("-inf")
    enter(masks, source, four_d)
    assert masks.current().value is None
    assert masks.tokens(8) is None


def test_the_innermost_call_in_progress_decides():
    """The gates route under the innermost source call in progress (a wrapper's call around the
    model's): its mask, not the outer call's. Oracle: the masks, by hand."""
    masks = CallMasks()
    outer, inner = nn.Module(), nn.Module()
    enter(masks, outer, MASK_A)
    enter(masks, inner, MASK_B)
    assert torch.equal(masks.tokens(8), MASK_B.reshape(-1).bool())
    masks.leave_call(inner, (), None)
    assert torch.equal(masks.tokens(8), MASK_A.reshape(-1).bool())
    masks.leave_call(outer, (), None)
    assert masks.tokens(8) is None


def test_a_call_that_returns_pops_the_calls_left_above_it():
    """leave_call pops its call *and any left above it* (an inner call interrupted by a
    KeyboardInterrupt, which skips the forward hooks): once the outer call returns, no mask is left."""
    masks = CallMasks()
    outer, inner = nn.Module(), nn.Module()
    enter(masks, outer, MASK_A)
    enter(masks, inner, MASK_B)  # never returns
    masks.leave_call(outer, (), None)
    assert masks.calls == []
    assert masks.tokens(8) is None


def test_a_source_called_again_after_an_interrupted_call_drops_the_stale_call():
    """enter_call: a call of a source already in progress (the earlier one was interrupted) drops the
    earlier entry and what it left above, so when the new call returns no stale mask is in effect."""
    masks = CallMasks()
    model, base = nn.Module(), nn.Module()
    enter(masks, model, MASK_A)
    enter(masks, base, MASK_A)  # interrupted: neither returns
    enter(masks, model, None)
    enter(masks, base, None)
    assert [owner for owner, _, _ in masks.calls] == [id(model), id(base)]
    masks.leave_call(base, (), None)
    masks.leave_call(model, (), None)
    assert masks.tokens(8) is None


def test_a_block_called_alone_after_an_interrupted_padded_call_and_a_clean_call_routes_every_token():
    """End to end: a padded model call interrupted inside its first block (KeyboardInterrupt skips the
    forward hooks), then a complete call without a mask, leave no mask behind: a block called alone
    routes all its tokens and equals the unpatched block. Oracle: the unpatched block."""
    from routelab.integrations.hf import patch_moe

    model = mixtral().eval()
    reference = copy.deepcopy(model.model.layers[0].mlp)
    patch_moe(model, "topk")
    x = ids()

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.model.layers[0].register_forward_pre_hook(interrupt)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(x, attention_mask=left_padded(x))
    handle.remove()
    h = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x)
        alone = model.model.layers[0].mlp(h)
        expected = reference(h)
    assert routed_pairs(model, "model.layers.0.mlp.gate") == K * 16
    torch.testing.assert_close(alone, expected)


# -- the block's tokens -----------------------------------------------------------------------------


def test_a_token_count_that_is_no_multiple_of_the_batch_is_routed_whole():
    """_block_tokens: a block that sees a number of tokens the batch does not divide (here a call of
    unknown length: no input_ids nor inputs_embeds) cannot be mapped onto the mask: it routes them all,
    with a warning, instead of returning a mask of another length."""
    masks = CallMasks()
    masks.enter_call(nn.Module(), (), {"attention_mask": MASK_A})
    assert masks.current().query_length is None
    assert torch.equal(masks.tokens(8), MASK_A.reshape(-1).bool())
    with pytest.warns(UserWarning, match="sees 7 tokens"):
        assert masks.tokens(7) is None


# -- recomputation ----------------------------------------------------------------------------------


def test_one_tensor_in_two_calls_with_equal_masks_is_no_ambiguity():
    """A carrier's input that reached it in two calls whose masks are equal (distinct tensors, same
    values) has one mask: a recomputation routes under it without the "ambiguous" warning."""
    masks = CallMasks()
    source, carrier = nn.Module(), nn.Module()
    x = torch.randn(8, 4, requires_grad=True)
    for mask in (MASK_A, MASK_A.clone()):
        record_forward(masks, source, carrier, mask, (x,))
    assert torch.equal(recomputed_tokens(masks, carrier, (x,), quiet=True), MASK_A.reshape(-1).bool())


def test_a_per_call_tensor_inside_a_tuple_input_decides_the_recomputed_call():
    """_tensor_inputs looks one level into tuples: a layer's position embeddings ``(cos, sin)``, new in
    each call, name the call a recomputation re-runs even when its hidden states reached the layer in
    two calls (one ``inputs_embeds`` for a DPO pair). Oracle: each recomputation, given the first or the
    second call's tuple, routes under that call's mask, with no "ambiguous" warning."""
    masks = CallMasks()
    source, carrier = nn.Module(), nn.Module()
    x = torch.randn(8, 4, requires_grad=True)
    embeddings = {}
    for mask in (MASK_A, MASK_B):
        embeddings[id(mask)] = (torch.randn(4, 2), torch.randn(4, 2))
        record_forward(masks, source, carrier, mask, (x,), {"position_embeddings": embeddings[id(mask)]})
    for mask in (MASK_A, MASK_B, MASK_A):
        got = recomputed_tokens(masks, carrier, (x,), {"position_embeddings": embeddings[id(mask)]}, quiet=True)
        assert torch.equal(got, mask.reshape(-1).bool())


def test_a_forward_forgets_the_call_the_previous_backward_recomputed():
    """After a backward that recomputed call A, a forward (call B) and then a recomputation that no
    record matches route under the latest call's mask (B's, with the "unmatched" warning), not A's."""
    masks = CallMasks()
    source, carrier = nn.Module(), nn.Module()
    x = torch.randn(8, 4, requires_grad=True)
    record_forward(masks, source, carrier, MASK_A, (x,))
    assert torch.equal(recomputed_tokens(masks, carrier, (x,)), MASK_A.reshape(-1).bool())
    record_forward(masks, source, carrier, MASK_B, (torch.randn(8, 4, requires_grad=True),))
    with pytest.warns(UserWarning, match="no recorded forward matches"):
        got = in_backward(lambda: masks.tokens(8))
    assert torch.equal(got, MASK_B.reshape(-1).bool())


def test_past_the_record_limit_the_oldest_records_are_forgotten(monkeypatch):
    """MAX_RECORDS: records of freed inputs go first, then the *oldest*: the records of the latest
    forwards (those a coming backward recomputes) are kept. Oracle: with a limit of 2 and three
    recorded forwards, the newest forward's input still names its call (mask B, no warning) although
    the latest source call since (mask A) recorded nothing."""
    import routelab.integrations.hf_masks as hf_masks

    monkeypatch.setattr(hf_masks, "MAX_RECORDS", 2)
    masks = CallMasks()
    source, carrier = nn.Module(), nn.Module()
    inputs = [torch.randn(8, 4, requires_grad=True) for _ in range(3)]
    for x, mask in zip(inputs, (MASK_A, MASK_A, MASK_B), strict=True):
        record_forward(masks, source, carrier, mask, (x,))
    assert len(masks.records) == 2
    enter(masks, source, MASK_A)  # a later call that records nothing (the latest call's mask: A)
    masks.leave_call(source, (), None)
    assert torch.equal(recomputed_tokens(masks, carrier, (inputs[2],), quiet=True), MASK_B.reshape(-1).bool())


def test_a_copy_or_pickle_of_the_masks_starts_afresh():
    """CallMasks.__getstate__: the calls in progress and the records are this process's tensors; a
    deep copy starts with none, and a pickle succeeds (the records hold weak references)."""
    masks = CallMasks()
    source, carrier = nn.Module(), nn.Module()
    x = torch.randn(8, 4, requires_grad=True)
    enter(masks, source, MASK_A)
    masks.enter_carrier(carrier, (x,), {})
    for fresh in (copy.deepcopy(masks), pickle.loads(pickle.dumps(masks))):
        assert fresh.calls == [] and len(fresh.records) == 0 and fresh.replayed is None
        assert fresh.tokens(8) is None


def test_a_checkpoint_around_the_whole_model_recomputes_under_the_call_it_reruns():
    """A user's checkpoint around the whole model, called twice on one ``inputs_embeds`` tensor, first
    without a mask and then with a padded one: every recorded input (the embeddings, the labels)
    reached the model under both masks, so only the call pushed by the recomputation itself tells
    which call is re-run; the first call's blocks must route all tokens again, not the latest call's
    mask, and nothing is ambiguous. Oracle: the same two calls without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    from routelab.integrations.hf import patch_moe

    base = mixtral().train()
    x = ids()
    mask = left_padded(x)
    embeds = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(2))
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        patch_moe(model, "topk")

        def loss_of(inputs, attention_mask):
            return model(inputs_embeds=inputs, attention_mask=attention_mask, labels=x).loss

        with warnings.catch_warnings():
            warnings.filterwarnings("error", "activation checkpointing recomputed")
            if checkpointing:
                loss = checkpoint(loss_of, embeds, None, use_reentrant=False)
                loss = loss + checkpoint(loss_of, embeds, mask, use_reentrant=False)
            else:
                loss = loss_of(embeds, None) + loss_of(embeds, mask)
            loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
