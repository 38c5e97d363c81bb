"""The MoE layer's two dispatch layouts compute the same function (``dispatch="grouped"`` vs ``"buffers"``).

Oracle: the buffer layout (batched matmuls over ``[E, C, d]``, itself tested against per-token
loops in tests/routing) on the same weights, generator state and inputs: outputs, input
gradients, every parameter's gradient and the statistics must agree, for every router, capacity
(dropping and dropless), experts variant (biases, gated), dtype, padding mask, activation
checkpointing and ``torch.compile``. Plus which layout ``"auto"`` picks, and the errors of
``"grouped"`` where it cannot run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from routelab.layers import MoE, MoEConfig
from routelab.layers._grouped import grouped_mm_supported

D, H, E = 16, 32, 8
ROUTER_K = {"softmax": None, "topk": 2, "switch": 1, "noisy_topk": 2, "batchwise": 2, "base": 1, "sinkhorn": 2,
            "gumbel_matching": 1}
#: Routers that assign every token (they need capacity >= the balanced quota).
BALANCED = {"base", "sinkhorn", "gumbel_matching"}

needs_grouped = pytest.mark.skipif(not grouped_mm_supported(torch.device("cpu"), torch.float32, (D, H)),
                                   reason="torch._grouped_mm does not run on this CPU build")


def pair(router: str, *, seed: int = 0, **kw) -> tuple[MoE, MoE]:
    """The same layer twice (same weights), grouped and on buffers, each with its own generator of the same seed."""
    torch.manual_seed(seed)
    grouped = MoE(D, H, E, router=router, k=ROUTER_K[router], dispatch="grouped",
                  generator=torch.Generator().manual_seed(seed), **kw)
    with torch.no_grad():
        grouped.router.proj.weight.normal_(0, 1.0)
    buffers = MoE(D, H, E, router=router, k=ROUTER_K[router], dispatch="buffers",
                  generator=torch.Generator().manual_seed(seed), **kw)
    buffers.load_state_dict(grouped.state_dict())
    return grouped, buffers


def run(moe: MoE, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and every parameter gradient of one forward + backward."""
    x = x.detach().clone().requires_grad_(True)
    y, routes = moe(x, mask=mask)
    loss = (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + sum(routes.aux.values())
    params = [p for p in moe.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    grads = tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads, [x, *params]))
    return (y, *grads, routes.stats["capacity"], routes.stats["tokens_per_expert"], routes.stats["dropped_fraction"])


def assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], tol: float = 1e-5) -> None:
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u.float(), v.float(), rtol=tol, atol=tol)


#: Every router but batchwise gating (its E masked slots: test_grouped_with_masked_slots) at every
#: capacity it accepts (the balanced routers assign every token: capacity >= the balanced quota).
ROUTER_CAPACITIES = [(router, cf) for router in sorted(ROUTER_K) if router != "batchwise"
                     for cf in (1.0, None, 0.5) if not (router in BALANCED and cf == 0.5)]


@needs_grouped
@pytest.mark.parametrize(("router", "capacity_factor"), ROUTER_CAPACITIES)
def test_grouped_equals_buffers_for_every_router(router: str, capacity_factor: float | None) -> None:
    grouped, buffers = pair(router, capacity_factor=capacity_factor)
    x = torch.randn(3, 21, D, generator=torch.Generator().manual_seed(1))
    assert_same(run(grouped, x), run(buffers, x))


@needs_grouped
def test_grouped_with_masked_slots() -> None:
    """Batchwise gating's E slots with a mask: grouped still computes the buffers' function."""
    grouped, buffers = pair("batchwise", capacity_factor=1.0)
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(2))
    assert_same(run(grouped, x), run(buffers, x))


@needs_grouped
@pytest.mark.parametrize("options", [{"bias": False}, {"activation": "swiglu"}, {"activation": "swiglu", "bias": False},
                                     {"importance_weighting": True, "drop_policy": "random", "capacity_factor": 0.5},
                                     {"drop_policy": "score", "capacity_factor": 0.75}])
