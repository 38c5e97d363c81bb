"""The MNIST MoE classifier, one training run per (router, seed), and its evaluation.

Model (tokens = images): ``x [batch, 784] -> Linear(784, d_model) -> h``; ``h = h +
MoE(LayerNorm(h))[0]`` (one residual MoE layer, pre-norm); ``LayerNorm -> Linear(d_model, 10)``.
The embedding is linear, so every non-linearity of the network is inside the experts: a
network whose MoE output were zero would be a linear classifier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...gates.batchwise import batchwise_mask, threshold_mask
from ...layers import MoE
from ...routers import BatchwiseRouter
from ..kit.divergence import check_finite, diverged_on_error
from ..kit.router_sweep import check_distinct

__all__ = ["ROUTER_SPECS", "MnistMoE", "RouterSpec", "Settings", "evaluate", "prepare_data", "train_run"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass(frozen=True)
class RouterSpec:
    """One routing method of the sweep.

    Attributes:
        name: label used in records and the report.
        router: the router name passed to :class:`routelab.layers.MoE`.
        k: ``k`` passed to the layer (``None`` for routers with a fixed number of experts).
        importance_weighting: the layer's ``importance_weighting``.
        router_kwargs: options of the router.
        note: one line for the report.
    """

    name: str
    router: str
    k: int | None = None
    importance_weighting: bool = False
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""


#: The routers compared, all through ``MoE(..., router=name)``.
ROUTER_SPECS: tuple[RouterSpec, ...] = (
    RouterSpec("softmax", "softmax", note="dense softmax gating, every expert on every token"),
    RouterSpec("switch", "topk", k=1, note="top-1 (Switch), balance loss 0.01"),
    RouterSpec("top2", "topk", k=2, note="top-2, full-softmax weights, balance loss 0.01"),
    RouterSpec("noisy_top2", "noisy_topk", k=2, note="noisy top-2, importance + load losses 0.1 (Shazeer et al.)"),
    RouterSpec("batchwise", "batchwise", k=2,
               note="App. F batchwise mask in training, learned thresholds at inference, k=2"),
    RouterSpec("base", "base", router_kwargs={"eval_balanced": True},
               note="BASE: exact balanced assignment (train and eval)"),
    RouterSpec("sinkhorn", "sinkhorn", k=1, note="Sinkhorn-balanced top-1 (S-BASE), unbalanced at eval"),
    RouterSpec("gumbel_matching", "gumbel_matching", importance_weighting=True, router_kwargs={"eval_balanced": True},
               note="Gumbel-Matching sample with importance weights (Kool et al.), balanced assignment at eval"),
)


@dataclass(frozen=True)
class Settings:
    """The size of a sweep.

    Attributes:
        routers: names of :data:`ROUTER_SPECS` to run.
        seeds: seeds (data order, initialisation, router noise).
        epochs: passes over the training images used.
        train_images: number of training images used (the first ones of MNIST's 60k).
        test_images: number of test images evaluated (the first ones of the 10k).
        batch_size: training batch, also the evaluation batch (must make ``k * batch / E`` an
            integer for the batchwise router).
        d_model, d_hidden, num_experts: the MoE layer.
        capacity_factor: the layer's capacity factor (training and evaluation).
        lr: Adam learning rate.
        log_every: steps per point of the load-over-training curve.
        batch1_images: test images evaluated one at a time (batch size 1), for every router
            (the batchwise router's threshold mask is also evaluated at batch size 1 on all
            ``test_images``).
        batchwise_eval_batches: evaluation batch sizes of the batchwise mask at inference.
        threads: torch threads.
        quick: whether this is the quick form (said in the report).
    """

    routers: tuple[str, ...] = tuple(s.name for s in ROUTER_SPECS)
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 3
    train_images: int = 60000
    test_images: int = 10000
    batch_size: int = 200
    d_model: int = 64
    d_hidden: int = 128
    num_experts: int = 8
    capacity_factor: float = 1.0
    lr: float = 1e-3
    log_every: int = 20
    batch1_images: int = 2000
    batchwise_eval_batches: tuple[int, ...] = (200, 40, 8, 4)
    threads: int = 1
    quick: bool = False

    def spec(self, name: str) -> RouterSpec:
        """The :class:`RouterSpec` called ``name``."""
        for s in ROUTER_SPECS:
            if s.name == name:
                return s
        raise ValueError(f"unknown router spec {name!r}; choose one of {', '.join(s.name for s in ROUTER_SPECS)}")

    def validate(self) -> None:
        """Raise ValueError on sizes the sweep cannot use."""
        for name in self.routers:
            self.spec(name)
        check_distinct("routers", self.routers)
        check_distinct("seeds", self.seeds)
        if self.train_images % self.batch_size or self.test_images % self.batch_size:
            raise ValueError(
                f"train_images={self.train_images} and test_images={self.test_images} must be multiples of "
                f"batch_size={self.batch_size} (the batchwise mask needs full batches)"
            )
        if self.batch1_images > self.test_images or self.batch1_images % self.batch_size:
            raise ValueError(f"batch1_images={self.batch1_images} must be a multiple of batch_size={self.batch_size} "
                             f"and at most test_images={self.test_images}")
        for name in self.routers:
            if self.spec(name).router != "batchwise":
                continue
            k = self.spec(name).k or 1
            for b in (self.batch_size, *self.batchwise_eval_batches):
                if (k * b) % self.num_experts or self.test_images % b:
                    raise ValueError(f"batch size {b}: k*batch = {k}*{b} must be divisible by num_experts="
                                     f"{self.num_experts} and test_images={self.test_images} by the batch "
                                     f"(router {name})")


class MnistMoE(nn.Module):
    """Linear embedding, one pre-norm residual MoE layer, linear classifier.

    Args:
        spec: the routing method.
        settings: sizes.
        generator: randomness of stochastic routers.

    Shapes:
        ``x [batch, 784]`` -> ``(logits [batch, 10], routes)``.
    """

    def __init__(self, spec: RouterSpec, settings: Settings, generator: torch.Generator | None = None) -> None:
        super().__init__()
        d = settings.d_model
        self.embed = nn.Linear(28 * 28, d)
        self.norm = nn.LayerNorm(d)
        self.moe = MoE(d, settings.d_hidden, settings.num_experts, router=spec.router, k=spec.k,
                       router_kwargs=dict(spec.router_kwargs) or None, capacity_factor=settings.capacity_factor,
                       eval_capacity_factor=settings.capacity_factor,  # the protocol: the same capacity at test
                       importance_weighting=spec.importance_weighting, generator=generator)
        self.out_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: Tensor):
        h = self.embed(x)
        y, routes = self.moe(self.norm(h))
        return self.head(self.out_norm(h + y)), routes


def prepare_data(settings: Settings) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MNIST as normalised float32 ``[N, 784]`` and int64 labels ``(train_x, train_y, test_x, test_y)``."""
    from ...data import load_mnist

    s = load_mnist()

    def norm(x: Tensor) -> Tensor:
        return ((x.reshape(x.shape[0], -1).float() / 255.0) - MNIST_MEAN) / MNIST_STD

    return (norm(s.train_x[: settings.train_images]), s.train_y[: settings.train_images],
            norm(s.test_x[: settings.test_images]), s.test_y[: settings.test_images])


class ProposalCounter:
    """Counts the pairs a router *proposes* per expert (before the layer's capacity) via a forward hook.

    Attributes:
        last: ``LongTensor [E]`` proposed (token, slot) pairs per expert of the last call.
    """

    def __init__(self, model: MnistMoE) -> None:
        self.num_experts = model.moe.num_experts
        self.last = torch.zeros(self.num_experts, dtype=torch.long)
        self._handle = model.moe.router.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, routes: Any) -> None:
        self.last = torch.bincount(routes.expert[routes.keep].reshape(-1), minlength=self.num_experts)

    def remove(self) -> None:
        """Detach the hook."""
        self._handle.remove()


