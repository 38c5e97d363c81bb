"""Shared machinery of routelab's fuzz suite (tests/fuzz): settings, strategies, oracles, guards.

The suite runs every public function of ``routelab.assignment``, ``routelab.estimators``,
``routelab.gates``, ``routelab.routing`` and ``routelab.layers`` on adversarial input (shapes with
``n, k`` from 1 to 12 and empty leading batch dimensions, float16/bfloat16/float32/float64,
magnitudes from 1e-30 to 1e30 with offsets up to 1e5 times the score spread, exact ties and
near-ties, ``-inf`` patterns, capacity edge values) and asserts the library's contract.

Run length:

* ``make test`` (CI): each property runs ``max_examples`` derandomized examples (a fixed,
  reproducible set, no example database), a few seconds per file.
* ``make fuzz``: ``ROUTELAB_FUZZ_SCALE=50`` multiplies every ``max_examples`` by 50 and
  ``ROUTELAB_FUZZ_RANDOM=1`` turns derandomization off; the Makefile passes a fresh
  ``--hypothesis-seed`` (printed) so each run explores new input and a failure can be replayed.

Every library call goes through :func:`call`, which

* fails on a hang: the call gets ``ROUTELAB_FUZZ_TIMEOUT`` seconds (default 10; every valid call
  here takes well under 0.1 s) of wall time (SIGALRM; the solvers' loops are Python loops, so the
  alarm interrupts them, and hypothesis then shrinks the hanging input like any other failure);
* checks the error contract: any exception must be a ``ValueError``/``TypeError`` raised by
  routelab's own code whose message names the offending argument; valid input must not raise,
  invalid input must raise;
* fails when the call emits a warning (internal warnings must not leak to users).

Outcomes are counted as hypothesis events: ``pytest tests/fuzz --hypothesis-show-statistics``
shows how often each call returned or raised (``ROUTELAB_FUZZ_DEBUG=1`` adds the error messages
and the score cases' dtype/scale/kind/mask/offset), to check that the examples are not mostly
rejected input.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

import routelab
from hang_guard import Hang, returns_within

# ----------------------------------------------------------------------------- run length

SCALE = max(1, int(os.environ.get("ROUTELAB_FUZZ_SCALE", "1")))
RANDOM = os.environ.get("ROUTELAB_FUZZ_RANDOM", "") not in ("", "0")
TIMEOUT_S = float(os.environ.get("ROUTELAB_FUZZ_TIMEOUT", "10"))


def fuzz(max_examples: int) -> settings:
    """Settings of one property: ``max_examples * SCALE`` examples, no deadline, no database.

    Derandomized (a fixed example set, the same on every CI run) unless ``ROUTELAB_FUZZ_RANDOM``.
    """
    return settings(
        max_examples=max_examples * SCALE,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        print_blob=True,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),  # no slow "explain" phase
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.large_base_example],
    )


# ----------------------------------------------------------------------------- numbers

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
NEG_INF = float("-inf")
ROUTELAB_SRC = str(Path(routelab.__file__).resolve().parent)


def eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def f64(x: torch.Tensor) -> torch.Tensor:
    """The exact values of ``x`` in float64 (every float16/bfloat16/float32 value is exact there)."""
    return x.detach().to(torch.float64)


def np64(x: torch.Tensor) -> np.ndarray:
    return f64(x).cpu().numpy()


def spread(S: np.ndarray) -> float:
    """Max over rows of (row max - row min) of the finite entries of ``[..., n, k]`` scores (0 if none)."""
    fin = np.isfinite(S)
    hi = np.where(fin, S, -np.inf).max(-1)
    lo = np.where(fin, S, np.inf).min(-1)
    d = hi - lo
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


def tensor_literal(x: torch.Tensor) -> str:
    """A Python expression that rebuilds ``x`` bit for bit (shape, dtype, inf/NaN)."""

    def fmt(v: Any) -> str:
        if isinstance(v, list):
            return "[" + ", ".join(fmt(u) for u in v) + "]"
        if isinstance(v, bool):
            return repr(v)
        if isinstance(v, float):
            if math.isnan(v):
                return "nan"
            if math.isinf(v):
                return "inf" if v > 0 else "-inf"
            return repr(v)
        return repr(v)

    dt = str(x.dtype)
    if x.numel() == 0:
        return f"torch.empty({tuple(x.shape)}, dtype={dt})"
    vals = x.detach().cpu()
    if vals.is_floating_point():
        vals = vals.to(torch.float64)
    return f"torch.tensor({fmt(vals.tolist())}, dtype={dt})"


def same_bits(a: Any, b: Any) -> bool:
    """Bitwise equality of tensors (NaN == NaN, -0.0 != 0.0) and of nested containers/dataclasses."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            return torch.equal(a.detach().contiguous().view(ints), b.detach().contiguous().view(ints))
        return torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(u, v) for u, v in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same_bits(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def clone_inputs(*xs: Any) -> list[Any]:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in xs]


