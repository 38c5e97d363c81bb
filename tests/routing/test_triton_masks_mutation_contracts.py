"""Contracts of routelab.routing._gather_triton (the gate and the wrappers of the fused gathers) and
routelab.routing.masks (real_tokens, scatter_routes) that mutation testing found unguarded on a CPU
machine.

The kernels run here on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py) with "cpu" added to the gate's devices, as in test_gather_triton.py. Oracles:
explicit float32 loops over the slots, the same call on contiguous copies, and the documented
errors (naming the argument).
"""

from __future__ import annotations

import pytest
import torch

import routelab.routing as R
from routelab.routing import _gather_triton
from routelab.routing.masks import real_tokens, scatter_routes
from triton_devices import kernel_device


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> str:
    """The device the kernels run on here: CUDA, else the CPU in Triton's interpreter."""
    return kernel_device(monkeypatch)


def _slot_sum_reference(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``sum_j weight[t, j] * src[index[t, j]]`` in float32, slot by slot, a sentinel reading 0."""
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])]).float()
    n, s = index.shape
    out = torch.zeros(n, src.shape[1])
    for j in range(s):
        picked = padded[index[:, j]]
        out = out + (picked * weight[:, j:j + 1].float() if weight is not None else picked)
    return out.to(src.dtype)


# --- the gate ------------------------------------------------------------------------------------

def test_the_gate_refuses_data_tensors_of_mixed_dtypes(dev) -> None:
    """usable(): all data tensors must share one dtype (the kernels write in the first one's)."""
    x = torch.randn(3, 4, device=dev)
    assert _gather_triton.usable(x) and _gather_triton.usable(x, x.clone())
    assert not _gather_triton.usable(x, x.half())
    assert not _gather_triton.usable(x.bfloat16(), x)
    assert not _gather_triton.usable(x, x, x.half())


def test_the_gate_refuses_float64(dev) -> None:
    """float64 stays on PyTorch's operators: it is not one of the kernels' DTYPES."""
    x = torch.randn(3, 4, device=dev)
    assert _gather_triton.usable(x)
    assert torch.float64 not in _gather_triton.DTYPES
    assert not _gather_triton.usable(x.double())
    assert not _gather_triton.usable(x.double(), x.double())


def test_the_gate_refuses_while_torch_compile_traces(dev, monkeypatch) -> None:
    """Under torch.compile (inductor fuses the PyTorch formulation itself) the kernels are not used."""
    x = torch.randn(3, 4, device=dev)
    index = torch.tensor([0, 3, 1], device=dev)
    assert _gather_triton.usable(x, indices=(index,))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not _gather_triton.usable(x, indices=(index,))
    assert not _gather_triton.usable(x)


# --- the wrappers take strided inputs -------------------------------------------------------------

@pytest.mark.parametrize("weighted", [True, False])
def test_slot_sum_takes_a_strided_source(dev, weighted) -> None:
    """slot_sum makes ``src`` contiguous: a transposed ``[m, d]`` source sums the right rows."""
    g = torch.Generator().manual_seed(3)
    m, d, n, s = 6, 5, 7, 2
    src = torch.randn(d, m, generator=g).t()  # [m, d], not contiguous
    assert not src.is_contiguous()
    index = torch.randint(0, m + 1, (n, s), generator=g)
    weight = torch.randn(n, s, generator=g) if weighted else None
    want = _slot_sum_reference(src, index, weight)
    got = _gather_triton.slot_sum(src.to(dev), index.to(dev), None if weight is None else weight.to(dev)).cpu()
    same = _gather_triton.slot_sum(src.contiguous().to(dev), index.to(dev),
                                   None if weight is None else weight.to(dev)).cpu()
    assert torch.equal(got, same)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_slot_sum_takes_strided_weights(dev) -> None:
    """slot_sum makes ``weight`` contiguous: a transposed ``[n, s]`` weight scales the right slots."""
    g = torch.Generator().manual_seed(4)
    m, d, n, s = 5, 4, 6, 3
    src = torch.randn(m, d, generator=g)
    index = torch.randint(0, m + 1, (n, s), generator=g)
    weight = torch.randn(s, n, generator=g).t()  # [n, s], not contiguous
    assert not weight.is_contiguous()
    want = _slot_sum_reference(src, index, weight)
    got = _gather_triton.slot_sum(src.to(dev), index.to(dev), weight.to(dev)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got, _gather_triton.slot_sum(src.to(dev), index.to(dev), weight.contiguous().to(dev)).cpu())


def test_combine_backward_takes_strided_row_weights(dev) -> None:
    """combine_backward makes ``weight_of_row`` contiguous: ``grad_rows[r] = w[r] * grad_y[t]``
    with ``w`` a strided view (every other entry of a longer vector)."""
    g = torch.Generator().manual_seed(5)
    n, R_, d = 4, 6, 3
    rows = torch.randn(R_, d, generator=g)
    grad_y = torch.randn(n, d, generator=g)
    token_of_row = torch.tensor([0, 4, 1, 3, 2, 4])
    weight_of_row = torch.randn(2 * R_, generator=g)[::2]
    assert not weight_of_row.is_contiguous()
    gathered = torch.cat([grad_y, grad_y.new_zeros(1, d)])[token_of_row]
    want = gathered * weight_of_row[:, None]
    got_rows, dots = _gather_triton.combine_backward(rows.to(dev), grad_y.to(dev), token_of_row.to(dev),
                                                     weight_of_row.to(dev), True)
    torch.testing.assert_close(got_rows.cpu(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dots.cpu(), (rows * gathered).sum(-1) * (token_of_row < n), rtol=1e-5, atol=1e-6)


# --- masks -------------------------------------------------------------------------------------------

def test_real_tokens_checks_its_mask() -> None:
    """real_tokens takes a BoolTensor only: a float mask is a ValueError, a list a TypeError, naming mask."""
    mask = torch.tensor([True, False, True])
    assert torch.equal(real_tokens(mask), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="mask must be a BoolTensor"):
        real_tokens(mask.float())
    with pytest.raises(ValueError, match="mask must be a BoolTensor"):
        real_tokens(torch.tensor([1, 0, 1]))
    with pytest.raises(TypeError, match="mask must be a BoolTensor"):
        real_tokens([True, False, True])


def test_scatter_routes_names_a_negative_index() -> None:
    """A negative position is out of ``[0, num_tokens)``: a ValueError naming index (not index_copy's IndexError)."""
    routes = R.topk_routes(torch.randn(2, 4, generator=torch.Generator().manual_seed(0)), 1)
    with pytest.raises(ValueError, match=r"index must hold token positions in \[0, num_tokens=3\), got -1 to 1"):
        scatter_routes(routes, torch.tensor([-1, 1]), 3)


def test_scatter_routes_refuses_a_bool_index() -> None:
    """A bool index (a mask passed where real_tokens(mask) belongs) is a ValueError naming index,
    not read as the positions 0 and 1."""
    routes = R.topk_routes(torch.randn(2, 4, generator=torch.Generator().manual_seed(0)), 1)
    with pytest.raises(ValueError, match="index must be a 1-D LongTensor"):
        scatter_routes(routes, torch.tensor([True, True]), 3)
    with pytest.raises(ValueError, match="index must be a 1-D LongTensor"):
        scatter_routes(routes, torch.tensor([True, True]), 3, check=False)
