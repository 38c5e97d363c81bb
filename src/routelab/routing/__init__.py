"""From router decisions to expert buffers: capacity (who is dropped) and dispatch/combine."""

from routelab.routing.capacity import (
    DROP_POLICIES,
    CapacityDecision,
    apply_capacity,
    check_capacity,
    check_capacity_factor,
    expert_capacity,
)
from routelab.routing.dispatch import DispatchPlan

__all__ = [
    "DROP_POLICIES",
    "CapacityDecision",
    "DispatchPlan",
    "apply_capacity",
    "check_capacity",
    "check_capacity_factor",
    "expert_capacity",
]