def test_grouped_equals_buffers_for_every_experts_variant(options: dict) -> None:
    grouped, buffers = pair("topk", **options)
    x = torch.randn(50, D, generator=torch.Generator().manual_seed(3))
    assert_same(run(grouped, x), run(buffers, x))


@needs_grouped
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_equals_buffers_in_half_precision(dtype: torch.dtype) -> None:
    if not grouped_mm_supported(torch.device("cpu"), dtype, (D, H)):
        pytest.skip(f"torch._grouped_mm does not run in {dtype} on this CPU build")
    grouped, buffers = pair("topk", capacity_factor=None)
    grouped, buffers = grouped.to(dtype), buffers.to(dtype)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    # The same routes (the router scores in float32 in both); the experts' sums differ in order only.
    assert_same(run(grouped, x), run(buffers, x), tol=3e-2)


@needs_grouped
def test_grouped_with_a_padding_mask_and_in_eval() -> None:
    grouped, buffers = pair("noisy_topk", capacity_factor=1.25)
    x = torch.randn(4, 9, D, generator=torch.Generator().manual_seed(5))
    mask = torch.rand(4, 9, generator=torch.Generator().manual_seed(6)) < 0.7
    assert_same(run(grouped, x, mask), run(buffers, x, mask))
    grouped.eval(), buffers.eval()
    assert_same(run(grouped, x, mask), run(buffers, x, mask))


@needs_grouped
def test_grouped_under_activation_checkpointing() -> None:
    """The noise is replayed in the recomputation: the same gradients as without checkpointing."""
    grouped, _ = pair("noisy_topk", capacity_factor=1.0, drop_policy="random")
    x = torch.randn(30, D, generator=torch.Generator().manual_seed(7), requires_grad=True)
    state = grouped.generator.get_state()
    y, _ = grouped(x)
    plain = torch.autograd.grad(y.pow(2).sum(), [x, grouped.experts.w1])
    grouped.generator.set_state(state)
    y2 = checkpoint(lambda t: grouped(t)[0], x, use_reentrant=False)
    again = torch.autograd.grad(y2.pow(2).sum(), [x, grouped.experts.w1])
    torch.testing.assert_close(y2, y)
    for a, b in zip(plain, again):
        torch.testing.assert_close(a, b)


