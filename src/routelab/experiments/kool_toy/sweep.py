"""The sweep of the toy experiment: its size (:class:`Settings`, the :data:`FULL` and :data:`QUICK`
forms) and how it is cut into chunks of runs trained together (:func:`plan_chunks`)."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any

from ...estimators import METHODS
from .model import CONFIGS, RunSpec, check_method, check_tau, get_config

__all__ = ["FULL", "QUICK", "SINKHORN_METHODS", "Chunk", "RunKey", "Settings", "log_taus", "plan_chunks",
           "planned_keys", "record_key", "run_key"]

#: the methods that call Sinkhorn even in the configurations without Sinkhorn
SINKHORN_METHODS = ("gumbel_matching_sh",)


def log_taus(m: int, lo: float = 0.1, hi: float = 10.0) -> tuple[float, ...]:
    """``m`` log-spaced temperatures from ``lo`` to ``hi``, rounded to 4 significant digits."""
    if m == 1:
        return (lo,)
    return tuple(float(f"{lo * (hi / lo) ** (i / (m - 1)):.4g}") for i in range(m))


@dataclass(frozen=True)
class Settings:
    """The size of a sweep.

    Attributes:
        configs: configuration names (see :data:`CONFIGS`).
        methods: routing methods (see :data:`routelab.estimators.METHODS`).
        taus: proposal temperatures.
        seeds: seeds (data and initialisation).
        steps: Adam steps per run.
        marginal_ns, marginal_matrices, marginal_samples: the marginals check (``()`` skips it).
        gradient_seeds, gradient_taus, gradient_copies: claim 2's expected-gradient check
            (:mod:`.gradients`) at these seeds' initial parameters and temperatures, with
            ``gradient_copies`` route draws per method (``()`` skips it).
        threads: torch intra-op threads while training (restored afterwards); the tensors are
            small, so one thread avoids synchronisation overhead; ``None`` leaves torch alone.
        workers: processes training chunks side by side (one per CPU core helps: each chunk
            runs on one thread); ``None``: ``min(2, os.cpu_count())``.
        split_signals: train the REINFORCE and the gating runs in separate chunks (the full run:
            smaller chunks, finer resume); ``False`` puts them in one chunk per Sinkhorn group, which
            halves the quick form's time (a step's cost is mostly fixed overhead per chunk). The two
            batchings give a run different sampling noise, so their records are kept apart
            (:func:`record_key`).
        quick: whether this is the quick form (said in the report).
    """

    configs: tuple[str, ...] = tuple(CONFIGS)
    methods: tuple[str, ...] = METHODS
    taus: tuple[float, ...] = log_taus(13, 1e-3, 10.0)
    seeds: tuple[int, ...] = tuple(range(10))
    steps: int = 10_000
    marginal_ns: tuple[int, ...] = (2, 4, 8, 16, 32)
    marginal_matrices: int = 16
    marginal_samples: int = 40_000
    gradient_seeds: tuple[int, ...] = tuple(range(10))
    gradient_taus: tuple[float, ...] = (0.1, 1.0, 10.0)
    gradient_copies: int = 16_000
    threads: int | None = 1
    workers: int | None = None
    split_signals: bool = True
    quick: bool = False

    def resolved_workers(self, pending: int) -> int:
        """Worker processes for ``pending`` chunks (at least 1)."""
        wanted = self.workers if self.workers is not None else min(2, os.cpu_count() or 1)
        return max(1, min(wanted, pending))

    def __post_init__(self) -> None:
        for c in self.configs:
            get_config(c)
        for m in self.methods:
            check_method(m)
        object.__setattr__(self, "taus", tuple(check_tau(t) for t in self.taus))
        if not (self.configs and self.methods and self.taus and self.seeds):
            raise ValueError("configs, methods, taus and seeds must all be non-empty")
        if len(set(self.taus)) != len(self.taus) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("taus and seeds must not repeat")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


FULL = Settings()
#: The quick form (``make run``): full-length training of every seed on the configurations without
#: Sinkhorn at three of the full run's temperatures (0.01, where gating learns; 1 and 10, where
#: REINFORCE does), REINFORCE and gating in one chunk. Restricted to these cells, the full run's own
#: records give the full run's verdicts on claims 1-5, 7 and 8 (claim 6 needs the Sinkhorn
#: configurations: not measured here); ``tests/experiments/test_kool_toy.py`` checks that on the
#: committed records. Its runs are batched differently from the full run's (other sampling noise), so a
#: quick and a full run into one directory neither resume from nor report each other's runs (:func:`record_key`).
QUICK = Settings(
    configs=tuple(c for c in CONFIGS if not get_config(c).sinkhorn),
    taus=(0.01, 1.0, 10.0),
    marginal_matrices=4,
    marginal_samples=5_000,
    gradient_seeds=(0, 1, 2),
    gradient_copies=4_000,
    split_signals=False,
    quick=True,
)


@dataclass(frozen=True)
class Chunk:
    """Runs trained together as one batched model (and recorded together)."""

    name: str
    runs: tuple[RunSpec, ...]

    @property
    def seed(self) -> int:
        """Seeds the chunk's sampling generators (a function of the chunk's name)."""
        return zlib.crc32(self.name.encode())


def plan_chunks(settings: Settings) -> list[Chunk]:
    """Cut the sweep into chunks, each trained as one batched model.

    Small batched steps cost mostly fixed per-call overhead, so runs are pooled: per training
    signal (REINFORCE, then gating; both together, chunks ``all`` and ``all+sinkhorn``, without
    ``split_signals``), one chunk holds the runs that never call Sinkhorn (every
    configuration without Sinkhorn, every method but Gumbel-Matching SH), and one chunk the runs
    that do (Gumbel-Matching SH, and every method of the Sinkhorn configurations), so that a slow
    or failing Sinkhorn call cannot hold up or lose the others. Each chunk has one
    ``sample_routes`` call per ``(sinkhorn, method)`` group and step.
    """
    chunks = []
    for signal in ("reinforce", "gating") if settings.split_signals else ("all",):
        plain: list[RunSpec] = []
        with_sk: list[RunSpec] = []
        for name in settings.configs:
            cfg = get_config(name)
            if settings.split_signals and cfg.signal != signal:
                continue
            for m in settings.methods:
                target = with_sk if (cfg.sinkhorn or m in SINKHORN_METHODS) else plain
                target.extend(RunSpec(name, m, t, s) for t in settings.taus for s in settings.seeds)
        for cname, runs in ((signal, plain), (f"{signal}+sinkhorn", with_sk)):
            if runs:
                # group by (sinkhorn, method) so every sample_routes call takes a contiguous slice
                runs.sort(key=lambda r: (get_config(r.config).sinkhorn, METHODS.index(r.method)))
                chunks.append(Chunk(cname, tuple(runs)))
    return chunks


RunKey = tuple[str, str, float, int, int, str | None]
"""A run's identity: ``(config, method, tau, seed, steps, chunk)`` (:func:`record_key`)."""


