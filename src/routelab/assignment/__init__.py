"""Pure balanced-assignment algorithms (layer 1 of routelab): no modules, no state."""

from .balanced import balanced_assignment

__all__ = ["balanced_assignment"]