def assert_not_mutated(before: Sequence[Any], after: Sequence[Any], what: str = "input") -> None:
    for i, (b, a) in enumerate(zip(before, after)):
        if isinstance(b, torch.Tensor):
            assert same_bits(b, a.detach()), f"{what} #{i} was mutated in place by the call"


def assert_finite(t: torch.Tensor, what: str, *, allow_neg_inf: torch.Tensor | None = None) -> None:
    """No NaN/inf in ``t``; ``-inf`` allowed where ``allow_neg_inf`` is True."""
    t = t.detach()
    bad = ~torch.isfinite(t)
    if allow_neg_inf is not None:
        bad = bad & ~(allow_neg_inf & torch.isneginf(t))
    if bool(bad.any()):
        idx = bad.nonzero()[:3].tolist()
        vals = [float(t[tuple(i)]) for i in idx]
        raise AssertionError(f"{what} has {int(bad.sum())} non-finite entries, e.g. at {idx}: {vals}")


# ----------------------------------------------------------------------------- the call guard


def names_argument(message: str, names: Iterable[str]) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def check_error(exc: BaseException, names: Sequence[str], what: str) -> None:
    """The error contract: ValueError/TypeError, raised in routelab, message naming an argument."""
    frames = traceback.extract_tb(exc.__traceback__)
    origin = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    assert isinstance(exc, (ValueError, TypeError)), (
        f"{what} raised {type(exc).__name__} (expected ValueError or TypeError) from {origin}: {exc}"
    )
    assert names_argument(str(exc), names), (
        f"{what} raised {type(exc).__name__} whose message names none of the arguments {list(names)}: {exc!r}"
    )
    assert frames and frames[-1].filename.startswith(ROUTELAB_SRC), (
        f"{what} raised {type(exc).__name__} from outside routelab ({origin}), not routelab's own check: {exc!r}"
    )


_UNSET = object()


def call(fn: Callable[..., Any], *args: Any, names: Sequence[str], valid: bool | None, what: str | None = None,
         documented_warning: str | None = None, **kwargs: Any) -> tuple[bool, Any]:
    """Call ``fn`` under the hang guard and the error contract.

    Args:
        names: the argument names an error message may name.
        valid: True: the input is valid, so any exception fails; False: the input is invalid, so
            the call must raise; None: either (e.g. half precision, which may be rejected).
        documented_warning: a regex of a warning ``fn`` documents for this input (e.g.
            ``gumbel_matching_iw``'s unreachable mass); warnings that match it are not leaks.

    Returns:
        ``(True, result)`` or ``(False, exception)`` when it raised (as allowed).
    """
    what = what or getattr(fn, "__qualname__", repr(fn))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with returns_within(TIMEOUT_S, what=what):
                out = fn(*args, **kwargs)
        except Hang:
            raise
        except Exception as exc:  # noqa: BLE001 - the contract is checked here
            if valid:
                frames = traceback.extract_tb(exc.__traceback__)
                origin = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
                raise AssertionError(
                    f"{what} rejected valid input: {type(exc).__name__} from {origin}: {exc}"
                ) from exc
            check_error(exc, names, what)
            _no_warnings(caught, what)
            _event(
                f"{what}: raised {type(exc).__name__}"
                + (f" {str(exc)[:70]}" if os.environ.get("ROUTELAB_FUZZ_DEBUG") else "")
            )
            return False, exc
    if documented_warning is not None:
        caught = [w for w in caught if not re.search(documented_warning, str(w.message))]
    _no_warnings(caught, what)
    _event(f"{what}: returned")
    if valid is False:
        raise AssertionError(f"{what} accepted invalid input (expected a ValueError naming one of {list(names)})")
    return True, out


def _event(label: str) -> None:
    """Count outcomes in hypothesis' statistics (pytest --hypothesis-show-statistics)."""
    with contextlib.suppress(Exception):
        event(label)