def record_key(rec: dict[str, Any]) -> RunKey:
    """The identity of a recorded run: ``(config, method, tau, seed, steps, chunk)``.

    ``chunk`` is the name of the chunk the run was trained in (recorded with every run): it fixes the
    run's batching and its sampling noise (seeded by the name, :attr:`Chunk.seed`). The quick form's
    chunks (``all``, ``all+sinkhorn``: no ``split_signals``) and the full run's (``reinforce``,
    ``gating`` and their ``+sinkhorn``) never share a name, so a quick record and a full record of
    the same ``(config, method, tau, seed, steps)`` are different runs, and each form resumes from
    and reports only its own (:func:`planned_keys`). A record without ``chunk`` matches no plan."""
    return (rec["config"], rec["method"], float(rec["tau"]), int(rec["seed"]), int(rec["steps"]), rec.get("chunk"))


def run_key(run: RunSpec, chunk: Chunk, steps: int) -> RunKey:
    """The :func:`record_key` that ``run``, trained in ``chunk`` for ``steps`` steps, is recorded under."""
    return (*run.key, steps, chunk.name)


def planned_keys(settings: Settings) -> list[RunKey]:
    """The :func:`record_key` of every run of the sweep, in the order of :func:`plan_chunks`."""
    return [run_key(r, c, settings.steps) for c in plan_chunks(settings) for r in c.runs]
