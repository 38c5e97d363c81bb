"""The assignment solvers ignore the default device: a user's ``torch.set_default_device("cuda")``
must not move their host-side work (scratch buffers, numba's output arrays) off the host.

With ``meta`` as the default device, a tensor made without a device lands on ``meta``: it cannot be
written through numpy nor mixed with the CPU inputs, so such a tensor fails the call here. Each
result equals the call's answer under the CPU's default device, on the CPU (independent truth: the
same solver, unaffected by the default device).
"""

from __future__ import annotations

import pytest
import torch

from routelab.assignment import (
    balanced_assignment,
    balanced_b_matching,
    base_assignment,
    clear_scratch,
    gumbel_matching,
    sinkhorn,
)


def _scores(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


COLUMNS = torch.tensor([4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 16.0, 16.0], dtype=torch.float64)  # sum 128 = n

CALLS = {
    # k > 2, float32, CPU, no gradient: the compiled (numba) fast path where numba is installed
    "sinkhorn": lambda s: sinkhorn(s.log_softmax(-1)),
    "sinkhorn (float64, unequal columns)": lambda s: sinkhorn(s.double().log_softmax(-1), col_sum=COLUMNS),
    "balanced_assignment": lambda s: balanced_assignment(s),
    "balanced_assignment (capacity, k=2)": lambda s: balanced_assignment(s, 40, k=2),
    "balanced_assignment (batched)": lambda s: balanced_assignment(s.view(2, 64, 8)),
    "balanced_b_matching": lambda s: balanced_b_matching(s, 2),
    "base_assignment": lambda s: base_assignment(s, 20),
    "gumbel_matching": lambda s: gumbel_matching(s, generator=torch.Generator().manual_seed(3)).expert,
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_solver_on_cpu_tensors_ignores_the_default_device(name: str) -> None:
    call = CALLS[name]
    scores = _scores(128, 8)
    clear_scratch()
    expected = call(scores)
    for fresh_scratch in (True, False):  # the scratch slots made under meta, then reused
        if fresh_scratch:
            clear_scratch()
        with torch.device("meta"):
            got = call(scores)
        assert got.device.type == "cpu", name
        assert torch.equal(got, expected), name
