"""Routing rules: pure functions from router scores to :class:`~routelab.Routes` (in the manner
of DeepSpeed's ``top1gating``).

A router (:mod:`routelab.routers`) is a thin module: it scores the tokens and calls one of these
rules on the scores of the whole batch. Each rule takes float32 logits ``[tokens, E]`` (finite:
the router checks them, in its one host synchronisation) and its options, and returns
``Routes [tokens, slots]`` whose ``keep`` marks the *proposed* slots; the layer then enforces the
expert capacity on them (:func:`routelab.routing.apply_capacity`). ``aux`` holds the rule's
auxiliary losses, already multiplied by their coefficients. No rule keeps state: randomness comes
from the ``generator`` argument, learned quantities (batchwise thresholds) are arguments. Every
rule also takes ``mask: BoolTensor [tokens]`` (``True`` = a real token): it then runs on the real
tokens alone and routes the masked ones nowhere (:mod:`routelab.routing.masks`).

* :func:`softmax_routes` — dense softmax gating (Shazeer et al. 2017, eq. 15);
* :func:`topk_routes` — top-k (Switch for ``k = 1``), Switch balance loss;
* :func:`noisy_topk_routes` — noisy top-k with the importance and load losses (Shazeer et al.);
* :func:`batchwise_routes` — strictly balanced batchwise gating, learned thresholds (App. F);
* :func:`balanced_routes` — the exact balanced assignment of BASE layers (Kool et al. eq. 4);
* :func:`sinkhorn_routes` — Sinkhorn-balanced top-k (Kool et al. Sec. 2.3; S-BASE).

The stochastic balanced rule, Gumbel-Matching with importance weights, is
:func:`routelab.estimators.gumbel_matching_routes` (it samples with the estimators).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import (
    balanced_quotas,
    check_capacity,
    check_k,
    check_nonneg,
    check_positive_int,
    checks_run,
    random_tensor,
)
from ..assignment import balanced_assignment as _balanced_assignment
from ..assignment import balanced_b_matching as _balanced_b_matching
from ..assignment import sinkhorn_balance
from ..gates.batchwise import batchwise_mask, batchwise_threshold_loss, threshold_mask
from ..routes import Routes
from .eager import eager
from .losses import cv_squared, noisy_topk_load, switch_balance
from .masks import masked_rule

__all__ = [
    "INFERENCE_MASKS",
    "balanced_capacity",
    "batchwise_mask_in_use",
    "expert_grid",
    "sinkhorn_balanced_log_probs",
    "balanced_routes",
    "batchwise_routes",
    "noisy_topk_routes",
    "sinkhorn_routes",
    "softmax_routes",
    "topk_routes",
]

# The solvers run eagerly under torch.compile (routing/eager.py).
balanced_assignment = eager(_balanced_assignment)
balanced_b_matching = eager(_balanced_b_matching)

#: The masks batchwise gating may use at inference (``batchwise_routes(..., inference=)``).
INFERENCE_MASKS: tuple[str, ...] = ("threshold", "batchwise")


def _check_logits(logits: object, name: str = "logits") -> Tensor:
    """``logits`` if it is a floating ``[tokens, E]`` tensor, else a TypeError/ValueError naming it.

    Values are not checked here (the router checks them once per call, in one host sync).
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [tokens, E], got {type(logits).__name__}")
    if logits.ndim != 2 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [tokens, E] with E >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {logits.dtype}; use {name}.float()")
    return logits


def expert_grid(n: int, num_experts: int, device: torch.device) -> Tensor:
    """``LongTensor [n, E]`` whose every row is ``0 .. E-1`` (one slot per expert)."""
    return torch.arange(num_experts, device=device).expand(n, num_experts)


