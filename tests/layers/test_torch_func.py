"""torch.func over the MoE layer: functional_call + grad give autograd's parameter gradients for
the routers that run there; the exact balanced solvers refuse clearly (they read their scores'
memory, which torch.func's wrappers do not have, and their routes are not differentiable)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad

from routelab.layers import MoE


@pytest.mark.parametrize(("router", "k"), [("topk", 2), ("switch", None), ("softmax", None), ("batchwise", 2),
                                           ("sinkhorn", 2)])
def test_grad_of_functional_call_equals_autograd(router: str, k: int | None) -> None:
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, router=router, k=k)
    with torch.no_grad():
        moe.router.proj.weight.normal_()
    x = torch.randn(12, 16)
    params = {name: p.detach() for name, p in moe.named_parameters()}
    got = grad(lambda p: functional_call(moe, p, (x,))[0].square().sum())(params)
    moe(x)[0].square().sum().backward()
    for name, p in moe.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("router", "k"), [("base", 1), ("base", 2), ("gumbel_matching", None)])
def test_the_balanced_solvers_refuse_torch_func_clearly(router: str, k: int | None) -> None:
    moe = MoE(16, 32, 4, router=router, k=k)
    params = {name: p.detach() for name, p in moe.named_parameters()}
    with pytest.raises(NotImplementedError, match="does not run inside torch.func transforms"):
        grad(lambda p: functional_call(moe, p, (torch.randn(12, 16),))[0].sum())(params)
