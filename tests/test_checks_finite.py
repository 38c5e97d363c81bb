"""routelab._checks.check_finite: every non-finite entry found, every finite one accepted, in one read."""

from __future__ import annotations

import pytest
import torch

from host_syncs import record_host_syncs
from routelab._checks import check_finite


@pytest.mark.parametrize(("values", "dtype"), [
    ([1e300, -1e300], torch.float64),  # finite beyond float32's range
    ([65504.0, -65504.0], torch.float16),  # float16's largest
    ([3.0e38, -1.0], torch.bfloat16),
    ([0.0, -0.0, 1e-45], torch.float32),
])
def test_finite_values_pass(values: list[float], dtype: torch.dtype) -> None:
    check_finite(torch.tensor(values, dtype=dtype), "x", "fix")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_non_finite_entry_is_named(bad: float, dtype: torch.dtype) -> None:
    t = torch.ones(5, 3, dtype=dtype)
    t[3, 1] = bad
    with pytest.raises(ValueError, match="x are not finite \\(NaN or inf\\): fix"):
        check_finite(t, "x", "fix")
    with pytest.raises(ValueError):  # among several tensors of other dtypes
        check_finite((torch.ones(2, dtype=torch.float64) * 1e300, torch.zeros(0), t), "x", "fix")


def test_empty_and_integer_tensors_pass_and_several_tensors_take_one_read() -> None:
    check_finite((torch.zeros(0), torch.tensor([3, 4])), "x", "fix")
    tensors = (torch.randn(4, 4), torch.randn(3, dtype=torch.float64), torch.randn(2, dtype=torch.bfloat16))
    with record_host_syncs() as found:
        check_finite(tensors, "x", "fix")
    assert len(found) == 1, [str(f) for f in found]