def guarded(fn: Callable[..., Any], *args: Any, what: str = "call", **kwargs: Any) -> Any:
    """Call under the hang guard only (for follow-up work on a result: backward passes etc.)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with returns_within(TIMEOUT_S, what=what):
            out = fn(*args, **kwargs)
    _no_warnings(caught, what)
    return out


def _no_warnings(caught: list, what: str) -> None:
    if caught:
        w = caught[0]
        raise AssertionError(
            f"{what} leaked {len(caught)} warning(s) to the user, first: {w.category.__name__}: {w.message} "
            f"({w.filename}:{w.lineno})"
        )


# ----------------------------------------------------------------------------- score matrices

BATCH_SHAPES: tuple[tuple[int, ...], ...] = ((), (2,), (0,), (), (1,), (0, 3), (2, 1), (3,))
SCALES: tuple[float, ...] = (1.0, 1e-3, 1e3, 1e-30, 1e154, 1e30, 1e-10, 1e10)
OFFSETS: tuple[float, ...] = (0.0, 1.0, 1e2, -1e5, 1e4, 1e5)
KINDS: tuple[str, ...] = ("normal", "ties", "near_ties", "integers", "constant", "peaked")
MASKS: tuple[str, ...] = ("none", "sparse", "column", "row", "last_row", "block", "dense", "single")


def choice(options: Sequence[Any]) -> st.SearchStrategy:
    """``sampled_from`` whose last entry repeats the first: hypothesis favours both ends of the
    range, so the first (main-line) option takes both and rarer options share the middle."""
    options = tuple(options)
    return st.sampled_from(options + options[:1]) if len(options) > 2 else st.sampled_from(options)


@dataclass
class ScoreCase:
    """One adversarial ``[*batch, n, k]`` score tensor; its repr rebuilds it bit for bit."""

    x: torch.Tensor
    recipe: str = field(default="", compare=False)

    @property
    def n(self) -> int:
        return self.x.shape[-2]

    @property
    def k(self) -> int:
        return self.x.shape[-1]

    @property
    def batch(self) -> tuple[int, ...]:
        return tuple(self.x.shape[:-2])

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def has_nan_or_posinf(self) -> bool:
        x = self.x
        return bool(torch.isnan(x).any()) or bool(torch.isposinf(x).any())

    def __repr__(self) -> str:
        return f"{tensor_literal(self.x)}  # {self.recipe}"


def _values(gen: torch.Generator, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "ties":
        return torch.randint(0, 3, shape, generator=gen).to(torch.float64)
    if kind == "near_ties":
        return 1.0 + 1e-7 * torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "integers":
        return torch.randint(-5, 6, shape, generator=gen).to(torch.float64)
    if kind == "constant":
        return torch.ones(shape, dtype=torch.float64)
    if kind == "peaked":
        return 30.0 * torch.randn(shape, generator=gen, dtype=torch.float64)
    raise AssertionError(kind)


def _forbidden(gen: torch.Generator, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    *batch, n, k = shape
    m = torch.zeros(shape, dtype=torch.bool)
    if kind == "none":
        return m
    if kind in ("sparse", "dense"):
        return torch.rand(shape, generator=gen) < (0.2 if kind == "sparse" else 0.6)
    if kind == "column":
        cols = int(torch.randint(1, max(k, 2), (1,), generator=gen)) if k > 1 else 1
        m[..., :, :cols] = True
        perm = torch.randperm(k, generator=gen)
        return m[..., perm]
    if kind == "last_row":  # the last token forbids one expert (D2's shape)
        j = int(torch.randint(0, k, (1,), generator=gen))
        m[..., n - 1, j] = True
        return m
    if kind == "block":  # the first r tokens may only use the first s experts
        r = int(torch.randint(1, n + 1, (1,), generator=gen))
        s = int(torch.randint(1, k + 1, (1,), generator=gen))
        m[..., :r, s:] = True
        return m
    if kind == "single":  # every token allowed on one expert only
        allowed = torch.randint(0, k, (*batch, n, 1), generator=gen)
        return ~torch.zeros(shape, dtype=torch.bool).scatter(-1, allowed, True)
    if kind == "row":  # one token forbidden everywhere (always infeasible)
        i = int(torch.randint(0, n, (1,), generator=gen))
        m[..., i, :] = True
        return m
    raise AssertionError(kind)


@st.composite
def score_cases(
    draw: st.DrawFn,
    *,
    max_n: int = 12,
    max_k: int = 12,
    min_n: int = 1,
    min_k: int = 1,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    batch_shapes: Sequence[tuple[int, ...]] = BATCH_SHAPES,
    masks: Sequence[str] = MASKS,
    kinds: Sequence[str] = KINDS,
    scales: Sequence[float] = SCALES,
    offsets: Sequence[float] = OFFSETS,
    invalid: bool = True,
) -> ScoreCase:
    """Adversarial ``[*batch, n, k]`` scores: values, ties/near-ties, scale, offsets, -inf pattern.

    With ``invalid``, a few cases also carry a NaN or ``+inf`` entry (the caller must then expect a
    ValueError); casting to float16/bfloat16 may overflow too (``+inf``: invalid; ``-inf``: a
    forbidden pair).
    """
    n = draw(st.integers(min_n, max_n), label="n")
    k = draw(st.integers(min_k, max_k), label="k")
    batch = draw(choice(batch_shapes), label="batch")
    dtype = draw(choice(dtypes), label="dtype")
    kind = draw(choice(kinds), label="kind")
    scale = draw(choice(scales), label="scale")
    offset = draw(choice(offsets), label="offset")
    row_offsets = draw(st.booleans(), label="row_offsets")
    mask = draw(choice(masks), label="mask")
    poison = draw(mostly(("none",), ("nan", "posinf"), weight=10), label="poison") if invalid else "none"
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    shape = (*batch, n, k)
    x = _values(gen, shape, kind) * scale
    sp = float((x.amax(-1) - x.amin(-1)).max()) if x.numel() else 0.0
    unit = sp if sp > 0 else abs(scale)
    if offset:
        x = x + offset * unit
    if row_offsets and x.numel():
        x = x + (torch.randn((*batch, n, 1), generator=gen, dtype=torch.float64) * 1e5 * unit)
    x = x.to(dtype)
    forb = _forbidden(gen, shape, mask)
    x = x.masked_fill(forb, NEG_INF)
    if poison != "none" and x.numel():
        flat = x.reshape(-1).clone()
        flat[int(torch.randint(0, flat.numel(), (1,), generator=gen))] = (
            float("nan") if poison == "nan" else float("inf")
        )
        x = flat.view(shape)
    if os.environ.get("ROUTELAB_FUZZ_DEBUG"):
        for label in (f"dtype={dtype}", f"scale={scale:g}", f"kind={kind}", f"mask={mask}", f"offset={offset:g}"):
            _event(label)
    recipe = (f"n={n} k={k} batch={batch} {str(dtype)[6:]} kind={kind} scale={scale:g} offset={offset:g} "
              f"row_offsets={row_offsets} mask={mask} poison={poison} seed={seed}")
    return ScoreCase(x, recipe)


# ----------------------------------------------------------------------------- capacities

CAPACITY_CHOICES: tuple[str, ...] = ("none", "min", "mid", "n", "over", "invalid")
INVALID_CAPACITIES: tuple[Any, ...] = (0, -1, "below", 2.5, float("inf"), float("nan"), True, "2")


def capacity_for(n: int, k: int, choice: str, pick: int) -> Any:
    """A capacity for ``n`` tokens and ``k`` experts: None, ceil(n/k) .. n + 2, or an invalid one."""
    lo = -(-n // k)
    if choice == "none":
        return None
    if choice == "min":
        return lo
    if choice == "mid":
        return lo + pick % (n - lo + 1)
    if choice == "n":
        return n
    if choice == "over":
        return n + 1 + pick % 3
    bad = INVALID_CAPACITIES[pick % len(INVALID_CAPACITIES)]
    if bad == "below":
        return lo - 1 if lo > 1 else 0
    return bad


def resolve(n: int, k: int, capacity: Any) -> int | None:
    """The effective capacity ``min(c, n)`` of a valid capacity argument, else None (must raise)."""
    if capacity is None:
        return n // k if n % k == 0 else None
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        return None
    if capacity < 1 or capacity * k < n:
        return None
    return min(capacity, n)




def mostly(valid: Sequence[Any], invalid: Sequence[Any] = (), weight: int = 3) -> st.SearchStrategy:
    """``valid`` options ``weight`` times as likely as each ``invalid`` one; shrinks to ``valid[0]``.

    The invalid options sit in the middle of the list: hypothesis favours the ends of a range.
    """
    return st.sampled_from(tuple(valid) + tuple(invalid) + tuple(valid) * (weight - 1))
picks = st.integers(0, 1000)
capacity_choices = mostly(CAPACITY_CHOICES[:-1], CAPACITY_CHOICES[-1:], weight=2)


# ----------------------------------------------------------------------------- assignment oracle


def lsa(S: np.ndarray, caps: Sequence[int]) -> np.ndarray | None:
    """A maximiser of ``sum_i S[i, z_i]`` with at most ``caps[j]`` tokens on expert ``j`` (scipy's
    Hungarian solver on the column-expanded matrix), or None when the ``-inf`` pattern leaves no
    feasible assignment. Rows are shifted by their maxima first (the problem is shift-invariant
    per row), so the oracle's rounding is relative to the score spread, not to the magnitude.
    """
    m, k = S.shape
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    if m > sum(caps):
        return None
    fin = np.isfinite(S)
    if not fin.any(1).all():
        return None
    rowmax = np.where(fin, S, -np.inf).max(1, keepdims=True)
    cost = np.where(fin, rowmax - np.where(fin, S, 0.0), np.inf)
    cols = np.repeat(np.arange(k), caps)
    if cols.size < m:
        return None
    try:
        r, c = linear_sum_assignment(cost[:, cols])
    except ValueError:  # "cost matrix is infeasible"
        return None
    z = np.empty(m, dtype=np.int64)
    z[r] = cols[c]
    return z


def objective_gap(S: np.ndarray, z: np.ndarray, z_ref: np.ndarray) -> float:
    """``sum_i S[i, z_i] - sum_i S[i, z_ref_i]``, exactly rounded (math.fsum of both sums)."""
    idx = np.arange(S.shape[0])
    return math.fsum(list(S[idx, z]) + list(-S[idx, z_ref]))


def assignment_tolerance(S: np.ndarray, dtype: torch.dtype) -> float:
    """Objective tolerance ``n (k + 1) 8 eps(dtype) * spread``: relative to the score SPREAD."""
    n, k = S.shape[-2], S.shape[-1]
    return n * (k + 1) * 8 * eps(dtype) * spread(S)


def check_assignment(S: np.ndarray, z: np.ndarray, c: int, dtype: torch.dtype, what: str) -> None:
    """Capacity, no forbidden pair, optimality against the scipy oracle (one ``[n, k]`` instance)."""
    n, k = S.shape
    assert z.shape == (n,), f"{what}: expert has shape {z.shape}, expected ({n},)"
    assert ((z >= 0) & (z < k)).all(), f"{what}: expert out of range [0, {k}): {z.tolist()}"
    counts = np.bincount(z, minlength=k)
    assert (counts <= c).all(), f"{what}: capacity {c} exceeded, tokens per expert {counts.tolist()}"
    used = S[np.arange(n), z]
    assert not np.isneginf(used).any(), (
        f"{what}: forbidden (-inf) pair used by tokens {np.nonzero(np.isneginf(used))[0].tolist()}"
    )
    ref = lsa(S, [c] * k)
    assert ref is not None, f"{what}: returned an assignment although the oracle finds none feasible"
    gap = objective_gap(S, z, ref)
    tol = assignment_tolerance(S, dtype)
    assert gap >= -tol, (
        f"{what}: not optimal: objective {gap:.6g} below scipy's optimum (tolerance {tol:.3g} = "
        f"n(k+1)*8*eps*spread, spread {spread(S):.6g}); z={z.tolist()} oracle={ref.tolist()}"
    )


def feasible(S: np.ndarray, c: int) -> bool:
    return lsa(S, [c] * S.shape[-1]) is not None


def conditional_values(S: np.ndarray, G: np.ndarray, c: int) -> np.ndarray:
    """``v[i, j] = (S[i, j] - G[i, j]) + OPT_{-i}(j)`` for one ``[n, k]`` instance (up to a per-row
    constant), ``-inf`` where forbidden or infeasible.

    ``OPT_{-i}(j)``: the best total score of the other tokens when token ``i`` takes a slot of
    expert ``j``. Token ``i``'s noise ``G[i]`` is independent of the rest, so the conditional of a
    Gumbel-Matching sample given the other tokens' noise is ``softmax_j(v[i, j])`` (Kool et al.
    2021, eq. 6-9), computed here by brute force: n * k scipy solves.
    """
    n, k = S.shape
    fin = np.isfinite(S)
    rowmax = np.where(fin, S, -np.inf).max(1, keepdims=True)
    rowmax = np.where(np.isfinite(rowmax), rowmax, 0.0)
    Ssh = np.where(fin, S - rowmax, -np.inf)
    v = np.full((n, k), -np.inf)
    for i in range(n):
        others = np.delete(Ssh, i, axis=0)
        for j in range(k):
            if not fin[i, j]:
                continue
            caps = [c] * k
            caps[j] -= 1
            z = lsa(others, caps)
            if z is None:
                continue
            opt = math.fsum(others[np.arange(n - 1), z]) if n > 1 else 0.0
            v[i, j] = (Ssh[i, j] - G[i, j]) + opt
    return v


def log_softmax_np(v: np.ndarray) -> np.ndarray:
    top = v.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return v - top - np.log(np.exp(v - top).sum(-1, keepdims=True))


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(f64(x), dim=-1)


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


seeds = st.integers(0, 2**32 - 1)
taus = st.sampled_from((1.0, 0.0, 1e-3, 1e3, 1e-30))
