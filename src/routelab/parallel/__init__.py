"""Expert parallelism over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

* :class:`ExpertParallelMoE` — the MoE layer with experts sharded over a process group; equal
  to the single-process :class:`routelab.layers.MoE` on the concatenated global batch.
* :func:`all_to_all`, :func:`all_gather_rows`, :func:`exchange_counts` — differentiable
  collectives with uneven splits.
* :func:`clip_grad_norm_`, :func:`all_reduce_found_inf` — gradient clipping and GradScaler's
  inf/NaN check over the whole sharded model (the same decision on every rank).
* :func:`init_distributed` (under ``torchrun``), :func:`run_workers` (local gloo or NCCL workers),
  :func:`default_backend`.
"""

from routelab.parallel.comm import all_gather_rows, all_to_all, exchange_counts
from routelab.parallel.grads import all_reduce_found_inf, clip_grad_norm_
from routelab.parallel.launch import default_backend, free_port, init_distributed, run_workers, under_torchrun
from routelab.parallel.moe import ExpertParallelMoE

__all__ = [
    "ExpertParallelMoE",
    "all_gather_rows",
    "all_reduce_found_inf",
    "all_to_all",
    "clip_grad_norm_",
    "default_backend",
    "exchange_counts",
    "free_port",
    "init_distributed",
    "run_workers",
    "under_torchrun",
]