def _cv(x: Tensor) -> float:
    x = x.float()
    return float(x.std(unbiased=False) / x.mean().clamp(min=1e-12))


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


@torch.no_grad()
def evaluate(model: MnistMoE, x: Tensor, y: Tensor, batch_size: int) -> dict[str, float]:
    """Accuracy and routing statistics on ``x [N, 784]`` in batches of ``batch_size`` (model in eval mode).

    Returns:
        ``acc``; ``load_cv`` (mean over batches of the layer's ``load_cv``, the CV of the kept
        load), ``proposed_load_cv`` (CV over experts of the pairs the router proposed, summed over
        all batches), ``dropped_fraction`` (pairs dropped by the capacity / proposed pairs, over
        all batches), ``tokens_dropped`` (fraction of images with no expert kept),
        ``experts_per_token`` (kept pairs per image).
    """
    model.eval()
    counter = ProposalCounter(model)
    correct, cvs, kept, no_expert = 0, [], 0, 0
    proposed = torch.zeros(model.moe.num_experts, dtype=torch.long)
    try:
        for i in range(0, x.shape[0], batch_size):
            xb, yb = x[i:i + batch_size], y[i:i + batch_size]
            logits, routes = model(xb)
            correct += int((logits.argmax(-1) == yb).sum())
            cvs.append(float(routes.stats["load_cv"]))
            kept += int(routes.keep.sum())
            proposed += counter.last
            no_expert += int((~routes.keep.any(-1)).sum())
    finally:
        counter.remove()
    n = x.shape[0]
    total = int(proposed.sum())
    return {
        "acc": correct / n,
        "load_cv": _mean(cvs),
        "proposed_load_cv": _cv(proposed),
        "dropped_fraction": 1 - kept / total if total else 0.0,
        "tokens_dropped": no_expert / n,
        "experts_per_token": kept / n,
    }


