"""The lm-routers model across processes: experts sharded with ExpertParallelMoE, the rest replicated by DDP.

Run (every rank the same script; gloo on CPU, NCCL on GPU)::

    torchrun --nproc_per_node=2 -m routelab.experiments.lm_routers.parallel --router top2 --steps 10 --compare

**Why an adapter, not** :func:`~routelab.integrations.hf.patch_moe`. A patched transformers block keeps
transformers' fused experts, which live whole on one process; expert parallelism needs routelab's
stacked experts, sharded by :class:`~routelab.parallel.ExpertParallelMoE`. So the same Mixtral (same
config, same seed, same weights) has each sparse MoE block replaced by a :class:`RoutedMoEBlock` around a
routelab :class:`~routelab.layers.MoE` with gated SwiGLU experts holding the block's own weights
(:meth:`~routelab.layers.StackedExperts.from_hf_fused`) and the block's router weight
(:func:`to_routelab_moe`; tested equal to the ``patch_moe`` model's outputs). :func:`expert_parallel`
then shards each MoE's experts over the ranks and wraps the model in ``DistributedDataParallel``:

* the experts are left out of DDP (``_set_params_and_buffers_to_ignore_for_model``): each rank owns
  its shard, whose gradient the all-to-all already completes with every rank's tokens;
* each rank's loss is its own batch's mean cross-entropy plus ``routelab.aux_loss`` (the aux losses of
  the global batch). DDP averages the replicated gradients over the ``W`` ranks; the expert gradients,
  which are the gradients of the *sum* of the ``W`` rank losses, are divided by ``W`` by a hook installed
  here. The result is the single-process gradient of ``mean cross-entropy + aux`` on the global batch
  (the ranks' batches concatenated in rank order), with no gradient reduction left to the user;
* DDP gets its own process group, so its bucketed all-reduces never interleave with the experts'
  all-to-alls on one communicator.

Gradient clipping must see the global norm (the experts' squares summed over the ranks):
:func:`clip_grad_norm` does that. :func:`train_steps` is one training loop for both forms; the test
(tests/experiments/test_lm_routers_parallel.py) checks that 2 gloo ranks reproduce the single-process
loss curve to 1e-4.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...layers import MoE, StackedExperts
from ...parallel import ExpertParallelMoE, clip_grad_norm_
from ...routing import aux_loss
from .data import CharCorpus
from .model import RouterSpec, Settings, lr_at, unpatched_model

__all__ = ["RoutedMoEBlock", "build_routelab_model", "clip_grad_norm", "expert_parallel", "main", "to_routelab_moe",
           "train_steps"]


class RoutedMoEBlock(nn.Module):
    """A transformers sparse MoE block replaced by a routelab MoE layer: ``[batch, seq, d] -> [batch, seq, d]``.

    Attributes:
        moe: the :class:`~routelab.layers.MoE` (or :class:`~routelab.parallel.ExpertParallelMoE`); its
            auxiliary losses and statistics are found by ``routelab.aux_loss`` / ``routing_stats``.
    """

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, hidden_states: Tensor) -> Tensor:
        out, _ = self.moe(hidden_states)
        return out


def to_routelab_moe(model: nn.Module, spec: RouterSpec, settings: Settings,
                    generator: torch.Generator | None = None) -> nn.Module:
    """Replace every sparse MoE block of the (unpatched) Mixtral ``model`` by a :class:`RoutedMoEBlock`, in place.

    Each routelab MoE holds the block's experts (``from_hf_fused``: the same SwiGLU function) and router
    weight, routes with ``spec`` under ``settings.capacity_factor`` in training and dropless in ``eval()``:
    the computation of :func:`~.model.build_model`'s ``patch_moe`` model.
    """
    for layer in model.model.layers:
        block = layer.mlp
        E, d = block.gate.weight.shape
        fused = StackedExperts.from_hf_fused(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(),
                                             activation="silu")
        moe = MoE(d, fused.d_hidden, E, router=spec.router, k=spec.k if spec.sparse else None,
                  capacity_factor=settings.capacity_factor if spec.sparse else None, eval_capacity_factor=None,
                  router_kwargs=dict(spec.options), importance_weighting=spec.importance_weighting,
                  activation="swiglu", bias=False, generator=generator,
                  device=block.gate.weight.device, dtype=block.gate.weight.dtype)
        with torch.no_grad():
            moe.experts.load_state_dict(fused.state_dict())
            moe.router.proj.weight.copy_(block.gate.weight)
        moe.train(model.training)
        layer.mlp = RoutedMoEBlock(moe)
    return model


def build_routelab_model(spec: RouterSpec, settings: Settings, vocab: int, seed: int,
                         generator: torch.Generator | None = None) -> nn.Module:
    """The Mixtral of :func:`~.model.build_model` (same seed, same weights) with routelab MoE blocks.

    :func:`~.model.unpatched_model` converted by :func:`to_routelab_moe`."""
    return to_routelab_moe(unpatched_model(spec, settings, vocab, seed), spec, settings, generator)


def expert_parallel(model: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard the experts of a :func:`to_routelab_moe` model over ``process_group`` and wrap it in DDP.

    Every rank must hold the same model (built from the same seed) and the same router generator
    state. See the module docstring for the gradient semantics.

    Returns:
        ``DistributedDataParallel`` around ``model`` (its ``.module``); train it with each rank's share of
        the batch and the loss ``cross_entropy + routelab.aux_loss(model)``.
    """
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size(process_group)
    blocks = [m for m in model.modules() if isinstance(m, RoutedMoEBlock)]
    if not blocks:
        raise ValueError("model has no RoutedMoEBlock: convert it with to_routelab_moe first")
    for block in blocks:
        block.moe = ExpertParallelMoE.from_moe(block.moe, process_group)
        for p in block.moe.expert_parameters():
            p.register_hook(lambda g: g / world)  # the sum of the W rank losses -> their mean
    sharded = [name for name, _ in model.named_parameters() if ".moe.experts." in name]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sharded)
    ranks = list(range(dist.get_world_size())) if process_group is None else dist.get_process_group_ranks(
        process_group)
    ddp_group = dist.new_group(ranks)
    device_ids = None if next(model.parameters()).device.type == "cpu" else [torch.cuda.current_device()]
    return DistributedDataParallel(model, process_group=ddp_group, device_ids=device_ids)