def balanced_capacity(n: int, num_experts: int, capacity: int | None, router: str = "balanced", k: int = 1) -> int:
    """The capacity a balanced solve uses: ``ceil(k * n / E)`` pairs per expert
    (:func:`routelab._checks.balanced_quotas`), whatever the layer's buffer capacity.

    Balanced means balanced: a dropless layer (``capacity = n``) or a capacity factor above 1
    only leaves the buffers slack; the solve itself always balances at ``k * n / E``.

    Args:
        n: tokens routed (the real tokens).
        num_experts: ``E``.
        capacity: the layer's per-expert buffer capacity, or ``None`` (no buffer limit).
        router: the router's name, for the error.
        k: experts per token.

    Raises:
        ValueError: ``capacity`` is smaller than the quota (the balanced router could not place
            every pair: it names ``capacity_factor``, the layer's knob).
    """
    quota = balanced_quotas(n, num_experts, k)[1]
    capacity = check_capacity(capacity)
    if capacity is not None and capacity < quota:
        raise ValueError(
            f"capacity={capacity} is below the balanced quota ceil(k*n/E) = {quota} of n={n} tokens on "
            f"E={num_experts} experts: the {router} router assigns every token, so use capacity_factor >= 1 "
            f"(capacity >= {quota})"
        )
    return quota


@masked_rule("logits")
def softmax_routes(logits: Tensor, *, importance_coef: float = 0.0) -> Routes:
    """Dense gating ``G(x) = softmax(logits)`` (Shazeer et al. 2017, eq. 15): ``E`` slots per token.

    Args:
        logits: ``[tokens, E]``.
        importance_coef: weight of ``CV(sum_x G(x))^2`` in ``aux["importance"]`` (0: no loss).

    Returns:
        ``Routes [tokens, E]``: slot ``e`` is expert ``e``, gate ``G``, every slot proposed.
    """
    n, E = _check_logits(logits).shape
    importance_coef = check_nonneg("importance_coef", importance_coef)
    log_p = torch.log_softmax(logits, -1)
    probs = log_p.exp()
    aux = {}
    if importance_coef:
        aux["importance"] = importance_coef * cv_squared(probs.sum(0))
    return Routes(
        expert=expert_grid(n, E, logits.device),
        gate=probs,
        keep=torch.ones(n, E, dtype=torch.bool, device=logits.device),
        weight=torch.ones_like(probs),
        log_prob=log_p,
        aux=aux,
    )


@masked_rule("logits")
def topk_routes(logits: Tensor, k: int, *, renormalize: bool = False, balance_coef: float = 0.01) -> Routes:
    """Each token goes to the ``k`` experts with the largest logits (``k = 1``: Switch routing).

    Args:
        logits: ``[tokens, E]``.
        k: experts per token, ``1 <= k <= E``.
        renormalize: combine weights ``softmax`` over the ``k`` chosen logits (Shazeer et al.,
            Mixtral) instead of the full-softmax probabilities of the chosen experts (Switch,
            GShard).
        balance_coef: weight of the Switch balance loss ``E sum_e f_e P_e`` in ``aux["balance"]``.

    Returns:
        ``Routes [tokens, k]``, every slot proposed.
    """
    check_k(k, _check_logits(logits).shape[-1])
    balance_coef = check_nonneg("balance_coef", balance_coef)
    log_p = torch.log_softmax(logits, -1)
    top_logits, expert = logits.topk(k, dim=-1)
    log_prob = log_p.gather(-1, expert)
    gate = torch.softmax(top_logits, -1) if renormalize else log_prob.exp()
    keep = torch.ones_like(expert, dtype=torch.bool)
    aux = {}
    if balance_coef:
        aux["balance"] = balance_coef * switch_balance(log_p.exp())
    return Routes(expert=expert, gate=gate, keep=keep, weight=torch.ones_like(gate), log_prob=log_prob, aux=aux)


