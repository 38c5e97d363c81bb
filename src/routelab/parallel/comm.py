"""Differentiable collectives over ``torch.distributed`` for expert parallelism.

Two primitives, both built on :func:`torch.distributed.all_to_all_single` (gloo on CPU, NCCL on
GPU), both autograd-aware:

* :func:`all_to_all` — rank ``r`` sends ``x[rows for rank s]`` to every rank ``s`` with uneven
  split sizes. Its backward is the same exchange with the send and receive splits swapped: the
  gradient of every row goes back to the rank it came from.
* :func:`all_gather_rows` — every rank receives every rank's rows, concatenated in rank order
  (uneven row counts allowed). It is an all-to-all of ``x`` repeated once per destination, so
  its backward sums, on each rank, the gradients every rank computed for its rows (a
  reduce-scatter).

Every rank of the group must call them in the same order, and every rank whose forward used
them must run the backward too (the standard contract of collectives inside autograd).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_rows", "all_to_all", "comm_device", "exchange_counts", "exchange_counts_and_tags", "group_rank",
           "group_size"]


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (the default group when ``None``)."""
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank within ``group``."""
    return dist.get_rank(group)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where small control tensors (counts, flags, norms) of ``group``'s collectives live: the
    current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_splits(name: str, splits: Sequence[int] | Tensor, world: int) -> list[int]:
    values = splits.tolist() if isinstance(splits, Tensor) else [int(v) for v in splits]
    if len(values) != world or any(v < 0 for v in values):
        raise ValueError(f"{name} must hold {world} non-negative counts (one per rank), got {values}")
    return values


def exchange_counts(send_counts: Sequence[int] | Tensor, group: dist.ProcessGroup | None = None,
                    *, device: torch.device | str | None = None) -> list[int]:
    """Tell every rank how many rows it will receive from this one.

    Args:
        send_counts: ``[world]`` rows this rank sends to each rank.
        group: the process group (default: the world).
        device: where the small count tensor lives (must be a CUDA device for NCCL; default:
            ``send_counts``'s device, or the CPU).

    Returns:
        ``recv_counts``: ``[world]`` rows this rank receives from each rank.
    """
    world = group_size(group)
    if isinstance(send_counts, Tensor):
        device = device if device is not None else send_counts.device
    values = _as_splits("send_counts", send_counts, world)
    if world == 1:
        return values
    send = torch.tensor(values, dtype=torch.long, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def exchange_counts_and_tags(send_counts: Sequence[int] | Tensor, tag: int, group: dist.ProcessGroup | None = None,
                             *, device: torch.device | str | None = None) -> tuple[list[int], list[int]]:
    """:func:`exchange_counts` that also hands every rank this rank's ``tag`` (one all-to-all).

    Args:
        send_counts: ``[world]`` rows this rank sends to each rank.
        tag: an integer in ``[0, 2**63)`` for every rank to see (e.g. a fingerprint of this
            rank's plan, to compare with its own).
        group, device: as in :func:`exchange_counts`.

    Returns:
        ``(recv_counts, tags)``: ``[world]`` rows this rank receives from each rank, and each
        rank's ``tag``.
    """
    world = group_size(group)
    if isinstance(send_counts, Tensor):
        device = device if device is not None else send_counts.device
    values = _as_splits("send_counts", send_counts, world)
    if world == 1:
        return values, [int(tag)]
    send = torch.tensor([[v, int(tag)] for v in values], dtype=torch.long, device=device)  # [world, 2]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    counts, tags = recv.t().tolist()
    return counts, tags


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward is the exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:  # noqa: ANN001
        ctx.send, ctx.recv, ctx.group = send, recv, group
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN205
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad, output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, send_counts: Sequence[int] | Tensor, recv_counts: Sequence[int] | Tensor | None = None,
               group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable all-to-all of rows with uneven splits.

    Args:
        x: ``[sum(send_counts), ...]``: the rows for rank 0, then those for rank 1, ...
        send_counts: ``[world]`` rows sent to each rank.
        recv_counts: ``[world]`` rows received from each rank; ``None`` exchanges the counts
            first (:func:`exchange_counts`, one extra small collective).
        group: the process group (default: the world).

    Returns:
        ``[sum(recv_counts), ...]``: the rows from rank 0, then from rank 1, ... in the order
        each sender wrote them. Gradients flow back to the senders' rows.
    """
    world = group_size(group)
    send = _as_splits("send_counts", send_counts, world)
    if x.shape[0] != sum(send):
        raise ValueError(f"x has {x.shape[0]} rows but send_counts add up to {sum(send)}")
    recv = exchange_counts(send, group, device=x.device) if recv_counts is None else _as_splits(
        "recv_counts", recv_counts, world)
    if world == 1:
        if recv != send:
            raise ValueError(f"a single rank receives what it sends, got send_counts={send}, recv_counts={recv}")
        return x
    return _AllToAll.apply(x, send, recv, group)


def all_gather_rows(x: Tensor, counts: Sequence[int] | Tensor | None = None,
                    group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable all-gather of rows, uneven row counts allowed.

    Args:
        x: ``[n_r, ...]`` this rank's rows.
        counts: ``[world]`` every rank's ``n_r`` if known (else exchanged first).
        group: the process group (default: the world).

    Returns:
        ``[sum(counts), ...]``: every rank's rows in rank order, identical on every rank. The
        backward gives each rank the sum over ranks of the gradients of its rows.
    """
    world = group_size(group)
    n = x.shape[0]
    if counts is None:
        counts = exchange_counts([n] * world, group, device=x.device)
    counts = _as_splits("counts", counts, world)
    if counts[group_rank(group)] != n:
        raise ValueError(f"counts says this rank has {counts[group_rank(group)]} rows but x has {n}")
    if world == 1:
        return x
    return _AllToAll.apply(x.repeat(world, *([1] * (x.dim() - 1))), [n] * world, counts, group)
