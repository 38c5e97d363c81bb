"""ExpertParallelMoE with token masks: each rank's padded tokens are left out of the global batch.

Oracle: the single-process MoE on the concatenation of the ranks' real tokens (same weights, same
generator state); the masked outputs must be exactly 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from routelab.layers import MoE
from routelab.parallel import ExpertParallelMoE, run_workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

D, H, E = 6, 10, 4
CONFIGS = [
    {"router": "topk", "k": 2, "capacity_factor": 1.0},
    {"router": "base", "capacity_factor": None},
    {"router": "batchwise", "k": 2, "capacity_factor": 1.0},
    {"router": "gumbel_matching", "capacity_factor": 1.0},
    {"router": "noisy_topk", "k": 2, "capacity_factor": 0.75, "drop_policy": "random"},
]


def _worker(rank: int, world: int) -> int:
    lengths = [[5, 2], [3, 6]]  # per rank, per sequence: real tokens out of 6
    checked = 0
    for i, cfg in enumerate(CONFIGS):
        torch.manual_seed(i)
        gen = torch.Generator().manual_seed(100 + i)
        moe = MoE(D, H, E, router=cfg["router"], k=cfg.get("k"), capacity_factor=cfg["capacity_factor"],
                  drop_policy=cfg.get("drop_policy", "position"), generator=gen)
        with torch.no_grad():
            for p in moe.router.parameters():
                p.normal_(0.0, 0.7) if p.dim() > 1 else p.uniform_(0.1, 0.4)
        state = gen.get_state()
        g = torch.Generator().manual_seed(1000 + i)
        xs = [torch.randn(2, 6, D, generator=g) for _ in range(world)]
        masks = [torch.arange(6).unsqueeze(0) < torch.tensor(lengths[r]).unsqueeze(1) for r in range(world)]
        y_ref, _ = moe(torch.cat([x[m] for x, m in zip(xs, masks, strict=True)]))
        gen.set_state(state)
        ep = ExpertParallelMoE.from_moe(moe, None)
        y, routes = ep(xs[rank], mask=masks[rank])
        lo = sum(int(m.sum()) for m in masks[:rank])
        n = int(masks[rank].sum())
        assert bool((y[~masks[rank]] == 0).all()), f"{cfg}: masked outputs must be 0"
        assert torch.allclose(y[masks[rank]], y_ref[lo:lo + n], atol=1e-5, rtol=0), f"{cfg}: rank {rank} differs"
        assert not routes.keep[~masks[rank].reshape(-1)].any()
        checked += 1
    return checked


def test_expert_parallel_masks_equal_the_single_process_real_tokens() -> None:
    assert run_workers(_worker, 2, timeout=90) == [len(CONFIGS)] * 2
