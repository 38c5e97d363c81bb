"""A number from the host as a 0-dim tensor on a device, filled there (layer 0: imports only torch).

``torch.tensor(x, device="cuda")`` and ``torch.as_tensor(x, device="cuda")`` build the tensor on the
host and copy it with ``non_blocking=False``: on CUDA the host then waits for everything queued on
the stream, a host sync in the middle of a step (pytorch#190217; it cost routelab's capacity
statistic one sync per training step). ``Tensor.new_full`` launches a fill instead. The CPU test
suite finds such copies with ``tests/host_syncs.py``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["device_scalar"]


def device_scalar(value: numbers.Real, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``value`` as a 0-dim tensor on ``like``'s device, in ``dtype`` (default ``like``'s), without
    a copy from the host. A floating ``dtype`` takes the value as ``torch.as_tensor`` would: an
    integer beyond a float64's range becomes ``+-inf``, a finite one beyond the dtype's range
    rounds to ``+-inf``."""
    dtype = like.dtype if dtype is None else dtype
    if dtype.is_floating_point:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float64
            value = math.inf if value > 0 else -math.inf
        if math.isfinite(value) and abs(value) > torch.finfo(dtype).max:
            # rounded as a conversion rounds it (to inf, or to the largest finite value within half
            # a unit of it): new_full refuses a value it cannot represent
            value = torch.tensor(value, dtype=torch.float64).to(dtype).item()
    return like.new_full((), value, dtype=dtype)