@masked_rule("logits", "noise_std")
def noisy_topk_routes(logits: Tensor, noise_std: Tensor, k: int, *, training: bool = True,
                      importance_coef: float = 0.1, load_coef: float = 0.1,
                      generator: torch.Generator | None = None, check: bool = True) -> Routes:
    """Noisy top-k gating with the importance and load losses of Shazeer et al. (2017).

    ``H = logits + eps * noise_std`` with ``eps ~ N(0, 1)`` when ``training`` (eq. 4; the
    logits themselves otherwise), ``G = softmax(KeepTopK(H, k))`` (eq. 3, 5);
    ``aux["importance"] = importance_coef * CV(sum_x G(x))^2`` (eq. 6-7) and ``aux["load"] =
    load_coef * CV(Load)^2`` with the smooth load estimator of App. A (eq. 8-11).

    Args:
        logits: ``[tokens, E]`` clean logits (differentiable).
        noise_std: ``[tokens, E]`` noise scales ``>= 0`` (differentiable; a scale of exactly 0, as
            ``softplus`` gives far below 0, is the noiseless limit: that expert's load term is a step,
            without gradient).
        k: experts per token.
        training: add the noise.
        importance_coef, load_coef: loss weights ``>= 0`` (the paper uses 0.1 each).
        generator: the noise's only source of randomness.
        check: check that every noise scale is ``>= 0`` (one host synchronisation; skipped while
            ``torch.compile`` traces). A router whose scales are ``softplus(...) >= 0`` by
            construction passes ``False``.

    Raises:
        ValueError: a negative or NaN noise scale (with ``check``), or a negative or non-finite
            loss weight, naming the argument.

    Returns:
        ``Routes [tokens, k]``, every slot proposed.
    """
    n, E = _check_logits(logits).shape
    check_k(k, E)
    if not isinstance(noise_std, Tensor) or noise_std.shape != logits.shape:
        got = tuple(noise_std.shape) if isinstance(noise_std, Tensor) else type(noise_std).__name__
        raise ValueError(f"noise_std must be a tensor of the logits' shape {tuple(logits.shape)}, got {got}")
    importance_coef = check_nonneg("importance_coef", importance_coef)
    load_coef = check_nonneg("load_coef", load_coef)
    if check and noise_std.numel() and checks_run() and not bool((noise_std >= 0).all()):
        raise ValueError("noise_std must hold noise scales >= 0 (eq. 4 of Shazeer et al.: a standard deviation), "
                         "got negative or NaN values; compute them as softplus(x @ W_noise), as the paper does")
    if training:
        eps = random_tensor(torch.randn, logits.shape, dtype=logits.dtype, device=logits.device, generator=generator)
        # Logits and noise scales near the dtype's maximum can overflow the sum: keep it at the
        # largest finite value, so that the gate's softmax never meets inf - inf. A NaN stays NaN
        # (never a silent 0): the router's finite check, or the caller's, names it.
        big = torch.finfo(logits.dtype).max
        noisy = torch.nan_to_num(logits + eps * noise_std, nan=float("nan"), posinf=big, neginf=-big)
    else:
        noisy = logits
    top_values, top_index = noisy.topk(min(k + 1, E), dim=-1)
    expert = top_index[:, :k]
    gate = torch.softmax(top_values[:, :k], -1)
    log_prob = torch.log_softmax(noisy, -1).gather(-1, expert)
    # (a loss its coefficient asks for is always there, 0 for a batch without tokens: logs keyed by name)
    aux = {}
    if importance_coef:
        full = torch.zeros_like(logits).scatter(-1, expert, gate)
        aux["importance"] = importance_coef * cv_squared(full.sum(0)) if n else logits.new_zeros(())
    if load_coef:
        aux["load"] = (load_coef * cv_squared(noisy_topk_load(logits, noisy, noise_std, top_values, k)) if n
                       else logits.new_zeros(()))
    return Routes(expert=expert, gate=gate, keep=torch.ones_like(expert, dtype=torch.bool),
                  weight=torch.ones_like(gate), log_prob=log_prob, aux=aux)


def batchwise_mask_in_use(probs: Tensor, k: int, thresholds: Tensor, *, training: bool,
                          inference: str = "threshold", check_nan: bool = True) -> Tensor:
    """The App. F mask: batchwise (eq. 18) in training or with ``inference="batchwise"``, else the
    threshold mask ``probs > thresholds`` (eq. 19, any batch size). ``check_nan``: refuse NaN
    (one host sync), as :func:`~routelab.gates.batchwise_mask` does."""
    if inference not in INFERENCE_MASKS:
        raise ValueError(f"inference must be one of {INFERENCE_MASKS}, got {inference!r}")
    if training or inference == "batchwise":
        return batchwise_mask(probs, k, check_nan=check_nan)
    # (compared in the promoted dtype, as the threshold loss trained T: T rounded to bfloat16
    # probabilities could flip every decision)
    return threshold_mask(probs, thresholds.detach(), check_nan=check_nan)


