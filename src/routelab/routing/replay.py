"""Compatibility name: :class:`NoiseReplay` lives in :mod:`routelab.replay` (import layer 1, so that
gates, routing, routers and layers can all replay their noise under activation checkpointing)."""

from ..replay import NoiseReplay, in_backward

__all__ = ["NoiseReplay", "in_backward"]
