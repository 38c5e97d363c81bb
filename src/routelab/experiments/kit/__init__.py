"""The experiment kit: what every reproduced experiment is built from, one concern per module.

* :mod:`.experiment` — :class:`~.experiment.Experiment`: settings (full and quick) + one run function;
* :mod:`.store` — the results files: one JSON line per finished run, appended atomically,
  resumed from; atomic writes of reports; failed-run records;
* :mod:`.divergence` — a training run whose loss or parameters become non-finite is recorded as
  failed instead of stopping the sweep;
* report helpers: :mod:`.provenance` (version, commit, software, load), :mod:`.tables`
  (markdown tables, CSV cells), :mod:`.stats` (mean ± s.e., the 95 % t interval a difference is judged
  against), :mod:`.claims` (a paper's claims,
  their verdicts and table, ``claims.json``), :mod:`.failed_runs` (the failed-runs section);
* :mod:`.scoreboard` — the table of every experiment's claims that opens ``routelab reproduce``'s report.

The kit imports nothing from the experiments; the experiments import from its modules.
"""