def clip_grad_norm(model: nn.Module, max_norm: float, process_group: dist.ProcessGroup | None = None) -> float:
    """Clip the gradients of ``model`` (single-process or :func:`expert_parallel`) by their global 2-norm
    (:func:`routelab.parallel.clip_grad_norm_`: the experts' squared norms summed over the ranks, the
    replicated parameters counted once, so every rank scales by the single-process factor).

    Returns:
        The global norm before clipping.
    """
    return float(clip_grad_norm_(model, max_norm, process_group=process_group))


def train_steps(model: nn.Module, settings: Settings, corpus: CharCorpus, steps: int, seed: int, *,
                rank: int = 0, world: int = 1) -> list[float]:
    """Train ``steps`` steps; return the global loss (mean cross-entropy + aux) of every step.

    The batches are those of :func:`~.model.train_run` for ``seed``; with ``world > 1`` this rank takes
    windows ``rank * b .. (rank + 1) * b`` of each (``b = batch / world``) and the loss reported is the
    mean over the ranks (``model`` from :func:`expert_parallel`). The optimiser and schedule are
    :func:`~.model.train_run`'s.
    """
    if settings.batch % world:
        raise ValueError(f"batch={settings.batch} must be divisible by the world size {world}")
    module = model.module if hasattr(model, "module") else model
    device = next(module.parameters()).device
    offsets = corpus.train_batches(settings.steps, settings.batch, settings.seq,
                                   torch.Generator().manual_seed(10_000 + seed))
    share = settings.batch // world
    decay = [p for n, p in module.named_parameters() if p.dim() >= 2 and "norm" not in n]
    rest = [p for n, p in module.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings)
        w = corpus.windows(offsets[step, rank * share:(rank + 1) * share], settings.seq).to(device)
        logits = model(input_ids=w[:, :-1]).logits
        ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1))
        loss = ce + aux_loss(module)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(model, settings.clip)
        opt.step()
        value = loss.detach().double().cpu()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from ..._checks import positive_int_arg
    from . import QUICK, ROUTER_SPECS

    p = argparse.ArgumentParser(prog="python -m routelab.experiments.lm_routers.parallel",
                                description="Train the lm-routers model with its experts sharded over the torchrun "
                                            "ranks (ExpertParallelMoE + DDP).")
    p.add_argument("--router", default="top2", choices=[s.name for s in ROUTER_SPECS], metavar="ROUTER",
                   help=f"a router of the experiment (default top2; of {', '.join(s.name for s in ROUTER_SPECS)})")
    p.add_argument("--steps", type=positive_int_arg, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true",
                   help="rank 0 also trains the single-process model and prints the largest loss difference")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args(argv)
    args.settings = QUICK.with_(steps=args.steps, device=args.device, quick=False)
    try:
        args.settings.validate()
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """The ``torchrun`` entry point (see the module docstring)."""
    from ...parallel import init_distributed
    from .data import build_corpus

    args = _parse(argv)
    settings: Settings = args.settings
    spec = settings.spec(args.router)
    rank, world = init_distributed("nccl" if args.device == "cuda" else "gloo")
    torch.set_num_threads(1)
    corpus = build_corpus()
    gen_device = settings.device if settings.device == "cpu" else f"cuda:{torch.cuda.current_device()}"
    settings = settings.with_(device=gen_device)
    gen = torch.Generator(device=gen_device).manual_seed(20_000 + args.seed)
    model = expert_parallel(build_routelab_model(spec, settings, corpus.vocab, args.seed, gen))
    losses = train_steps(model, settings, corpus, args.steps, args.seed, rank=rank, world=world)
    out: dict[str, Any] = {"router": spec.name, "world": world, "losses": losses}
    if rank == 0:
        for i, v in enumerate(losses):
            print(f"step {i}: loss {v:.6f}", flush=True)
        if args.compare:
            gen = torch.Generator(device=gen_device).manual_seed(20_000 + args.seed)
            single = train_steps(build_routelab_model(spec, settings, corpus.vocab, args.seed, gen), settings,
                                 corpus, args.steps, args.seed)
            diff = max(abs(a - b) for a, b in zip(losses, single))
            out["max_diff"] = diff
            print(f"{spec.name}: {world} ranks vs one process, largest loss difference over {args.steps} steps: "
                  f"{diff:.2e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
