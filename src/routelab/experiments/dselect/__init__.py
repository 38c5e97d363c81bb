"""Reproductions of Hazimeh et al. (2021), DSelect-k, on routelab's gates and MultiGateMoE.

Four experiments, one module each, each with its settings (``FULL``, ``QUICK``), its run
function and its ``EXPERIMENT``:

* ``dselect-recovery`` — App. C.2.2 expert recovery (:mod:`.recovery`; its report
  :mod:`.recovery_report`, its identifiability check :mod:`.identifiability`);
* ``dselect-synthetic`` — App. C.1 synthetic multi-task data, 16–128 tasks (:mod:`.synthetic`);
* ``dselect-movielens`` — Sec. 4.1 on MovieLens-100k (:mod:`.movielens`);
* ``dselect-multimnist`` — Sec. 4.2 Multi-MNIST and Multi-Fashion (:mod:`.multimnist`).

They share :mod:`.common` (the gates compared, the minibatch loop) and :mod:`.mtl_train` (the
multi-task training loop). Each writes ``report.md`` (the paper's numbers next to routelab's),
figures and per-run results under its out_dir; results are appended one JSON line per finished
run, so a rerun resumes.
"""
