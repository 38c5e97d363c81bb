"""Benchmarks of routelab's algorithms (run with ``routelab bench NAME``).

* :mod:`routelab.bench.assignment` — :func:`routelab.assignment.balanced_assignment` against
  :func:`scipy.optimize.linear_sum_assignment`, plus :func:`~routelab.assignment.gumbel_matching`
  and :func:`~routelab.assignment.sinkhorn` timings on the same grid of sizes.
"""
