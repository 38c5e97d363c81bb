"""The toy model of Kool et al. (2021), Sec. 3, batched over many independent runs.

Task: ``y = 1[x < 0.5] (0.8 x - 0.2) + 1[x >= 0.5] (-2 x + 2) + N(0, 0.1^2)`` on 100 points
``x ~ U(-1, 1)``. Model: two linear experts ``out_j(x) = w_j x + b_j`` and a Bernoulli router
``p(z = 1 | x) = sigmoid(a x + c)``, i.e. logits ``[0, a x + c]`` over ``k = 2`` experts, with
expert capacity ``n / k = 50``.

Every run (configuration x method x temperature x seed) is one slice of a :class:`ToyBatch`: each
parameter is a tensor with a leading run dimension ``[R, ...]`` and one Adam updates them all.
Adam is elementwise and the objective is a sum over runs of per-run terms, so the runs are
independent (``tests/experiments/test_kool_toy.py`` checks the gradients against separate single-run
models). Per step there is one :func:`~routelab.estimators.sample_routes` call per
``(method, sinkhorn)`` group, with one temperature per run.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...estimators import METHODS, EMABaseline, gating_objective, reinforce_objective, sample_routes
from ...routes import Routes
from ..kit.divergence import nonfinite_rows
from ..kit.store import failed_record

__all__ = [
    "CAPACITY",
    "CONFIGS",
    "INIT_STD",
    "LR",
    "N_POINTS",
    "SIGNALS",
    "SUCCESS_MSE",
    "Config",
    "RunSpec",
    "ToyBatch",
    "get_config",
    "make_data",
    "true_function",
    "train_chunk",
]

N_POINTS = 100
K = 2
CAPACITY = N_POINTS // K
NOISE_STD = 0.1
INIT_STD = 0.5
LR = 0.1
BASELINE_DECAY = 0.99
SUCCESS_MSE = 0.02
SIGNALS = ("reinforce", "gating")


@dataclass(frozen=True)
class Config:
    """One training configuration (a panel of Fig. 2 or 3 of the paper).

    Attributes:
        name: identifier (the ``config`` field of every result).
        signal: ``"reinforce"`` (eq. 2 with an EMA baseline) or ``"gating"`` (Sec. 3.1:
            the chosen expert's output times its router probability).
        balance: weight of the Switch load-balancing loss ``k sum_j f_j P_j``.
        sinkhorn: balance the proposal with Sinkhorn before sampling (App. E).
        importance_weights: keep the importance weights (False: weight 1 for every kept token).
        title: one line for figures and tables.
    """

    name: str
    signal: str
    balance: float
    sinkhorn: bool = False
    importance_weights: bool = True
    title: str = ""

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        if not (math.isfinite(self.balance) and self.balance >= 0):
            raise ValueError(f"balance must be a finite number >= 0, got {self.balance!r}")


def _configs() -> dict[str, Config]:
    cs = [
        Config("reinforce", "reinforce", 0.0, title="REINFORCE, no balance loss (Fig. 2b, 3 top left)"),
        Config("reinforce_sinkhorn", "reinforce", 0.0, sinkhorn=True,
               title="REINFORCE, Sinkhorn before sampling (Fig. 3 top middle)"),
        Config("reinforce_no_iw", "reinforce", 0.0, importance_weights=False,
               title="REINFORCE, no importance weights (Fig. 3 top right)"),
        Config("reinforce_balance0.1", "reinforce", 0.1, title="REINFORCE, balance loss 0.1 (App. E)"),
        Config("gating", "gating", 0.01, title="gating, balance loss 0.01 (Fig. 2c, 3 bottom left)"),
        Config("gating_sinkhorn", "gating", 0.01, sinkhorn=True,
               title="gating, balance 0.01, Sinkhorn before sampling (Fig. 3 bottom middle)"),
        Config("gating_no_iw", "gating", 0.01, importance_weights=False,
               title="gating, balance 0.01, no importance weights (Fig. 3 bottom right)"),
        Config("gating_balance0", "gating", 0.0, title="gating, no balance loss (App. E)"),
        Config("gating_balance0.03", "gating", 0.03, title="gating, balance loss 0.03 (Sec. 3.1)"),
        Config("gating_balance0.1", "gating", 0.1, title="gating, balance loss 0.1 (App. E)"),
    ]
    return {c.name: c for c in cs}


CONFIGS: dict[str, Config] = _configs()
"""Every configuration of the reproduction, by name."""


def get_config(name: str) -> Config:
    """The configuration called ``name``; ValueError listing the valid names otherwise."""
    try:
        return CONFIGS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(CONFIGS)}") from None


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


def check_tau(tau: float) -> float:
    t = float(tau)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"tau must be a finite number > 0 (e.g. one of 0.1 ... 10), got {tau!r}")
    return t


@dataclass(frozen=True)
class RunSpec:
    """One run: a configuration, a routing method, a proposal temperature and a seed."""

    config: str
    method: str
    tau: float
    seed: int

    def __post_init__(self) -> None:
        get_config(self.config)
        check_method(self.method)
        object.__setattr__(self, "tau", check_tau(self.tau))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def key(self) -> tuple[str, str, float, int]:
        return (self.config, self.method, self.tau, self.seed)


# ----------------------------------------------------------------------------- data


def true_function(x: Tensor) -> Tensor:
    """The noise-free target ``1[x<0.5](0.8x - 0.2) + 1[x>=0.5](-2x + 2)``."""
    return torch.where(x < 0.5, 0.8 * x - 0.2, -2.0 * x + 2.0)


def _seed_generator(seed: int, salt: str) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and a purpose string (stable across runs/platforms)."""
    return torch.Generator().manual_seed(zlib.crc32(f"{salt}:{seed}".encode()) * 1_000_003 + seed)


def make_data(seed: int, n: int = N_POINTS, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The dataset of one seed: ``x ~ U(-1, 1)`` and ``y = true_function(x) + N(0, 0.1^2)``.

    Returns:
        ``(x [n], y [n])``, drawn from ``torch.Generator().manual_seed(seed)`` (x first, then the noise).
    """
    g = torch.Generator().manual_seed(int(seed))
    x = torch.rand(n, generator=g, dtype=dtype) * 2 - 1
    eps = torch.randn(n, generator=g, dtype=dtype) * NOISE_STD
    return x, true_function(x) + eps


def init_params(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Initial parameters of one seed, ``N(0, INIT_STD^2)`` each, from a seeded generator.

    Returns:
        ``{"w": [2], "b": [2], "a": [], "c": []}`` (expert slopes/intercepts, router slope/intercept).
    """
    g = _seed_generator(seed, "init")
    v = torch.randn(6, generator=g, dtype=dtype) * INIT_STD
    return {"w": v[0:2], "b": v[2:4], "a": v[4], "c": v[5]}


# ----------------------------------------------------------------------------- batched model


class ToyBatch:
    """R independent toy models trained side by side.

    Args:
        runs: the runs; their order is the run dimension. Runs sharing ``(sinkhorn, method)``
            are sampled in one :func:`sample_routes` call.
        dtype: float dtype of parameters and data.

    Attributes:
        w, b: ``[R, 2]`` expert slopes / intercepts; a, c: ``[R]`` router slope / intercept.
        x, y: ``[R, n]`` each run's data (runs of one seed share it).
    """

    def __init__(self, runs: Sequence[RunSpec], dtype: torch.dtype = torch.float32) -> None:
        if not runs:
            raise ValueError("a ToyBatch needs at least one run")
        self.runs = list(runs)
        self.configs = [get_config(r.config) for r in self.runs]
        R = len(self.runs)
        data = {s: make_data(s, dtype=dtype) for s in sorted({r.seed for r in self.runs})}
        self.x = torch.stack([data[r.seed][0] for r in self.runs])
        self.y = torch.stack([data[r.seed][1] for r in self.runs])
        inits = {s: init_params(s, dtype=dtype) for s in data}
        self.w = torch.stack([inits[r.seed]["w"] for r in self.runs]).requires_grad_(True)
        self.b = torch.stack([inits[r.seed]["b"] for r in self.runs]).requires_grad_(True)
        self.a = torch.stack([inits[r.seed]["a"] for r in self.runs]).requires_grad_(True)
        self.c = torch.stack([inits[r.seed]["c"] for r in self.runs]).requires_grad_(True)
        self.tau = torch.tensor([r.tau for r in self.runs], dtype=dtype)
        self.is_gating = torch.tensor([c.signal == "gating" for c in self.configs])
        self.use_iw = torch.tensor([c.importance_weights for c in self.configs])
        self.balance_weight = torch.tensor([c.balance for c in self.configs], dtype=dtype)
        # contiguous groups of runs sampled in one call
        groups: dict[tuple[bool, str], list[int]] = {}
        for i, (r, c) in enumerate(zip(self.runs, self.configs)):
            groups.setdefault((c.sinkhorn, r.method), []).append(i)
        self.groups = [(sh, m, torch.tensor(idx)) for (sh, m), idx in groups.items()]
        order = torch.cat([idx for _, _, idx in self.groups])
        self._contiguous = bool((order == torch.arange(R)).all())
        self._inverse = torch.empty_like(order)
        self._inverse[order] = torch.arange(R)
        self.baseline = EMABaseline(BASELINE_DECAY)
        self.R = R
        self._signals = {c.signal for c in self.configs}
        self._iw = {c.importance_weights for c in self.configs}

    def parameters(self) -> list[Tensor]:
        return [self.w, self.b, self.a, self.c]

    # ---- forward pieces

    def logits(self) -> Tensor:
        """``[R, n, 2]`` router logits ``[0, a x + c]``."""
        s = self.a.unsqueeze(-1) * self.x + self.c.unsqueeze(-1)
        return torch.stack([torch.zeros_like(s), s], dim=-1)

    def expert_outputs(self) -> Tensor:
        """``[R, n, 2]`` outputs ``w_j x + b_j`` of both experts."""
        return self.w.unsqueeze(1) * self.x.unsqueeze(-1) + self.b.unsqueeze(1)

    def sample(self, logits: Tensor, generators: dict[tuple[bool, str], torch.Generator] | None = None) -> Routes:
        """Route every run's tokens: one :func:`sample_routes` call per ``(sinkhorn, method)`` group.

        Returns:
            :class:`Routes` over all runs (``[R, n, 1]`` fields, ``aux["balance"]`` ``[R]``).
        """
        parts = []
        for sh, m, idx in self.groups:
            g = None if generators is None else generators[(sh, m)]
            sub = logits if len(self.groups) == 1 else logits.index_select(0, idx)
            parts.append(
                sample_routes(sub, m, tau=self.tau.index_select(0, idx), capacity=CAPACITY, sinkhorn=sh, generator=g)
            )
        return self._merge(parts)

    def _merge(self, parts: list[Routes]) -> Routes:
        if len(parts) == 1:
            return parts[0]

        def cat(get: Callable[[Routes], Tensor]) -> Tensor:
            t = torch.cat([get(p) for p in parts])
            return t if self._contiguous else t.index_select(0, self._inverse)

        return Routes(
            expert=cat(lambda p: p.expert),
            gate=cat(lambda p: p.gate),
            keep=cat(lambda p: p.keep),
            weight=cat(lambda p: p.weight),
            log_prob=cat(lambda p: p.log_prob),
            aux={"balance": cat(lambda p: p.aux["balance"])},
            stats={"tokens_per_expert": cat(lambda p: p.stats["tokens_per_expert"])},
        )

    def objective(self, routes: Routes, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-run training objective ``[R]`` for the given routes (and the observed loss ``[R]``).

        REINFORCE runs: :func:`reinforce_objective` of ``f_i = (y_i - out_{z_i}(x_i))^2`` with the
        EMA baseline (``baseline`` if given, else this batch's :class:`EMABaseline`, updated with
        the mean loss of the kept tokens). Gating runs: :func:`gating_objective` of
        ``f_i = (y_i - gate_i out_{z_i}(x_i))^2``. Runs without importance weights use weight 1 for
        every kept token. Plus ``balance * aux["balance"]``.
        """
        out = self.expert_outputs().gather(-1, routes.expert).squeeze(-1)  # [R, n]
        pred = torch.where(self.is_gating.unsqueeze(-1), routes.gate.squeeze(-1) * out, out)
        f = (self.y - pred) ** 2
        keep = routes.keep.squeeze(-1).to(f.dtype)
        observed = ((f * keep).sum(-1) / keep.sum(-1).clamp(min=1)).detach()
        if baseline is None:
            baseline = self.baseline(observed)
        # (Objectives a batch does not use are not computed: the batch is often uniform.)
        parts = {}
        if "reinforce" in self._signals:
            if self._iw == {True}:
                routes_r = routes
            elif self._iw == {False}:
                routes_r = dataclasses.replace(routes, weight=keep.unsqueeze(-1))
            else:
                weight = torch.where(self.use_iw.view(-1, 1, 1), routes.weight, keep.unsqueeze(-1))
                routes_r = dataclasses.replace(routes, weight=weight)
            parts["reinforce"] = reinforce_objective(routes_r, f, baseline)
        if "gating" in self._signals:
            with_w = gating_objective(routes, f, use_weights=True) if True in self._iw else None
            without = gating_objective(routes, f, use_weights=False) if False in self._iw else None
            if with_w is None or without is None:
                parts["gating"] = with_w if without is None else without
            else:
                parts["gating"] = torch.where(self.use_iw, with_w, without)
        if len(parts) == 1:
            obj = next(iter(parts.values()))
        else:
            obj = torch.where(self.is_gating, parts["gating"], parts["reinforce"])
        obj = obj + self.balance_weight * routes.aux["balance"]
        return obj, observed

    # ---- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, Tensor]:
        """Final metrics per run ``[R]``.

        ``mse``: ``mean_i sum_j p_ij (y_i - pred_ij)^2``, the training MSE under sampling the
        expert from the router, where ``pred_ij = out_j(x_i)`` for REINFORCE and
        ``p_ij out_j(x_i)`` for gating (the model's output when expert ``j`` is chosen).
        ``argmax_mse``: the same with the most probable expert. ``load``: mean router
        probability of expert 1. ``argmax_load``: the fraction of points whose most probable
        expert is expert 1 (0 or 1: the router has collapsed, one expert is never preferred).
        ``mse_ungated``: the REINFORCE-style MSE for every run.
        """
        p = torch.softmax(self.logits(), dim=-1)
        out = self.expert_outputs()
        pred = torch.where(self.is_gating.view(-1, 1, 1), p * out, out)
        err = (self.y.unsqueeze(-1) - pred) ** 2
        mse = (p * err).sum(-1).mean(-1)
        top = p.argmax(-1, keepdim=True)
        argmax_mse = err.gather(-1, top).squeeze(-1).mean(-1)
        mse_ungated = (p * (self.y.unsqueeze(-1) - out) ** 2).sum(-1).mean(-1)
        return {"mse": mse, "argmax_mse": argmax_mse, "load": p[..., 1].mean(-1),
                "argmax_load": top.squeeze(-1).to(p.dtype).mean(-1), "mse_ungated": mse_ungated}


def _group_generators(batch: ToyBatch, chunk_seed: int) -> dict[tuple[bool, str], torch.Generator]:
    return {
        (sh, m): _seed_generator(chunk_seed, f"sample:{int(sh)}:{m}") for sh, m, _ in batch.groups
    }


def _retire(batch: ToyBatch, opt: torch.optim.Optimizer, rows: list[int], alive: Tensor | None) -> Tensor:
    """Take diverged runs out of training without touching the others; returns the new ``alive`` mask.

    A retired run's parameters, Adam moments and baseline are set to 0 (finite) and its objective
    is masked out of the backward pass from the next step on, so it stays at 0. It keeps its
    slot in the batch, so every other run sees exactly the same batch shapes, sampling noise and
    arithmetic as if the retired run had never diverged: their results are unchanged, bit for bit
    (every operation on the ``[R, ...]`` tensors is per run, except Sinkhorn's shared sweep
    count in the Sinkhorn groups).
    """
    idx = torch.tensor(rows)
    with torch.no_grad():
        for p in batch.parameters():
            p.index_fill_(0, idx, 0.0)
            state = opt.state.get(p, {})
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if isinstance(state.get(name), Tensor):
                    state[name].index_fill_(0, idx, 0.0)
        if batch.baseline.value is not None:
            batch.baseline.value = batch.baseline.value.index_fill(0, idx, 0.0)
    if alive is None:
        alive = torch.ones(batch.R, dtype=torch.bool)
    alive[idx] = False
    return alive


def train_chunk(
    runs: Sequence[RunSpec],
    steps: int,
    *,
    chunk_seed: int = 0,
    progress: Callable[[int], None] | None = None,
    timings: dict[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Train ``runs`` as one batch for ``steps`` full-batch Adam steps; one result dict per run.

    Args:
        runs: the runs of the chunk.
        steps: number of Adam steps (10K in the paper).
        chunk_seed: seeds the sampling generators (one per ``(sinkhorn, method)`` group), so a
            rerun of the same chunk is bit-identical on CPU.
        progress: called with the number of steps done since the last call.
        timings: if given, accumulates seconds per phase (``sample``, ``objective``,
            ``backward``, ``adam``) — the per-step cost breakdown.

    Returns:
        One dict per run (in order): the run's fields, ``mse``, ``argmax_mse``, ``success``,
        ``load`` (final mean router probability of expert 1), ``argmax_load`` (final fraction of
        points whose most probable expert is 1) and ``collapsed`` (it is 0 or 1: router collapse,
        one expert never preferred), ``mse_ungated``, ``tokens_per_expert``
        (last step), importance-weight statistics over training (``iw_mean``: mean weight of kept
        tokens; ``iw_max``: largest weight seen; ``iw_mean_max``: mean over steps of the per-step
        largest weight), ``dropped``: mean dropped fraction, ``mse_curve``: ``[step, mse]`` every
        ``steps // 10`` steps. A run that diverges (its loss, parameters or router logits become
        non-finite) is taken out of training at that step (:func:`_retire`; the other runs are
        unaffected) and its dict is a failed record
        (:func:`routelab.experiments.kit.store.failed_record`: the run's fields, ``steps``,
        ``status: "failed"``, ``reason``, ``failed_step``).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    batch = ToyBatch(runs, dtype=dtype)
    gens = _group_generators(batch, chunk_seed)
    opt = torch.optim.Adam(batch.parameters(), lr=LR)
    R = batch.R
    iw_sum = torch.zeros(R, dtype=torch.float64)  # sum over steps of the kept tokens' weights
    iw_cnt = torch.zeros(R, dtype=torch.float64)  # number of kept tokens, summed over steps
    iw_max = torch.zeros(R, dtype=dtype)
    iw_step_max = torch.zeros(R, dtype=torch.float64)
    clock = time.perf_counter
    t_sample = t_obj = t_back = t_adam = 0.0
    report_every = max(1, min(100, steps // 20))
    pending = 0
    routes = None
    curve_every = max(1, steps // 10)
    curve: list[tuple[int, list[float]]] = []
    failed: dict[int, tuple[str, int]] = {}  # run index -> (reason, step)
    alive: Tensor | None = None  # bool [R] once a run has failed: the runs still training
    for step in range(steps):
        t0 = clock()
        logits = batch.logits()
        overflow = nonfinite_rows(step, params={"the router logits a x + c": logits}, label="")
        if overflow:  # finite but huge parameters (a diverging run): retire before sampling
            for i, reason in overflow.items():
                failed.setdefault(i, (reason, step))
            alive = _retire(batch, opt, list(overflow), alive)
            logits = batch.logits()
        routes = batch.sample(logits, gens)
        t1 = clock()
        obj, _ = batch.objective(routes)
        t2 = clock()
        opt.zero_grad(set_to_none=True)
        raw = obj.detach()
        (obj if alive is None else torch.where(alive, obj, torch.zeros_like(obj))).sum().backward()
        t3 = clock()
        opt.step()
        t4 = clock()
        diverged = nonfinite_rows(step, loss=raw, params=dict(zip(("w", "b", "a", "c"), batch.parameters())),
                                  rows=alive)
        if diverged:
            failed.update((i, (reason, step)) for i, reason in diverged.items())
            alive = _retire(batch, opt, list(diverged), alive)
        with torch.no_grad():
            w = routes.weight.squeeze(-1)  # [R, n], 0 where dropped
            iw_sum += w.sum(-1)
            iw_cnt += routes.keep.squeeze(-1).sum(-1)
            m = w.amax(-1)
            torch.maximum(iw_max, m, out=iw_max)
            iw_step_max += m
        t_sample += t1 - t0
        t_obj += t2 - t1
        t_back += t3 - t2
        t_adam += t4 - t3
        pending += 1
        if (step + 1) % curve_every == 0 and step + 1 < steps:
            curve.append((step + 1, batch.evaluate()["mse"].tolist()))
        if progress is not None and pending >= report_every:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)
    if timings is not None:
        for k_, v in (("sample", t_sample), ("objective", t_obj), ("backward", t_back), ("adam", t_adam)):
            timings[k_] = timings.get(k_, 0.0) + v
    ev = {k: v.tolist() for k, v in batch.evaluate().items()}
    iw_mean = (iw_sum / iw_cnt.clamp(min=1)).tolist()
    iw_mean_max = (iw_step_max / steps).tolist()
    dropped = (1 - iw_cnt / (steps * N_POINTS)).tolist()
    iw_max_l = iw_max.tolist()
    params = {k: v.detach().tolist() for k, v in (("w", batch.w), ("b", batch.b), ("a", batch.a), ("c", batch.c))}
    tpe = routes.stats["tokens_per_expert"].tolist()
    def r7(v: float) -> float:  # float32 values: 7 significant digits keep all they have
        return float(f"{v:.7g}")

    results = []
    for i, r in enumerate(batch.runs):
        if i in failed:
            key = {"config": r.config, "method": r.method, "tau": r.tau, "seed": r.seed, "steps": steps}
            results.append(failed_record(key, *failed[i]))
            continue
        mse = ev["mse"][i]
        results.append(
            {
                "config": r.config,
                "method": r.method,
                "tau": r.tau,
                "seed": r.seed,
                "steps": steps,
                "mse": mse,
                "argmax_mse": r7(ev["argmax_mse"][i]),
                "mse_ungated": r7(ev["mse_ungated"][i]),
                "success": bool(mse < SUCCESS_MSE),
                "load": r7(ev["load"][i]),
                "argmax_load": r7(ev["argmax_load"][i]),
                "collapsed": ev["argmax_load"][i] in (0.0, 1.0),
                "tokens_per_expert": tpe[i],
                "iw_mean": r7(iw_mean[i]),
                "iw_max": r7(iw_max_l[i]),
                "iw_mean_max": r7(iw_mean_max[i]),
                "dropped": r7(dropped[i]),
                "mse_curve": [[k_, float(f"{c_[i]:.4g}")] for k_, c_ in curve] + [[steps, r7(mse)]],
                "params": {
                    "w": [r7(v) for v in params["w"][i]], "b": [r7(v) for v in params["b"][i]],
                    "a": r7(params["a"][i]), "c": r7(params["c"][i]),
                },
            }
        )
    return results
