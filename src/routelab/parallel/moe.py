"""Expert-parallel MoE: experts sharded over the ranks of a ``torch.distributed`` process group.

Each rank holds the router (replicated) and ``E / world`` experts (rank ``r`` owns experts
``r*E/W .. (r+1)*E/W - 1``). A forward pass on rank ``r`` with its local tokens ``x_r``:

1. token counts ``n_s`` of every rank are exchanged (one tiny all-to-all); the global batch is
   ``N = sum n_s`` tokens, the concatenation of the ranks' batches in rank order;
2. every rank computes its local router logits ``[n_r, E]`` and all-gathers them
   differentiably (:func:`~routelab.parallel.all_gather_rows`): every rank now holds the logits
   of the global batch ``[N, E]``;
3. every rank runs the *same* routing rule and capacity (:func:`routelab.routing.apply_capacity`,
   with ``C`` from the global ``N``) on the global logits. The decision is a deterministic
   function of the logits (and of the generator state for stochastic routers), so it is
   identical on every rank and equal to the single-process layer's on the concatenated batch;
   balanced assignment (BASE, Gumbel-Matching, batchwise, Sinkhorn) is solved over the whole
   global batch, redundantly on every rank;
4. each rank sends the rows of its kept (token, slot) pairs to the ranks owning their experts
   (:func:`~routelab.parallel.all_to_all`, uneven splits; the receive counts follow from the
   global plan, and are also exchanged with a fingerprint of the plan and checked against it
   unless ``check_decisions=False``, which catches ranks whose decisions diverged), runs its
   local experts on ``[E/W, C, d]`` buffers laid out exactly like the single-process buffers,
   and sends the outputs back with the inverse exchange;
5. outputs are combined in token order with the combine weights of its own tokens.

The forward output on rank ``r`` equals rows ``off_r .. off_r + n_r`` of the single-process
layer's output on the global batch; the gradients are those of ``sum_r loss_r`` (see
:meth:`ExpertParallelMoE.reduce_replicated_grads`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._checks import check_capacity, check_positive_int, device_scalar, floating_input, to_device, token_mask
from ..layers.config import MoEConfig
from ..layers.experts import StackedExperts
from ..layers.moe import MoE
from ..routers import Router
from ..routes import Routes
from ..routing import DispatchPlan
from ..routing.masks import real_tokens, scatter_routes
from .comm import all_gather_rows, all_to_all, comm_device, exchange_counts, exchange_counts_and_tags

#: The prime of :meth:`ExpertParallelMoE._plan_fingerprint`.
_FINGERPRINT_PRIME = 2**31 - 1

__all__ = ["ExpertParallelMoE"]


def _into_collective(t: Tensor) -> Tensor:
    """``t`` as the input of a differentiable collective: under grad mode, made to require grad if
    it does not, so that every rank's backward runs the collective's backward.

    Whether ``t`` requires grad is this rank's own state (its router frozen, ``x`` a leaf), which
    the other ranks do not see. A rank whose input did not require grad would skip the backward's
    collective that the others wait in: a hang. The stand-in leaf's gradient is discarded.
    """
    if torch.is_grad_enabled() and not t.requires_grad:
        return t.detach().requires_grad_()
    return t


def _require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ExpertParallelMoE needs an initialised torch.distributed process group: call "
            "routelab.parallel.init_distributed() (or torch.distributed.init_process_group) first, "
            "e.g. under torchrun --nproc_per_node=N"
        )


def _group_position(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(world_size, rank)`` of this process in ``process_group``; ValueError if it is no member
    (``torch.distributed.new_group`` hands non-members a placeholder whose rank is -1)."""
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of process_group: an ExpertParallelMoE "
            "shards its experts over the group's ranks, so build (and call) it only on the ranks passed to "
            "torch.distributed.new_group (e.g. `if rank in ranks:`), or pass a group this rank belongs to")
    return dist.get_world_size(process_group), rank


