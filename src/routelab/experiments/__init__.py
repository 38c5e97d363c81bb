"""Reproduced experiments: one small kit and one package per experiment.

* :mod:`.kit` — what every experiment is built from: the :class:`~.kit.experiment.Experiment`
  record (settings + one run function), the results store (resumable JSONL, atomic writes,
  failed runs), diverged-run handling, and the report helpers (provenance, tables, mean ± s.e.,
  claims);
* one package per experiment — ``kool_toy``, ``dselect`` (four experiments), ``mae``,
  ``moe_routers`` — each with its settings (``FULL``, ``QUICK``), one run function that trains
  what its ``runs.jsonl`` does not record yet and ends by calling its report function, and its
  ``EXPERIMENT``;
* :mod:`.registry` — the list of experiments ``routelab reproduce`` and ``routelab list`` know.

To add an experiment, write a package here whose run function records each finished run with
:func:`~.kit.store.append_jsonl_atomic` (skipping the runs :func:`~.kit.store.completed_keys`
finds), trains inside :func:`~.kit.divergence.train_or_fail` so that a diverging run is recorded
as failed, raises :class:`routelab.data.DataUnavailable` when its data is not installed (``routelab
reproduce`` then reports it as skipped and goes on), and writes its report atomically
(:func:`~.kit.store.atomic_write_text`); then list its ``EXPERIMENT`` in :mod:`.registry`.

This package imports nothing itself, so importing one experiment does not import the others.
"""