@torch.no_grad()
def batchwise_diagnostics(model: MnistMoE, x: Tensor, y: Tensor, settings: Settings) -> dict[str, Any]:
    """App. F at inference for a batchwise router: batchwise vs threshold masks.

    Returns:
        ``acc_batchwise`` (``{batch: accuracy}`` with ``inference="batchwise"`` over batches of
        each size of ``settings.batchwise_eval_batches``), ``acc_threshold_batch1`` (threshold
        mask, one image at a time, all of ``x``), ``mask_agreement`` (fraction of (image,
        expert) entries where the threshold mask equals the batchwise mask of the same training-
        size batch), ``threshold_experts_per_token`` (mean number of experts passing the
        thresholds), ``threshold_load_cv`` (CV over experts of the number of images passing each
        threshold, over the whole set), ``thresholds`` (the learned ``T``).
    """
    router = model.moe.router
    if not isinstance(router, BatchwiseRouter):
        raise ValueError("batchwise_diagnostics needs a model with the batchwise router")
    model.eval()
    old = router.inference
    router.inference = "batchwise"
    try:
        acc_bw = {str(b): evaluate(model, x, y, b)["acc"] for b in settings.batchwise_eval_batches}
    finally:
        router.inference = old
    thr1 = evaluate(model, x, y, 1)
    model.eval()
    bs = settings.batch_size
    agree, total, passing = 0, 0, torch.zeros(router.num_experts)
    for i in range(0, x.shape[0], bs):
        h = model.norm(model.embed(x[i:i + bs]))
        probs = torch.softmax(router.logits(h), -1)
        bw = batchwise_mask(probs, router.k)
        th = threshold_mask(probs, router.thresholds.detach())
        agree += int((bw == th).sum())
        total += bw.numel()
        passing += th.sum(0).float()
    return {
        "acc_batchwise": acc_bw,
        "acc_threshold_batch1": thr1["acc"],
        "threshold_batch1_tokens_dropped": thr1["tokens_dropped"],
        "mask_agreement": agree / total,
        "threshold_experts_per_token": float(passing.sum()) / x.shape[0],
        "threshold_load_cv": float(passing.std(unbiased=False) / passing.mean().clamp(min=1e-12)),
        "thresholds": [round(float(t), 5) for t in router.thresholds.detach()],
    }


