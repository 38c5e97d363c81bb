"""The model, the routers and one training run of the lm-routers experiment.

**Model.** A decoder-only transformers ``MixtralForCausalLM`` (random init from the run's seed, RMSNorm,
rotary attention, SwiGLU experts), every layer's sparse MoE block patched with
:func:`routelab.integrations.hf.patch_moe`. The character vocabulary comes from :mod:`.data`.

**Equal compute.** Sparse routers differ in how many experts a token visits: top-2 gates send two
(token, expert) pairs, Switch, BASE, Sinkhorn (S-BASE) and Gumbel-Matching one. To compare them at
the same expert FLOPs, parameters *and* initial weights, the model is built from ``2 E`` narrow
SwiGLU *units* of hidden width ``I``:

* the **k = 2 routers** (top-2, noisy top-2, batchwise) route over the ``2 E`` units, two per token;
* the **k = 1 routers** (top-1 + Switch loss, BASE, Sinkhorn, Gumbel-Matching) route over ``E`` wide
  experts of width ``2 I``, wide expert ``j`` being units ``2 j`` and ``2 j + 1`` side by side. A SwiGLU
  is a sum over its hidden units, so wide expert ``j`` computes exactly ``unit_2j(x) + unit_2j+1(x)``
  (:func:`merge_unit_pairs`, tested): the same parameter tensors, the same initial values, and per token
  ``2 · 3 d I`` expert multiply-adds in both groups (the fine-grained-expert equivalence of DeepSeekMoE).

Capacity is ``C = ceil(factor · tokens · k / experts)``, so with one ``capacity_factor`` both groups get
the same buffer rows in FLOPs (``factor · tokens`` wide rows = ``2 · factor · tokens`` narrow rows). The
only difference is the router's weight: ``[2E, d]`` for the k = 2 group, and for the k = 1 group the
mean of the two unit rows of each pair (``[E, d]``). The dense softmax MoE runs every unit on every token
(``2 E / 2 = E`` times the sparse expert FLOPs): the compute-heavy reference.

**Evaluation** is dropless (``eval_capacity_factor=None``) and causal: in ``eval()`` every router is
token-local (top-k and noisy top-k without noise; batchwise with its learned thresholds, App. F
eq. 19; BASE, Sinkhorn and Gumbel-Matching with their greedy argmax, as at BASE's test time), and
attention is causal, so no token's output depends on its batch-mates or on its future (tested).
In *training* the batch-level routers (batchwise, BASE, Sinkhorn, Gumbel-Matching) solve over all
``batch · seq`` tokens of the step, as the papers do; that is where their balance comes from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..._checks import check_seed
from ...routing import aux_loss, routing_stats
from ..kit.divergence import check_finite, diverged_on_error
from ..kit.router_sweep import check_distinct
from .data import CharCorpus

__all__ = ["ROUTER_SPECS", "LayerTimer", "ProposedLoad", "RouterSpec", "Settings", "build_model", "evaluate", "lr_at",
           "merge_unit_pairs", "mixtral_config", "train_run", "unpatched_model"]


@dataclass(frozen=True)
class RouterSpec:
    """One router of the comparison.

    Attributes:
        name: the name in the report.
        router: the routelab router (``patch_moe(router=...)``).
        k: experts per token: 2 routes over the ``2 E`` narrow units, 1 over the ``E`` wide experts,
            ``None`` (dense) every unit.
        options: the router's constructor options (``router_kwargs``).
        importance_weighting: combine with the router's importance weights (Gumbel-Matching).
        note: what it is, for the report.
    """

    name: str
    router: str
    k: int | None
    options: dict[str, Any] = field(default_factory=dict)
    importance_weighting: bool = False
    note: str = ""

    @property
    def wide(self) -> bool:
        """Whether it routes over the ``E`` wide experts (one per token)."""
        return self.k == 1

    @property
    def sparse(self) -> bool:
        return self.k is not None


ROUTER_SPECS: tuple[RouterSpec, ...] = (
    RouterSpec("top1_switch", "switch", 1, {"renormalize": False, "balance_coef": 0.01},
               note="top-1 over the wide experts, full-softmax gate, Switch balance loss 0.01 (Fedus et al.)"),
    RouterSpec("top2", "topk", 2, {"renormalize": True, "balance_coef": 0.01},
               note="top-2 over the units, weights renormalised over the two (Mixtral), Switch/GShard loss 0.01"),
    RouterSpec("noisy_top2", "noisy_topk", 2, {"importance_coef": 0.1, "load_coef": 0.1},
               note="noisy top-2 (Shazeer et al. 2017 eq. 3-5), importance + load losses 0.1 each; W_g is the model's "
                    "router weight (shared by patch_moe), W_noise starts at 0"),
    RouterSpec("noisy_top2_noloss", "noisy_topk", 2, {"importance_coef": 0.0, "load_coef": 0.0},
               note="ablation: noisy top-2 without its losses (for the load-loss claim)"),
    RouterSpec("batchwise", "batchwise", 2, {"threshold_coef": 1.0},
               note="batchwise top-2 mask in training (App. F eq. 18), learned thresholds at eval (eq. 19-20)"),
    RouterSpec("base", "base", 1, {},
               note="BASE: exact balanced assignment in training, argmax at eval; no aux loss (Lewis et al. 2021)"),
    RouterSpec("sinkhorn", "sinkhorn", 1, {"renormalize": False, "balance_coef": 0.0},
               note="S-BASE: Sinkhorn-balanced top-1 in training, plain top-1 at eval; no aux loss"),
    RouterSpec("gm_iw", "gumbel_matching", 1, {"method": "gumbel_matching_iw"}, importance_weighting=True,
               note="Gumbel-Matching, importance weights, differentiable gating (Kool et al. 2021 Sec. 3.1)"),
    RouterSpec("dense", "softmax", None, {},
               note="dense softmax MoE over every unit: E times the sparse expert FLOPs (the reference)"),
)
"""Every router, in report order."""


@dataclass(frozen=True)
class Settings:
    """Sizes and schedule of the experiment (the full and quick forms differ only in these numbers).

    Attributes:
        routers: names of :data:`ROUTER_SPECS` to run.
        seeds: each seeds the initial weights, the data order and the routers' noise, the same for
            every router.
        steps: training steps; ``batch`` windows of ``seq`` characters each.
        d_model, layers, heads: the transformer (``heads`` query and key/value heads).
        experts: ``E`` wide experts = ``2 E`` narrow units of hidden width ``unit_hidden``.
        capacity_factor: training capacity factor (both groups, see the module docstring).
        lr, warmup, weight_decay, clip: AdamW with linear warm-up then cosine decay to 10 %.
        eval_every: steps between validation evaluations (also at step 0 and at the end).
        eval_windows, eval_batch: validation windows (of ``seq``) and the evaluation batch.
        test_windows: test windows for the final perplexity.
        threads: torch CPU threads (1: on a shared 2-core machine two threads oversubscribe it and run
            several times slower).
        device: ``"cpu"`` or ``"cuda"``.
        quick: the quick form (the report says so).
    """

    routers: tuple[str, ...] = tuple(s.name for s in ROUTER_SPECS)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 600
    batch: int = 16
    seq: int = 128
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 8
    unit_hidden: int = 64
    capacity_factor: float = 1.0
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    eval_every: int = 50
    eval_windows: int = 64
    eval_batch: int = 32
    test_windows: int = 256
    threads: int = 1
    device: str = "cpu"
    quick: bool = False

    def spec(self, name: str) -> RouterSpec:
        """The :class:`RouterSpec` called ``name``."""
        for s in ROUTER_SPECS:
            if s.name == name:
                return s
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(s.name for s in ROUTER_SPECS)}")

    def validate(self) -> None:
        """ValueError naming the first setting that cannot run."""
        for name in self.routers:
            self.spec(name)
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        check_distinct("routers", self.routers)
        check_distinct("seeds", self.seeds)
        for seed in self.seeds:
            check_seed(seed, "seeds")
        for name in ("steps", "batch", "seq", "d_model", "layers", "heads", "experts", "unit_hidden", "eval_every",
                     "eval_windows", "eval_batch", "test_windows", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"d_model={self.d_model} must be a multiple of 2 * heads={2 * self.heads} (rotary halves)")
        if (self.batch * self.seq) % self.experts:
            raise ValueError(f"batch * seq = {self.batch * self.seq} tokens must be divisible by the {self.experts} "
                             "wide experts (batchwise gating and BASE need tokens * k divisible by experts)")
        if not self.capacity_factor >= 1.0:
            raise ValueError(f"capacity_factor must be >= 1 (BASE needs capacity * experts >= tokens), got "
                             f"{self.capacity_factor!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device (a CPU build of torch, or no GPU); "
                             "use device='cpu'")

    def key(self) -> dict[str, Any]:
        """The settings a run's result depends on (records of other settings are not reused)."""
        return {k: getattr(self, k) for k in ("steps", "batch", "seq", "d_model", "layers", "heads", "experts",
                                              "unit_hidden", "capacity_factor", "lr", "warmup", "weight_decay",
                                              "clip", "eval_every", "eval_windows", "eval_batch", "test_windows",
                                              "device")}

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)