@masked_rule("logits")
def batchwise_routes(logits: Tensor, k: int, thresholds: Tensor, *, training: bool = True,
                     inference: str = "threshold", threshold_coef: float = 1.0, check_nan: bool = True) -> Routes:
    """App. F gating: ``G = G_sigma * M / sum(G_sigma * M)`` (eq. 16) with ``G_sigma = softmax(logits)``.

    Training: ``M`` is the batchwise mask (eq. 18), every expert takes ``k * tokens / E`` tokens
    (its floor or ceiling when ``E`` does not divide ``k * tokens``), and the thresholds learn from
    ``aux["threshold"] = threshold_coef * L_batchwise(G_sigma, T, M) / tokens`` (eq. 20, on
    detached scores). Inference: the threshold mask ``G_sigma > T`` (eq. 19), or the batchwise
    mask with ``inference="batchwise"``.

    Args:
        logits: ``[tokens, E]``.
        k: average experts per token, ``1 <= k <= E``.
        thresholds: ``[E]`` per-expert thresholds ``T`` (differentiable: the threshold loss).
        training: training mode (batchwise mask, threshold loss).
        inference: ``"threshold"`` or ``"batchwise"``.
        threshold_coef: weight of the threshold loss.
        check_nan: refuse NaN scores and thresholds (host syncs); ``False`` for a router with
            ``check_finite=False``, whose forward then makes no host sync for them.

    Returns:
        ``Routes [tokens, E]``: slot ``e`` is expert ``e``, ``keep`` the mask (a token may use
        any number of experts, including none: its gate is then all zero).
    """
    n, E = _check_logits(logits).shape
    check_k(k, E)
    threshold_coef = check_nonneg("threshold_coef", threshold_coef)
    if not isinstance(thresholds, Tensor) or tuple(thresholds.shape) != (E,):
        got = tuple(thresholds.shape) if isinstance(thresholds, Tensor) else type(thresholds).__name__
        raise ValueError(f"thresholds must be a tensor [E] = [{E}] (one per expert), got {got}")
    log_p = torch.log_softmax(logits, -1)
    probs = log_p.exp()
    mask = batchwise_mask_in_use(probs, k, thresholds, training=training, inference=inference, check_nan=check_nan)
    # Eq. 16 as a softmax over the kept logits: exact however small the kept mass (a quotient of
    # probabilities is off once the kept ones fall below the dtype's smallest normal, 6e-5 in float16).
    # A token with no expert of positive probability gets the zero gate (its row is softmaxed at 0
    # and masked out), as the quotient's 0 / 0 convention.
    live = mask & (log_p > float("-inf"))
    kept_log_p = log_p.masked_fill(~live, float("-inf")).masked_fill(~live.any(-1, keepdim=True), 0.0)
    gate = torch.softmax(kept_log_p, -1) * live
    aux = {}
    if training and threshold_coef:  # (0 for a batch without tokens: logs keyed by name keep the key)
        aux["threshold"] = (threshold_coef * batchwise_threshold_loss(probs.detach(), thresholds, mask,
                                                                      check_nan=check_nan) / n
                            if n else thresholds.new_zeros(()))
    return Routes(expert=expert_grid(n, E, logits.device), gate=gate, keep=mask,
                  weight=torch.ones_like(gate), log_prob=log_p, aux=aux)