def train_run(spec: RouterSpec, seed: int, settings: Settings, data: tuple[Tensor, Tensor, Tensor, Tensor],
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train one model and evaluate it; returns the JSON record of the run.

    Same ``seed``: same initialisation, data order and router noise. (A rerun of the full sweep
    reproduced every test metric and load curve; one router's mean training loss differed in the
    9th digit, so CPU kernels are not bit-for-bit identical across processes.)

    Raises:
        RunDiverged: the loss or a parameter became non-finite (:func:`run_sweep` records the
            run as failed, with the reason).
    """
    settings.validate()
    train_x, train_y, test_x, test_y = data
    t0 = time.perf_counter()
    torch.manual_seed(seed)  # initialisation
    model = MnistMoE(spec, settings, generator=torch.Generator().manual_seed(10_000 + seed))
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr)
    order_gen = torch.Generator().manual_seed(seed)
    bs = settings.batch_size
    steps_per_epoch = train_x.shape[0] // bs
    E = settings.num_experts
    counter = ProposalCounter(model)
    load_curve: list[list[float]] = []  # kept pairs per expert / batch, averaged over log_every steps
    proposed_curve: list[list[float]] = []  # proposed pairs per expert / batch
    window = torch.zeros(E)
    window_proposed = torch.zeros(E)
    window_steps = 0
    last_epoch: dict[str, list[float]] = {"load_cv": [], "proposed_load_cv": [], "dropped_fraction": [],
                                          "tokens_dropped": [], "loss": [], "experts_per_token": []}
    aux_last: dict[str, list[float]] = {}
    step = 0
    for epoch in range(settings.epochs):
        model.train()
        perm = torch.randperm(train_x.shape[0], generator=order_gen)
        for b in range(steps_per_epoch):
            idx = perm[b * bs:(b + 1) * bs]
            with diverged_on_error(model, step):
                logits, routes = model(train_x[idx])
                task = F.cross_entropy(logits, train_y[idx])
                loss = task + sum(routes.aux.values(), torch.zeros(()))
            check_finite(step, loss=loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            tpe = routes.stats["tokens_per_expert"].float()
            window += tpe / bs
            window_proposed += counter.last.float() / bs
            window_steps += 1
            if window_steps == settings.log_every:
                load_curve.append([round(float(v), 4) for v in window / window_steps])
                proposed_curve.append([round(float(v), 4) for v in window_proposed / window_steps])
                window.zero_()
                window_proposed.zero_()
                window_steps = 0
            if epoch == settings.epochs - 1:
                last_epoch["load_cv"].append(float(routes.stats["load_cv"]))
                last_epoch["proposed_load_cv"].append(_cv(counter.last))
                last_epoch["dropped_fraction"].append(float(routes.stats["dropped_fraction"]))
                last_epoch["tokens_dropped"].append(float(routes.stats["tokens_dropped"]))
                last_epoch["loss"].append(float(task.detach()))
                last_epoch["experts_per_token"].append(float(routes.keep.sum()) / bs)
                for key, v in routes.aux.items():
                    aux_last.setdefault(key, []).append(float(v.detach()))
        if progress is not None:
            progress(f"epoch {epoch + 1}/{settings.epochs}: last-batch loss {float(task.detach()):.4f}")
    counter.remove()
    check_finite(step - 1, params=model)
    train_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    test = evaluate(model, test_x, test_y, bs)
    n1 = settings.batch1_images
    b1 = evaluate(model, test_x[:n1], test_y[:n1], 1) if n1 else {}
    subset = evaluate(model, test_x[:n1], test_y[:n1], bs) if n1 else {}  # the same images, batched
    # Dropless evaluation: the buffer holds every routed token, and every image goes to its argmax expert
    # (Kool et al.'s test-time rule). A router balanced at inference (eval_balanced) would balance again at
    # the quota ceil(batch / E), whatever the buffer: it takes the argmax here.
    factor = model.moe.eval_capacity_factor
    eval_balanced = bool(spec.router_kwargs.get("eval_balanced", False))  # base, gumbel_matching
    model.moe.eval_capacity_factor = None
    if eval_balanced:
        model.moe.router.eval_balanced = False
    try:
        dropless = evaluate(model, test_x, test_y, bs)
    finally:
        model.moe.eval_capacity_factor = factor
        if eval_balanced:
            model.moe.router.eval_balanced = True
    record: dict[str, Any] = {
        "router": spec.name, "seed": seed, "steps": step, "epochs": settings.epochs,
        "train": {k: _mean(v) for k, v in last_epoch.items()},
        "train_aux": {k: _mean(v) for k, v in aux_last.items()},
        "test": test,
        "test_batch1": b1, "test_subset": subset, "batch1_images": n1,
        "test_dropless": dropless,
        "load_curve": load_curve, "proposed_curve": proposed_curve, "log_every": settings.log_every,
        "capacity": model.moe.capacity(bs), "batch_size": bs,
        "train_s": round(train_s, 2),
    }
    if isinstance(model.moe.router, BatchwiseRouter):
        record["batchwise"] = batchwise_diagnostics(model, test_x, test_y, settings)
    record["eval_s"] = round(time.perf_counter() - t1, 2)
    return record