# ----------------------------------------------------------------------------- model


def mixtral_config(settings: Settings, vocab: int, *, wide: bool, dense: bool = False) -> Any:
    """The transformers ``MixtralConfig`` of the model (``wide``: ``E`` experts of width ``2 I``, one per
    token; else ``2 E`` units of width ``I``, two per token, or all of them if ``dense``)."""
    from transformers import MixtralConfig

    E, width = settings.experts, settings.unit_hidden
    return MixtralConfig(
        vocab_size=vocab, hidden_size=settings.d_model, intermediate_size=2 * width if wide else width,
        num_hidden_layers=settings.layers, num_attention_heads=settings.heads, num_key_value_heads=settings.heads,
        num_local_experts=E if wide else 2 * E, num_experts_per_tok=1 if wide else (2 * E if dense else 2),
        max_position_embeddings=settings.seq, router_jitter_noise=0.0, output_router_logits=False,
        tie_word_embeddings=False, attn_implementation="sdpa", sliding_window=None,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def merge_unit_pairs(narrow: nn.Module, wide: nn.Module) -> None:
    """Copy ``narrow`` (``2 E`` units of width ``I``) into ``wide`` (``E`` experts of width ``2 I``), in place.

    Every non-expert parameter is copied as is; wide expert ``j`` gets units ``2 j`` and ``2 j + 1``
    side by side (``gate_up_proj [E, 2 * 2I, d]``: the two gate halves, then the two up halves;
    ``down_proj [E, d, 2I]``), so that it computes ``unit_2j(x) + unit_2j+1(x)``; the router row ``j`` is
    the mean of the unit rows ``2 j`` and ``2 j + 1``.
    """
    src = dict(narrow.named_parameters())
    with torch.no_grad():
        for name, p in wide.named_parameters():
            q = src[name]
            if name.endswith("experts.gate_up_proj"):  # q [2E, 2I, d] -> p [E, 4I, d]
                E2, I2, d = q.shape
                half = I2 // 2
                pairs = q.reshape(E2 // 2, 2, 2, half, d)  # [E, unit, gate|up, I, d]
                p.copy_(pairs.transpose(1, 2).reshape(E2 // 2, 2 * I2, d))
            elif name.endswith("experts.down_proj"):  # q [2E, d, I] -> p [E, d, 2I]
                E2, d, half = q.shape
                p.copy_(q.reshape(E2 // 2, 2, d, half).permute(0, 2, 1, 3).reshape(E2 // 2, d, 2 * half))
            elif name.endswith("gate.weight"):  # q [2E, d] -> p [E, d]
                p.copy_(q.reshape(-1, 2, q.shape[-1]).mean(1))
            else:
                p.copy_(q)


def unpatched_model(spec: RouterSpec, settings: Settings, vocab: int, seed: int) -> nn.Module:
    """The transformers Mixtral of ``spec`` for ``seed``, before its MoE blocks are given a router.

    ``torch.manual_seed(seed)``, then the ``2 E``-unit model; for a k = 1 router its unit pairs merged into
    ``E`` wide experts (:func:`merge_unit_pairs`). On ``settings.device``, in training mode.
    """
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    narrow = MixtralForCausalLM(mixtral_config(settings, vocab, wide=False, dense=not spec.sparse))
    if spec.wide:
        model = MixtralForCausalLM(mixtral_config(settings, vocab, wide=True))
        merge_unit_pairs(narrow, model)
    else:
        model = narrow
    model.to(settings.device)
    model.train()
    return model


def build_model(spec: RouterSpec, settings: Settings, vocab: int, seed: int,
                generator: torch.Generator | None = None) -> nn.Module:
    """The patched Mixtral of ``spec`` for ``seed`` (same initial weights for every router, see the module docstring).

    Args:
        spec: the router.
        settings: sizes.
        vocab: vocabulary size.
        seed: initial weights (``torch.manual_seed(seed)`` before building the ``2 E``-unit model).
        generator: the noise of stochastic routers (noisy top-2, Gumbel-Matching).

    Returns:
        ``MixtralForCausalLM`` on ``settings.device``, in training mode, its MoE blocks patched.
    """
    from ...integrations.hf import patch_moe

    model = unpatched_model(spec, settings, vocab, seed)
    patch_moe(model, spec.router, k=spec.k if spec.sparse else None,
              capacity_factor=settings.capacity_factor if spec.sparse else None, eval_capacity_factor=None,
              importance_weighting=spec.importance_weighting, router_kwargs=dict(spec.options), generator=generator)
    return model


class LayerTimer:
    """Forward wall time of the routing, of the MoE blocks and of the decoder layers, via hooks.

    The routing is the patched gate's forward (the router, the capacity, the statistics); the MoE
    block adds the experts and the combine. On CUDA the hooks synchronise the device (slower, exact).
    """

    def __init__(self, model: nn.Module) -> None:
        self.seconds = {"routing": 0.0, "moe": 0.0, "layer": 0.0}
        self._start: dict[int, float] = {}
        self._handles = []
        self._sync = next(model.parameters()).device.type == "cuda"
        layers = model.model.layers
        for layer in layers:
            for module, key in ((layer.mlp.gate, "routing"), (layer.mlp, "moe"), (layer, "layer")):
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post(key)))
        self.enabled = True

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.enabled:
            self._start[id(module)] = self._now()

    def _post(self, key: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if self.enabled and id(module) in self._start:
                self.seconds[key] += self._now() - self._start.pop(id(module))
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class ProposedLoad:
    """Per MoE layer, the (token, slot) pairs each router *proposes* to each expert (before the capacity),
    summed over the steps since the last :meth:`take` (a forward hook on every patched gate's router)."""

    def __init__(self, model: nn.Module) -> None:
        routers = [layer.mlp.gate.router for layer in model.model.layers]
        self.counts = [torch.zeros(r.num_experts, dtype=torch.float64) for r in routers]
        self.enabled = True
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, routes: Any) -> None:
            if self.enabled:
                expert = routes.expert[routes.keep].reshape(-1)
                self.counts[i] += torch.bincount(expert, minlength=len(self.counts[i])).double().cpu()
        return hook

    def take(self) -> list[Tensor]:
        out = [c.clone() for c in self.counts]
        for c in self.counts:
            c.zero_()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def cv(load: Tensor) -> float:
    """Coefficient of variation ``std / mean`` (population std) of a load vector."""
    load = load.double()
    mean = float(load.mean())
    return float(load.std(unbiased=False)) / mean if mean > 0 else 0.0


@torch.no_grad()
def evaluate(model: nn.Module, windows: Tensor, batch: int) -> dict[str, float]:
    """Mean next-character cross-entropy (nats) of ``windows [n, seq + 1]`` in ``eval()`` (dropless, causal).

    Returns:
        ``loss`` (nats per character), ``ppl`` (``exp(loss)``), ``bpc`` (bits per character) and
        ``dropped`` (the largest fraction of pairs any layer dropped: 0 for a dropless evaluation).
    """
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count, dropped = 0.0, 0, 0.0
    try:
        for i in range(0, windows.shape[0], batch):
            w = windows[i:i + batch].to(device)
            logits = model(input_ids=w[:, :-1]).logits
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1),
                                               reduction="sum")
            total += float(loss)
            count += w[:, 1:].numel()
            for stats in routing_stats(model).values():
                dropped = max(dropped, float(stats["dropped_fraction"]))
    finally:
        model.train(was)
    mean = total / count
    return {"loss": mean, "ppl": math.exp(mean), "bpc": mean / math.log(2), "dropped": dropped}


def lr_at(step: int, settings: Settings) -> float:
    """The learning rate of ``step``: linear warm-up over ``settings.warmup`` steps, then cosine to 10 %."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_run(spec: RouterSpec, seed: int, settings: Settings, corpus: CharCorpus,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train one (router, seed) run and return its record (JSON-serialisable).

    The record holds the curves (one point per ``eval_every`` steps: step, training seconds, validation
    loss and perplexity, the window's mean training loss, aux losses and per-layer load statistics), the
    final test perplexity, the time shares and the throughput.

    Raises:
        routelab.experiments.kit.divergence.RunDiverged: the loss or the parameters became non-finite.
    """
    device = torch.device(settings.device)
    data_gen = torch.Generator().manual_seed(10_000 + seed)
    offsets = corpus.train_batches(settings.steps, settings.batch, settings.seq, data_gen)
    noise_gen = torch.Generator(device=device).manual_seed(20_000 + seed)
    model = build_model(spec, settings, corpus.vocab, seed, generator=noise_gen)
    val = corpus.held_out("val", settings.eval_windows, settings.seq)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
    timer = LayerTimer(model)
    proposed = ProposedLoad(model)
    L = settings.layers
    curve: list[dict[str, Any]] = []
    window: dict[str, Any] = {}

    def reset_window() -> None:
        window.update(loss=0.0, steps=0, aux={}, load_cv=[0.0] * L, dropped=[0.0] * L, tokens_dropped=[0.0] * L)

    def eval_point(step: int, train_s: float) -> None:
        timer.enabled = proposed.enabled = False
        ev = evaluate(model, val, settings.eval_batch)
        timer.enabled = proposed.enabled = True
        n = max(window["steps"], 1)
        loads = proposed.take()
        point = {"step": step, "train_s": round(train_s, 3), "val_loss": ev["loss"], "val_ppl": ev["ppl"],
                 "val_dropped": ev["dropped"],
                 "train_loss": window["loss"] / n if window["steps"] else None,
                 "aux": {k: v / n for k, v in window["aux"].items()},
                 "layers": [{"load_cv": window["load_cv"][i] / n, "dropped": window["dropped"][i] / n,
                             "tokens_dropped": window["tokens_dropped"][i] / n,
                             "proposed_cv": cv(loads[i]) if window["steps"] else None,
                             "proposed_share": (loads[i] / loads[i].sum().clamp(min=1)).tolist()
                             if window["steps"] else None} for i in range(L)]}
        curve.append(point)
        if progress is not None:
            progress(f"step {step}/{settings.steps}: val ppl {ev['ppl']:.3f}"
                     + (f", train CE {point['train_loss']:.3f}" if point["train_loss"] is not None else "")
                     + f", {train_s:.0f} s")
        reset_window()

    reset_window()
    proposed.take()
    train_s = 0.0
    eval_point(0, 0.0)
    timer.seconds = dict.fromkeys(timer.seconds, 0.0)
    for step in range(settings.steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings)
        w = corpus.windows(offsets[step], settings.seq).to(device)
        with diverged_on_error(model, step):
            logits = model(input_ids=w[:, :-1]).logits
            ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1))
            aux = aux_loss(model)
            loss = ce + aux
            check_finite(step, loss=loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_s += time.perf_counter() - t0
        window["loss"] += float(ce.detach())
        window["steps"] += 1
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            for name, value in gate.last_aux.items():
                window["aux"][name] = window["aux"].get(name, 0.0) + float(value.detach().sum())
            stats = gate.last_stats
            window["load_cv"][i] += float(stats["load_cv"])
            window["dropped"][i] += float(stats["dropped_fraction"])
            window["tokens_dropped"][i] += float(stats["tokens_dropped"])
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            eval_point(step + 1, train_s)
    timer.enabled = proposed.enabled = False
    test = evaluate(model, corpus.held_out("test", settings.test_windows, settings.seq), settings.eval_batch)
    record: dict[str, Any] = {
        "router": spec.name, "seed": seed, "curve": curve, "train_s": round(train_s, 2),
        "tokens_per_s": settings.steps * settings.batch * settings.seq / train_s,
        "final_val_ppl": curve[-1]["val_ppl"], "test_ppl": test["ppl"], "test_bpc": test["bpc"],
        "test_dropped": test["dropped"],
        "time_share": {"routing_of_moe": timer.seconds["routing"] / max(timer.seconds["moe"], 1e-12),
                       "routing_of_layer": timer.seconds["routing"] / max(timer.seconds["layer"], 1e-12),
                       "moe_of_layer": timer.seconds["moe"] / max(timer.seconds["layer"], 1e-12),
                       "routing_s": timer.seconds["routing"], "moe_s": timer.seconds["moe"],
                       "layer_s": timer.seconds["layer"]},
        "parameters": sum(p.numel() for p in model.parameters()),
        "expert_parameters": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
    }
    if spec.router == "batchwise":  # App. F: the batchwise mask at eval too (not causal), for comparison
        for layer in model.model.layers:
            layer.mlp.gate.router.inference = "batchwise"
        record["val_ppl_batchwise_mask"] = evaluate(model, val, settings.eval_batch)["ppl"]
        for layer in model.model.layers:
            layer.mlp.gate.router.inference = "threshold"
    timer.remove()
    proposed.remove()
    return record
