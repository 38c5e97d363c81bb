"""Gates: modules and functions that turn inputs into expert scores or weights.

A gate only produces scores/weights; turning them into a :class:`routelab.Routes` decision
under capacity is the routers' job (:mod:`routelab.routers`).
"""

# Each gate family lives in its own module; add its public names here.
__all__: list[str] = []