def _check_shardable(config: MoEConfig) -> None:
    """ValueError for layer options :class:`ExpertParallelMoE` cannot shard (the user's own experts,
    grouped dispatch)."""
    if config.experts is not None:
        raise ValueError("ExpertParallelMoE shards routelab's StackedExperts (plain or gated, e.g. "
                         "activation='swiglu'): it does not take experts=; use the single-process MoE for those")
    if config.dispatch == "grouped":
        raise ValueError("ExpertParallelMoE runs each rank's experts on the buffers its all-to-all fills: "
                         "dispatch='grouped' is for the single-process MoE; use dispatch='auto' or 'buffers'")


class ExpertParallelMoE(MoE):
    """:class:`~routelab.layers.MoE` with its experts sharded over a process group.

    Use it exactly like ``MoE`` inside a script that every rank runs (``torchrun``): each rank
    passes its own tokens; the layer routes the *global* batch (the ranks' batches concatenated
    in rank order), so outputs and gradients equal the single-process ``MoE`` on that batch.

    Every router of :data:`routelab.routers.ROUTERS` works, in capacity and dropless modes.
    Requirements:

    * the router is replicated: the constructor broadcasts its parameters from the group's
      rank 0 (``from_moe`` copies them from the given layer, which must be the same on every
      rank);
    * stochastic routers (``noisy_topk``, ``gumbel_matching``) and ``drop_policy="random"``
      draw their noise for the global batch on every rank, so every rank must draw the same
      numbers: pass a ``generator`` (its state is broadcast from rank 0 at construction and
      then advances identically everywhere), or seed torch's global generator identically on
      every rank. Diverging decisions are detected (the exchanged counts do not match the
      plan) and raise ``RuntimeError``;
    * every rank calls the layer the same number of times, and runs backward through the same
      loss expression (the exchanges are collectives);
    * a layer pickled whole (``torch.save(model)``) keeps its rank's shard: its forward raises
      unless it runs as that rank of a group of that size (move checkpoints between ranks with
      ``state_dict()``, saved and loaded per rank).

    The router is called as in ``MoE`` (``router(x, capacity)``), so its hooks run: a forward
    pre-hook on this rank's tokens (it may change their values, not their number), a forward
    hook on the proposal for the global batch (``Routes [N, slots]``, the same on every rank).

    Cost of global routing: every rank receives the ``[N, E]`` logits (``N E`` floats, small
    next to the ``N d`` activations) and solves the routing problem of the global batch;
    for balanced assignment that is the exact solve on ``N`` tokens, repeated on every rank
    (``W`` times the work of one solve, in parallel wall time the same as one solve).

    Gradients: the gradient of the experts on rank ``r`` is already the full gradient of
    ``sum_s loss_s`` (tokens of every rank flow back through the all-to-all). The router's
    gradient on rank ``r`` only holds its share; :meth:`reduce_replicated_grads` sums it over
    the ranks (call it after ``backward``, before the optimizer step). Clip with
    :func:`routelab.parallel.clip_grad_norm_` (the norm of every rank's experts, the same on
    every rank; torch's sees one shard and pulls the router replicas apart), and with a
    ``GradScaler`` call :func:`routelab.parallel.all_reduce_found_inf` after ``unscale_``.
    ``routes.aux`` holds the auxiliary losses of the global batch, the same on every rank: add
    ``aux / world_size`` to each rank's loss (or add it on one rank only) so the summed gradient
    counts it once; the same holds for ``routelab.aux_loss(model)``, which reads those records (divide it by the
    world size too).

    Args:
        d_model, d_hidden, num_experts: as :class:`~routelab.layers.MoE`; ``num_experts`` is
            the global ``E`` and must be divisible by the group's size.
        process_group: the group the experts are sharded over (``None``: the default group).
        router, capacity_factor, k, router_kwargs, drop_policy, importance_weighting,
            activation, bias, generator, device, dtype, eval_capacity_factor, check_finite: as
            :class:`~routelab.layers.MoE`.
        dispatch: ``"auto"`` or ``"buffers"``: each rank runs its experts on the ``[E / W, C,
            d_model]`` buffers the all-to-all fills (``"grouped"`` is a ValueError here).
        gated: gated (GLU, e.g. ``activation="swiglu"``) experts, sharded like plain ones.
        experts: not supported (the layer shards routelab's stacked experts): a ValueError unless ``None``.
        seed: base seed of the experts' initialisation; expert ``e`` is initialised from
            ``seed + e``, so the weights do not depend on the world size. ``None``: drawn from
            torch's global generator (one number on every rank, after the router is built) and
            rank 0's broadcast. The experts draw nothing from torch's global generator, so the
            layer consumes it alike at every world size: a model built after one
            ``torch.manual_seed`` is the same at any world size.
        check_decisions: exchange the per-rank dispatch counts and a fingerprint of the global
            plan (one small all-to-all per forward) and raise if either differs from this
            rank's, i.e. if the ranks' routing decisions diverged (plans that differ in any row
            are told apart except with probability about ``2**-31``). ``False`` trusts the plan
            and saves the exchange.

    Shapes:
        input ``x [..., d_model]`` (this rank's tokens, any number, also 0) -> ``[...,
        d_model]`` and a :class:`~routelab.Routes` whose per-slot tensors cover this rank's
        tokens (``[n_r, slots]``) while ``aux`` and ``stats`` describe the global batch
        (``stats["global_tokens"]`` is ``N``).

    Example (every rank, under ``torchrun --nproc_per_node=2``)::

        routelab.parallel.init_distributed()          # gloo on CPU, NCCL on GPU
        moe = ExpertParallelMoE(512, 2048, 8, router="topk", k=2)
        y, routes = moe(x_local)                       # experts 0-3 on rank 0, 4-7 on rank 1
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        router: str | Router = "topk",
        capacity_factor: float | None = 1.0,
        k: int | None = None,
        router_kwargs: dict[str, Any] | None = None,
        drop_policy: str = "position",
        importance_weighting: bool = False,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        bias: bool = True,
        gated: bool = False,
        experts: nn.Module | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        check_decisions: bool = True,
        eval_capacity_factor: float | None = None,
        check_finite: bool | None = None,
        dispatch: str = "auto",
        _sync: bool = True,
    ) -> None:
        _require_initialized()
        world, rank = _group_position(process_group)
        check_positive_int("num_experts", num_experts)
        if num_experts % world:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the process group's size {world} "
                f"(each rank holds num_experts / world experts); use a multiple of {world}"
            )
        config = MoEConfig(d_model, d_hidden, num_experts, router=router, capacity_factor=capacity_factor, k=k,
                           router_kwargs=router_kwargs, drop_policy=drop_policy,
                           importance_weighting=importance_weighting, activation=activation, bias=bias, gated=gated,
                           experts=experts, eval_capacity_factor=eval_capacity_factor, check_finite=check_finite,
                           dispatch=dispatch)
        _check_shardable(config)
        # The full expert stack is built on the meta device (no memory) and replaced by this
        # rank's slice: only E / world experts are ever materialised. A router built by name is
        # built on the real device. The slice too is built on the meta device and then allocated
        # (to_empty) before init_experts or from_moe fills it: building it on the real device would
        # draw E / world experts' nn.Linear initialisation from torch's global generator, so that
        # everything built after this layer (the next layer's router, the seed drawn below) would
        # depend on the world size.
        nn.Module.__init__(self)
        self._build(config, generator=generator, device="meta", dtype=dtype, router_device=device)
        self.process_group = process_group
        self.check_decisions = bool(check_decisions)
        self._fingerprint_weights: Tensor | None = None  # (_plan_fingerprint's, cached per plan size)
        self.world_size, self.rank = world, rank
        self.local_experts = num_experts // world
        self.expert_offset = rank * self.local_experts
        local = StackedExperts(d_model, d_hidden, self.local_experts, activation=config.activation,
                               bias=config.bias, gated=config.gated, device="meta", dtype=dtype)
        self.experts = local.to_empty(device=torch.device(device) if device is not None else torch.get_default_device())
        if _sync:
            if seed is None:
                drawn = torch.randint(0, 2**62, (1,), dtype=torch.long)
                seed = int(self._broadcast(drawn.to(self._comm_device())).item())
            self.init_experts(seed)
            self.sync_replicated()

    # ------------------------------------------------------------------ construction helpers

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertParallelMoE:
        """A copy that shares the process group (a communicator is not data: an EMA or best-model
        snapshot of a layer over a sub-group failed with "cannot pickle 'ProcessGroup'")."""
        if self.process_group is not None:
            memo.setdefault(id(self.process_group), self.process_group)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    # -- state_dict: which shard of the experts a checkpoint holds -------------------------------------
    def get_extra_state(self) -> dict[str, int]:
        """The shard a ``state_dict`` holds, saved with it: ``{"num_experts", "expert_offset",
        "local_experts"}`` (a review: rank 1's checkpoint loaded into rank 0 silently put experts
        2-3 in the slots of 0-1)."""
        return {"num_experts": self.num_experts, "expert_offset": self.expert_offset,
                "local_experts": self.local_experts}

    def set_extra_state(self, state: Any) -> None:
        """Check that a loaded ``state_dict`` holds this rank's shard (ValueError naming both)."""
        mine = self.get_extra_state()
        if not isinstance(state, dict) or {k: state.get(k) for k in mine} != mine:
            raise ValueError(
                f"this state_dict holds the experts {state!r}, but this rank's layer holds {mine}: load the "
                "checkpoint saved by the rank with the same expert_offset and world size (or a single-process "
                "MoE's state_dict through ExpertParallelMoE.from_moe)")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """As ``nn.Module``'s, except that a ``state_dict`` saved before the shard was recorded (no
        ``_extra_state``) still loads with ``strict=True``, unchecked."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)

    def __getstate__(self) -> dict[str, Any]:
        """Pickling (``torch.save`` of the whole layer) over a sub-group is refused with the fix:
        a process group belongs to the running job and cannot be saved. A layer over the default
        group pickles with its shard (``rank``, ``world_size``, ``expert_offset``): the forward of
        the unpickled layer raises unless it runs as that rank of a group of that size (save
        ``state_dict()`` per rank to move checkpoints between ranks)."""
        if self.process_group is not None:
            raise TypeError("an ExpertParallelMoE over a process group other than the default one cannot be pickled "
                            "whole (the group belongs to the running job): save layer.state_dict() (this rank's "
                            "experts and the router) and load it into a layer built on the new group")
        return self.__dict__.copy()

    @classmethod
    def from_moe(cls, moe: MoE, process_group: dist.ProcessGroup | None = None, *,
                 check_decisions: bool = True) -> ExpertParallelMoE:
        """Shard an existing single-process :class:`~routelab.layers.MoE` (same on every rank).

        The router is copied (its ``generator``, if any, is shared with ``moe``, not copied: the
        router's own generator stays the router's, the layer's ``generator`` the layer's, as in
        ``moe``); this rank keeps a copy of its slice of the experts, with their
        ``requires_grad`` (frozen experts stay frozen). Nothing is broadcast: ``moe`` must hold the
        same weights on every rank (build it after an identical ``torch.manual_seed``, or load one
        checkpoint).
        """
        _require_initialized()
        if not isinstance(moe, MoE) or isinstance(moe, ExpertParallelMoE):
            raise ValueError(f"moe must be a single-process routelab MoE, got {type(moe).__name__}")
        memo: dict[int, Any] = {}
        if moe.router.generator is not None:
            memo[id(moe.router.generator)] = moe.router.generator
        router = copy.deepcopy(moe.router, memo)
        router_generator = router.generator  # moe.router's own (the layer build below sets the layer's)
        _check_shardable(moe.config)
        ex = moe.experts
        param = ex.w1
        config = moe.config.replace(router=router, k=None, router_kwargs=None)  # the copied instance
        out = cls(**config.layer_kwargs(), process_group=process_group,
                  generator=moe.generator, device=param.device, dtype=param.dtype, check_decisions=check_decisions,
                  _sync=False)
        out.router.generator = router_generator
        lo, hi = out.expert_offset, out.expert_offset + out.local_experts
        with torch.no_grad():
            for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
                src = getattr(ex, name)
                if src is not None:
                    dst = getattr(out.experts, name)
                    dst.copy_(src[lo:hi])
                    dst.requires_grad_(src.requires_grad)
        out.train(moe.training)
        return out

    @classmethod
    def from_config(cls, config: MoEConfig, process_group: dist.ProcessGroup | None = None, *,
                    generator: torch.Generator | None = None, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None, seed: int | None = None,
                    check_decisions: bool = True) -> ExpertParallelMoE:
        """The layer a :class:`~routelab.layers.MoEConfig` describes, its experts sharded over
        ``process_group`` (the other arguments as in the constructor)."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a routelab.layers.MoEConfig, got {type(config).__name__}")
        return cls(**config.layer_kwargs(), process_group=process_group, generator=generator, device=device,
                   dtype=dtype, seed=seed, check_decisions=check_decisions)

    def init_experts(self, seed: int) -> None:
        """Initialise the local experts like ``nn.Linear``, expert ``e`` from ``seed + e``."""
        ex = self.experts
        with torch.no_grad():
            for i in range(self.local_experts):
                g = torch.Generator(device=ex.w1.device).manual_seed(int(seed) + self.expert_offset + i)
                layers = [(ex.w1, ex.b1, ex.d_model), (ex.w2, ex.b2, ex.d_hidden)]
                if ex.w3 is not None:
                    layers.append((ex.w3, ex.b3, ex.d_model))
                for w, b, fan_in in layers:
                    bound = fan_in ** -0.5
                    w[i].uniform_(-bound, bound, generator=g)
                    if b is not None:
                        b[i].uniform_(-bound, bound, generator=g)

    def _comm_device(self) -> torch.device:
        """Device of small control tensors: CUDA for NCCL, else the CPU."""
        return comm_device(self.process_group)

    def _check_position(self) -> None:
        """RuntimeError unless this process is still the rank of the process group whose experts the
        layer holds (host-side lookups, no collective).

        A layer pickled whole (``torch.save(model)``) keeps the shard of the rank that saved it:
        loaded on another rank, or in a job of another size, it would silently compute as that rank.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ExpertParallelMoE needs an initialised torch.distributed process group at every call (a layer "
                "loaded with torch.load outside a distributed job cannot run): call "
                "routelab.parallel.init_distributed() first; to use the experts in a single process, gather the "
                "ranks' state_dicts into a routelab MoE")
        world, rank = _group_position(self.process_group)
        if (world, rank) != (self.world_size, self.rank):
            last = self.expert_offset + self.local_experts - 1
            raise RuntimeError(
                f"this ExpertParallelMoE holds the experts {self.expert_offset}..{last} of rank {self.rank} of "
                f"{self.world_size}, but runs on rank {rank} of {world} of its process group: a layer pickled "
                "whole (torch.save(model) / torch.load) keeps the shard of the rank that saved it. Save and load "
                "layer.state_dict() per rank instead (each rank loads the one it saved, into a layer built "
                "on this job's group), or re-shard a single-process MoE with ExpertParallelMoE.from_moe")

    def _broadcast(self, t: Tensor) -> Tensor:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast(t, src, group=self.process_group)
        return t

    def sync_replicated(self) -> None:
        """Broadcast the router's parameters, buffers and generator state from the group's rank 0."""
        with torch.no_grad():
            for t in list(self.router.parameters()) + list(self.router.buffers()):
                if t.device.type == "meta":
                    continue
                moved = t.detach().to(self._comm_device()).clone()
                t.copy_(self._broadcast(moved).to(t.device))
        gen = self.router.generator
        if gen is not None:
            state = gen.get_state().to(self._comm_device())
            gen.set_state(self._broadcast(state).cpu())
        if self.generator is not None and self.generator is not gen:
            state = self.generator.get_state().to(self._comm_device())
            self.generator.set_state(self._broadcast(state).cpu())

    def replicated_parameters(self) -> Iterator[nn.Parameter]:
        """The router's parameters (the same on every rank; gradients need a sum over ranks)."""
        return self.router.parameters()

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's experts' parameters (sharded; their gradients are already complete)."""
        return self.experts.parameters()

    def reduce_replicated_grads(self) -> None:
        """Sum the router's gradients over the ranks (call after ``backward``).

        Afterwards every rank holds the router gradient of ``sum_r loss_r``, equal to the
        single-process gradient of the same total loss on the global batch. As there, a parameter
        that no rank has a gradient for (a frozen router, ``requires_grad=False``, or one the
        loss does not reach) keeps ``grad = None``, so an optimizer leaves it alone (no weight
        decay or momentum step on a zero gradient).
        """
        params = list(self.replicated_parameters())
        if not params:
            return
        # Which parameters any rank has a trainable gradient for: one collective for all of them,
        # over every parameter, so that the collectives match even where ranks froze different ones.
        has_grad = torch.tensor([p.requires_grad and p.grad is not None for p in params], dtype=torch.float32,
                                device=self._comm_device())
        dist.all_reduce(has_grad, op=dist.ReduceOp.SUM, group=self.process_group)
        for p, anywhere in zip(params, has_grad.tolist(), strict=True):
            if not anywhere:
                continue
            if p.grad is None:  # another rank has one: this rank's share is zero
                p.grad = torch.zeros_like(p)
            buf = p.grad.to(self._comm_device())
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.process_group)
            if buf is not p.grad:
                p.grad.copy_(buf)

    # ------------------------------------------------------------------ forward

    def _route_global(self, flat: Tensor, counts: list[int], capacity: int) -> Routes:
        """The router's proposal for the global batch, from the gathered per-token features.

        The router is called as a module, ``router(flat, capacity)``, as :class:`~routelab.layers.MoE`
        calls it, with its ``forward`` standing in for one that computes this rank's features,
        all-gathers them and routes the global batch: the router's hooks (and torch's global module
        hooks) run as in ``MoE``. A forward pre-hook sees (and may replace) this rank's tokens
        ``[n_r, d_model]`` and the global capacity; a forward hook sees the proposal for the global
        batch (``Routes [N, slots]``, the same on every rank, as ``MoE`` on the concatenated batch)
        and may replace it. Every rank runs the hooks.
        """
        router = self.router
        if type(router).forward is not Router.forward or "forward" in vars(router):
            raise ValueError(
                f"{type(router).__name__} overrides Router.forward; ExpertParallelMoE routes the global batch "
                "from gathered per-token features (Router.features, then Router.route): put the token-local "
                "computation in features() and the batch-level rule in route()"
            )
        group, mine = self.process_group, counts[self.rank]

        def route_global_batch(x: Tensor, capacity: int | None = None, *, mask: Tensor | None = None) -> Routes:
            if mask is not None:
                raise ValueError("ExpertParallelMoE calls its router without a mask (the layer drops masked tokens "
                                 "itself): a forward pre-hook on the router must not add mask=")
            if not isinstance(x, Tensor) or x.ndim != 2 or x.shape != (mine, router.d_model):
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(
                    f"the router of an ExpertParallelMoE must be called with this rank's {mine} tokens "
                    f"[{mine}, {router.d_model}], got {got}: a forward pre-hook on the router may change the "
                    "tokens' values but not their number (the other ranks expect this rank's count)")
            feats = router.gate(x).scores
            gathered = all_gather_rows(_into_collective(feats), counts, group)
            return router.route_features(gathered, check_capacity(capacity))

        # An instance attribute shadows Router.forward for this one call: nn.Module.__call__ then
        # runs the hooks around it exactly as it does around Router.forward in MoE.
        router.forward = route_global_batch
        try:
            return router(flat, capacity)
        finally:
            del router.forward

    def forward(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Routes]:
        """Apply the layer to this rank's tokens.

        Args:
            x: ``[..., d_model]`` this rank's tokens.
            mask: optional ``BoolTensor`` of ``x.shape[:-1]`` (``True`` = a real token): masked
                tokens are left out of the global batch (no capacity, no solve, no statistic)
                and get a zero output.

        Returns:
            ``(y [..., d_model], routes)``: ``y`` equals this rank's rows of the single-process
            layer's output on the global batch; ``routes`` covers this rank's tokens (``aux``
            and ``stats`` the global batch).

        Raises:
            RuntimeError: no initialised process group, or the layer holds another rank's shard
                (pickled whole on another rank, or in a job of another size); the ranks' routing
                decisions diverged (``check_decisions``).
            ValueError: ``x`` of the wrong shape or dtype; a router pre-hook changed the number
                of tokens.
        """
        self._check_position()  # a layer unpickled on another rank / in another world: an error, not rank r's shard
        self.forget_routing()  # the last step's graph goes before this one is built (record.py)
        # The dtype policy of MoE: the experts compute (and the ranks exchange tokens) in the
        # experts' dtype whatever each rank's input dtype; the output comes back in x's dtype.
        compute = floating_input(x, "x", self._experts_dtype(x))
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [..., d_model={self.d_model}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        mask = token_mask(mask, lead)
        if mask is not None:  # the real tokens alone, then back in place
            index = real_tokens(mask)
            y, routes = self.forward(x.reshape(-1, self.d_model).index_select(0, index))
            out = y.new_zeros(lead.numel(), self.d_model).index_copy(0, index, y)
            return out.reshape(*lead, self.d_model), scatter_routes(routes, index, lead.numel(), check=False)
        flat = x.reshape(-1, self.d_model)
        n, d = flat.shape
        W, r, group = self.world_size, self.rank, self.process_group
        dev = flat.device
        counts = exchange_counts([n] * W, group, device=self._comm_device())
        N = sum(counts)
        off = [0]
        for c in counts:
            off.append(off[-1] + c)
        lo = off[r]

        capacity = self.capacity(N)
        proposed = self._route_global(flat, counts, capacity)
        routes, plan = self.plan(proposed, capacity)
        combine = routes.gate * routes.weight if self.importance_weighting else routes.gate
        local_routes = Routes(
            expert=routes.expert[lo:lo + n], gate=routes.gate[lo:lo + n], keep=routes.keep[lo:lo + n],
            weight=routes.weight[lo:lo + n], log_prob=routes.log_prob[lo:lo + n], aux=routes.aux,
            stats={**routes.stats, "global_tokens": device_scalar(N, routes.expert, torch.long)},
        )
        C = plan.capacity
        if C == 0:  # no real token on any rank: a zero output that stays in the graph, as MoE's does
            self.record_routing(local_routes.aux, local_routes.stats)
            return (flat * 0).reshape(*lead, d), local_routes

        # Who sends what to whom: every rank derives it from the same global plan. The counts (and
        # the plan's fingerprint) are computed on the device and read to the host at once: one
        # host sync; the row lists are then sliced from stable sorts to those known lengths.
        El = self.local_experts
        rows_per_rank = El * C
        tok = plan.token_of_row.to(dev)  # [E*C] = [W * rows_per_rank], N where the row is empty
        bounds = to_device(torch.tensor(off[1:]), dev)  # (through pinned memory: no host sync)
        src = torch.bucketize(tok, bounds, right=True)  # rank owning each row's token (W if empty)
        mine = src == r  # rows holding my tokens; ascending row order = grouped by destination rank
        send_counts_t = mine.view(W, rows_per_rank).sum(1)  # [W] rows to each expert rank
        local_src = src[r * rows_per_rank:(r + 1) * rows_per_rank]
        planned_t = torch.zeros(W + 1, dtype=torch.long, device=dev).scatter_add_(
            0, local_src, torch.ones_like(local_src))[:W]  # [W] rows of my experts from each rank
        head = [send_counts_t, planned_t]
        if self.check_decisions:
            head.append(self._plan_fingerprint_tensor(tok).view(1))
        host = torch.cat(head).tolist()  # the one device-to-host read of the plan
        send_counts, planned = host[:W], host[W:2 * W]
        # My rows in ascending order (rows not mine sort after them), and my experts' filled rows
        # by source rank, ascending within each (empty rows, source W, last): stable sorts.
        send_rows = torch.argsort((~mine).to(torch.uint8), stable=True)[:sum(send_counts)]
        send_tok = tok[send_rows] - lo
        recv_rows = torch.argsort(local_src, stable=True)[:sum(planned)]  # receive order: by source rank
        recv_counts, differ = planned, None
        if self.check_decisions:
            mine_tag = host[2 * W]
            recv_counts, tags = exchange_counts_and_tags(send_counts, mine_tag, group, device=self._comm_device())
            if recv_counts != planned:
                differ = f"receiving {recv_counts} rows per rank, the plan says {planned}"
            elif any(t != mine_tag for t in tags):
                differ = f"the plans' fingerprints per rank are {tags}, this rank's {mine_tag}"
        if differ is not None:
            raise RuntimeError(
                f"rank {r}: the routing decisions differ across ranks ({differ}); stochastic routers and "
                "drop_policy='random' need the same generator state on every rank (pass generator= with the "
                "same seed, or seed torch identically)"
            )

        # Tokens to the experts' ranks; the received ones (in receive order) fill this rank's
        # [E/W, C, d] buffers, laid out as the global plan's rows of its experts.
        recv_x = all_to_all(_into_collective(compute.reshape(-1, d)[send_tok]), send_counts, recv_counts, group)
        receive = DispatchPlan.from_rows(recv_rows.unsqueeze(-1), El, C)
        out = self.experts(receive.dispatch(recv_x)).reshape(rows_per_rank, -1)
        back = all_to_all(out[recv_rows], recv_counts, send_counts, group)  # in send order

        # Combine this rank's tokens: their pairs' outputs came back as the rows of one buffer
        # [1, sent rows, d], in send order.
        index_of_row = torch.full((tok.numel() + 1,), send_rows.numel(), dtype=torch.long, device=dev)
        index_of_row[send_rows] = torch.arange(send_rows.numel(), device=dev)
        returned = DispatchPlan.from_rows(index_of_row[plan.row_of_slot[lo:lo + n].to(dev)], 1, send_rows.numel())
        y = returned.combine(back.view(1, send_rows.numel(), back.shape[-1]), combine[lo:lo + n]).to(x.dtype)
        self.record_routing(local_routes.aux, local_routes.stats)
        return y.reshape(*lead, d), local_routes

    def _plan_fingerprint(self, token_of_row: Tensor) -> int:
        """``sum_r (token_of_row[r] + 1) m_r mod P`` (``P = 2^31 - 1``, ``m_r`` uniform in ``[1, P)`` from
        a fixed seed): equal on ranks whose plans fill every row with the same token; two plans that
        differ in any row give the same value with probability about ``1 / P``. One host read."""
        return int(self._plan_fingerprint_tensor(token_of_row))

    def _plan_fingerprint_tensor(self, token_of_row: Tensor) -> Tensor:
        """:meth:`_plan_fingerprint` as a 0-dim ``LongTensor`` on ``token_of_row``'s device (no host read)."""
        rows = token_of_row.numel()
        weights = self._fingerprint_weights
        if weights is None or weights.numel() != rows or weights.device != token_of_row.device:
            weights = torch.randint(1, _FINGERPRINT_PRIME, (rows,), generator=torch.Generator().manual_seed(0))
            weights = self._fingerprint_weights = to_device(weights, token_of_row.device)  # (no host sync)
        terms = (token_of_row.long() % _FINGERPRINT_PRIME + 1) * weights % _FINGERPRINT_PRIME  # < 2^31 each
        return terms.sum() % _FINGERPRINT_PRIME  # a sum of < 2^32 terms of < 2^31: no overflow

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", world_size={self.world_size}, rank={self.rank}, "
                f"experts={self.expert_offset}..{self.expert_offset + self.local_experts - 1} of {self.num_experts}")
