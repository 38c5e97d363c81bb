"""From router scores to expert buffers: the routing rules (pure functions, scores to
:class:`~routelab.Routes`), capacity (who is dropped), the skip correction of eq. 3, the random
drop rule, the auxiliary losses (the Switch balance loss once for all), dispatch/combine, the
load statistics of a decision, the record of each routing module's last forward (``aux_loss``,
``routing_stats``); token masks (:func:`real_tokens`, :func:`scatter_routes`), the noise replay of
activation checkpointing (:class:`NoiseReplay`) and the solvers' exclusion from ``torch.compile``
(:func:`eager`)."""

from routelab.replay import NoiseReplay
from routelab.routing.capacity import (
    DROP_POLICIES,
    CapacityDecision,
    apply_capacity,
    check_capacity,
    check_capacity_factor,
    expert_capacity,
    random_ranks,
    random_skip,
    skip_correction,
)
from routelab.routing.dispatch import DispatchPlan, GroupedPlan
from routelab.routing.eager import eager
from routelab.routing.losses import switch_balance
from routelab.routing.masks import masked_rule, real_tokens, scatter_routes
from routelab.routing.record import RoutingRecord, aux_loss, routing_stats
from routelab.routing.rules import (
    balanced_routes,
    batchwise_routes,
    noisy_topk_routes,
    sinkhorn_routes,
    softmax_routes,
    topk_routes,
)
from routelab.routing.stats import load_stats

__all__ = [
    "DROP_POLICIES",
    "CapacityDecision",
    "DispatchPlan",
    "GroupedPlan",
    "NoiseReplay",
    "RoutingRecord",
    "apply_capacity",
    "aux_loss",
    "balanced_routes",
    "batchwise_routes",
    "check_capacity",
    "check_capacity_factor",
    "eager",
    "expert_capacity",
    "load_stats",
    "masked_rule",
    "noisy_topk_routes",
    "random_ranks",
    "random_skip",
    "real_tokens",
    "routing_stats",
    "scatter_routes",
    "sinkhorn_routes",
    "skip_correction",
    "softmax_routes",
    "switch_balance",
    "topk_routes",
]