@masked_rule("logits")
def balanced_routes(logits: Tensor, capacity: int | None = None, *, balanced: bool = True, k: int = 1) -> Routes:
    """BASE layers (Lewis et al. 2021): the exact balanced assignment maximising the total score.

    Every expert gets the balanced quota, ``floor`` or ``ceil`` of ``k n / E`` (token, expert)
    pairs, whatever the layer's buffer capacity (:func:`balanced_capacity`). ``k = 1``: one expert
    per token, ``balanced_assignment(logits, n / E)`` (Kool et al. eq. 4, exact) when ``E``
    divides ``n``; ``k > 1``, or quotas that differ (``E`` does not divide ``k n``): the exact
    balanced b-matching (:func:`routelab.assignment.balanced_b_matching`), ``k`` distinct experts
    per token maximising the total logit. ``balanced=False`` takes the greedy top-``k``
    (``argmax`` for ``k = 1``) instead (BASE's inference, which depends on no other token). The
    combine weight of every slot is ``sigmoid(logit of its expert)``.

    Args:
        logits: ``[tokens, E]``.
        capacity: the layer's buffer capacity per expert (``None``: no limit); it must hold the
            quota ``ceil(k tokens / E)``.
        balanced: solve the balanced assignment (else top-``k``).
        k: experts per token, ``1 <= k <= E``.

    Returns:
        ``Routes [tokens, k]``, the slots of a token by descending logit.
    """
    n, E = _check_logits(logits).shape
    check_k(k, E)
    if n == 0:
        expert = torch.zeros((0, k), dtype=torch.long, device=logits.device)
    elif not balanced:
        expert = logits.argmax(-1, keepdim=True) if k == 1 else logits.detach().topk(k, dim=-1).indices
    else:
        quota = balanced_capacity(n, E, capacity, "base", k=k)  # checks the buffer holds the quota
        if k == 1 and n % E == 0:  # one quota n / E for every expert: the assignment solver
            expert = balanced_assignment(logits.detach(), quota).unsqueeze(-1)
        else:  # floor/ceil quotas (or k > 1): the b-matching
            expert = balanced_b_matching(logits.detach(), k)
    chosen = logits.gather(-1, expert)
    log_prob = torch.log_softmax(logits, -1).gather(-1, expert)
    gate = torch.sigmoid(chosen)
    return Routes(expert=expert, gate=gate, keep=torch.ones_like(gate, dtype=torch.bool),
                  weight=torch.ones_like(gate), log_prob=log_prob)


@eager
def sinkhorn_balanced_log_probs(log_p: Tensor, sweeps: int) -> Tensor:
    """``[tokens, E]`` log of the Sinkhorn-balanced probabilities (detached): columns towards
    ``tokens / E``, at most ``sweeps`` sweeps, stopping once every column is within 1% of it."""
    n, E = log_p.shape
    target = torch.full((E,), n / E, dtype=log_p.dtype, device=log_p.device)
    out, _ = sinkhorn_balance(log_p.detach().unsqueeze(0), target, tol=0.01 * n / E, max_iter=sweeps)
    return out.squeeze(0)


@masked_rule("logits")
def sinkhorn_routes(logits: Tensor, k: int, *, sweeps: int = 20, balanced: bool = True, renormalize: bool = False,
                    balance_coef: float = 0.0) -> Routes:
    """Sinkhorn-balanced routing (Kool et al. Sec. 2.3; S-BASE of Clark et al. 2022).

    ``p = softmax(logits)`` is balanced by Sinkhorn over the batch (columns ``tokens / E``, a
    fixed budget of ``sweeps``); each token takes the ``k`` experts with the largest *balanced*
    probability and combines them with the *unbalanced* ``p`` (``renormalize``: rescaled to sum
    to 1). ``balanced=False`` skips the balancing (S-BASE's inference).

    Args:
        logits: ``[tokens, E]``.
        k: experts per token.
        sweeps: Sinkhorn sweeps per batch.
        balanced: balance before choosing.
        renormalize: rescale the chosen probabilities to sum to 1.
        balance_coef: weight of the Switch balance loss in ``aux["balance"]``.

    Returns:
        ``Routes [tokens, k]``, every slot proposed.
    """
    n, E = _check_logits(logits).shape
    check_k(k, E)
    check_positive_int("sweeps", sweeps)
    balance_coef = check_nonneg("balance_coef", balance_coef)
    log_p = torch.log_softmax(logits, -1)
    select = sinkhorn_balanced_log_probs(log_p, sweeps) if (n and balanced) else log_p.detach()
    expert = select.topk(k, dim=-1).indices
    log_prob = log_p.gather(-1, expert)
    # Renormalised: p_i / sum_j p_j over the chosen experts, as a softmax of their log-probabilities
    # (balancing can choose experts whose probability underflows to 0: the quotient would be 0 / 0).
    gate = torch.softmax(log_prob, -1) if renormalize else log_prob.exp()
    keep = torch.ones_like(expert, dtype=torch.bool)
    aux = {}
    if balance_coef:  # (0 for a batch without tokens: logs keyed by name keep the key)
        aux["balance"] = balance_coef * switch_balance(log_p.exp()) if n else logits.new_zeros(())
    return Routes(expert=expert, gate=gate, keep=keep, weight=torch.ones_like(gate), log_prob=log_prob, aux=aux)