@needs_grouped
def test_compiled_grouped_layer_equals_eager() -> None:
    """bfloat16 compiles grouped without a graph break; other dtypes compile on buffers."""
    if not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, (D, H)):
        pytest.skip("torch._grouped_mm does not run in bfloat16 on this CPU build")
    torch._dynamo.reset()
    grouped, _ = pair("topk", capacity_factor=1.0, check_finite=False)
    grouped = grouped.to(torch.bfloat16)
    x = torch.randn(48, D, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    eager, _ = grouped(x)
    compiled = torch.compile(grouped, fullgraph=True)
    y, _ = compiled(x)
    torch.testing.assert_close(y.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_auto_picks_grouped_only_where_it_runs_and_the_router_proposes_k() -> None:
    cpu = torch.device("cpu")
    topk = MoE(D, H, E, router="topk", k=2)
    assert topk.uses_grouped(2, cpu) == grouped_mm_supported(cpu, torch.float32, (D, H))
    assert not MoE(D, H, E, router="batchwise", k=2).uses_grouped(E, cpu)  # E masked slots: buffers
    assert not MoE(D, H, E, router="topk", k=2, dispatch="buffers").uses_grouped(2, cpu)
    # 6 float32 columns are 24 bytes, not a multiple of 16: grouped matmuls refuse them.
    assert not MoE(6, H, E, router="topk", k=2).uses_grouped(2, cpu)
    assert not MoE(D, H, E, router="topk", k=2, dtype=torch.float64).uses_grouped(2, cpu) or \
        grouped_mm_supported(cpu, torch.float64, (D, H))


def test_auto_prefers_buffers_that_pad_nothing() -> None:
    """With a capacity factor of at most 1 the [E, C] buffers hold no more rows than the grouped
    layout (E * C <= tokens * k): auto takes buffers. Above 1, dropless, and in eval (dropless by
    default), grouped where it runs."""
    cpu = torch.device("cpu")
    runs = grouped_mm_supported(cpu, torch.float32, (D, H))
    n = 48
    for factor, want in ((0.5, False), (1.0, False), (1.25, runs), (None, runs)):
        moe = MoE(D, H, E, router="topk", k=2, capacity_factor=factor)
        assert moe.uses_grouped(2, cpu, num_tokens=n) == want, factor
        assert moe.uses_grouped(2, cpu) == runs  # no token count: the layout alone
    moe = MoE(D, H, E, router="topk", k=2, capacity_factor=1.0).eval()
    assert moe.uses_grouped(2, cpu, num_tokens=n) == runs  # eval_capacity_factor None: dropless
    # Indivisible counts: C = ceil(47 * 2 / 8) = 12, E * C = 96 > 94 rows: buffers would pad 2 rows.
    assert MoE(D, H, E, router="topk", k=2, capacity_factor=1.0).uses_grouped(2, cpu, num_tokens=47) == runs


def test_grouped_where_it_cannot_run_is_a_clear_error() -> None:
    moe = MoE(6, H, E, router="topk", k=2, dispatch="grouped")
    with pytest.raises(ValueError, match="dispatch='grouped'.*16 bytes.*dispatch='auto' or 'buffers'"):
        moe(torch.randn(5, 6))
    # The same layer on auto runs (on buffers).
    moe.dispatch = "auto"
    assert moe(torch.randn(5, 6))[0].shape == (5, 6)


def test_the_grouped_error_says_why_for_each_cause() -> None:
    from routelab.layers._grouped import grouped_mm_unsupported_reason

    cpu = torch.device("cpu")
    assert "multiples of 16 bytes" in grouped_mm_unsupported_reason(cpu, torch.float32, (6, 16))
    assert "only bfloat16" in grouped_mm_unsupported_reason(torch.device("cuda"), torch.float32, (16, 16))
    assert "CPU and CUDA devices only" in grouped_mm_unsupported_reason(torch.device("meta"), torch.float32, (16,))


@pytest.mark.skipif(not MoE(D, H, E, router="topk", k=2).experts.grouped_supported(torch.device("cpu")),
                    reason="grouped matmuls do not run on this CPU")
def test_grouped_float32_under_fullgraph_compile_names_the_cause() -> None:
    """Eagerly float32 runs grouped on the CPU; traced it cannot, and the error must say that (not
    blame the widths): Dynamo shows the ValueError's text in its "Observed exception"."""
    moe = MoE(D, H, E, router="topk", k=2, capacity_factor=None, dispatch="grouped", check_finite=False)
    x = torch.randn(16, D)
    moe(x)  # eager: runs
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)under torch.compile only bfloat16 runs grouped.*dispatch='auto'"):
        torch.compile(moe, fullgraph=True, backend="eager")(x)


def test_a_first_forward_under_checkpointing_probes_grouped_matmuls_outside_it(monkeypatch) -> None:
    """The grouped probe runs on the first use of a device and dtype. Inside non-reentrant
    checkpointing its saved tensors were counted with the layer's, and the recomputation (which
    finds the verdict cached) failed with a CheckpointError."""
    from torch.utils.checkpoint import checkpoint

    from routelab.layers import _grouped

    monkeypatch.setattr(_grouped, "_PROBED", {})  # as in a fresh process
    torch.manual_seed(0)
    moe = MoE(D, H, E, router="topk", k=2, capacity_factor=None)
    x = torch.randn(16, D, requires_grad=True)
    checkpoint(lambda t: moe(t)[0], x, use_reentrant=False).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_the_grouped_probe_runs_where_saved_tensor_hooks_are_disabled(monkeypatch) -> None:
    """vmap and AOTAutograd disable saved-tensor hooks; the probe must not try to push its own
    there (that raised, and the probe's False verdict stayed for the whole process)."""
    from routelab.layers import _grouped

    monkeypatch.setattr(_grouped, "_PROBED", {})
    expected = _grouped._probe(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(_grouped, "_PROBED", {})
    with torch.autograd.graph.disable_saved_tensors_hooks("disabled here"):
        assert _grouped.grouped_mm_supported(torch.device("cpu"), torch.float32, (16, 16)) == (expected is None)


def test_a_dtype_torch_cannot_group_is_refused_with_torchs_reason(monkeypatch) -> None:
    """Where torch's grouped matmul raises (float64 on CPU), the error quotes torch's reason; it
    said the tiny product 'did not match', which read as a wrong result."""
    from routelab.layers import _grouped

    monkeypatch.setattr(_grouped, "_PROBED", {})
    reason = _grouped.grouped_mm_unsupported_reason(torch.device("cpu"), torch.float64, (16, 16))
    if reason is None:
        pytest.skip(f"torch {torch.__version__} groups float64 matmuls on CPU")
    assert reason.startswith("torch's grouped matmul raised on cpu in torch.float64"), reason
    moe = MoE(16, 16, 4, router="topk", k=1, capacity_factor=None, dispatch="grouped", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dispatch='grouped' cannot run here: torch's grouped matmul raised.*"
                                         r"use dispatch='auto' or 'buffers'"):
        moe(torch.randn(8, 16, dtype=torch.float64))


class Doubling(nn.Module):
    """A custom experts module with the buffer protocol only."""

    def forward(self, buffers: torch.Tensor) -> torch.Tensor:
        return 2 * buffers


def test_custom_experts_without_the_grouped_form() -> None:
    with pytest.raises(ValueError, match="grouped form"):
        MoEConfig(D, H, E, experts=Doubling(), dispatch="grouped")
    with pytest.raises(ValueError, match="dispatch must be one of auto, grouped, buffers"):
        MoEConfig(D, H, E, dispatch="sorted")
    moe = MoE(D, H, E, router="topk", k=1, experts=Doubling(), capacity_factor=None)
    x = torch.randn(7, D)
    y, routes = moe(x)  # auto: buffers
    torch.testing.assert_close(y, 2 * x * routes.gate)
    assert moe.config.dispatch == "auto"


def test_grouped_on_cuda_is_bfloat16_only() -> None:
    """torch's other dtypes run grouped matmuls on CUDA by a loop over the groups that reads the
    offsets on the host (a sync per call, seen on an H200 with torch 2.11): refused without
    touching the device, so this runs on any machine."""
    for dtype in (torch.float32, torch.float16, torch.float64):
        assert not grouped_mm_supported(torch.device("cuda"), dtype, (64, 128))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_grouped_forward_has_no_host_sync_on_cuda(dtype: torch.dtype) -> None:
    """With check_finite=False the top-k forward, dropless included, never waits for the GPU."""
    if not grouped_mm_supported(torch.device("cuda"), dtype, (64, 128)):
        pytest.skip(f"torch._grouped_mm does not run in {dtype} on this GPU")
    for capacity_factor in (1.0, None):
        moe = MoE(64, 128, E, router="topk", k=2, capacity_factor=capacity_factor, check_finite=False,
                  dispatch="grouped", device="cuda", dtype=dtype)
        moe.router.cuda()
        x = torch.randn(256, 64, device="cuda", dtype=dtype)
        moe(x)  # warm-up (the probe of grouped_mm_supported synchronises once)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y, routes = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(y).all()


@pytest.mark.requires_cuda
@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_a_training_step_replays_from_a_cuda_graph(capacity_factor: float | None) -> None:
    """With check_finite=False a top-k layer's forward + backward has no host sync, so it can be
    captured in a CUDA graph (what removes the host's launch overhead, docs/gpu-profile-h200.md);
    the replay gives the eager step's gradients. Capacity factor 1 runs on buffers, dropless in
    bfloat16 on the grouped layout."""
    torch.manual_seed(0)
    moe = MoE(64, 128, E, router="topk", k=2, capacity_factor=capacity_factor, check_finite=False,
              device="cuda", dtype=torch.bfloat16)
    moe.router.cuda()
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    params = [x, *moe.parameters()]

    def step() -> None:
        for p in params:
            p.grad = None
        moe(x)[0].backward(g)

    step()
    eager = [p.grad.clone() for p in params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA graph capture asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for p in params:
        p.grad = None
    with torch.cuda.graph(graph):
        moe(x)[0].backward(g)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((p.grad for p in params), eager, strict=True):
        torch.testing.assert_close(got, want)
