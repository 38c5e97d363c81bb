"""``python -m routelab.experiments.mae_translation [--quick | --cpu] [--device cuda] [--out DIR]``.

Trains the five MAE variants as Spanish -> English translation models and writes the report (see
:mod:`routelab.experiments.mae_translation`). Default: the GPU size; ``--cpu`` a smaller model
for one CPU core; ``--quick`` the pipeline check. ``--data-dir`` is the parallel text's cache
directory (a GPU machine without the Debian packages reads a carried copy of the cache).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..._checks import device_arg, seed_arg
from ..kit.cli_options import given_options
from ..kit.lock import run_locked
from ..mae.train import VARIANTS
from . import CPU, GPU, QUICK, check_settings_can_run, run


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routelab.experiments.mae_translation",
                                description=" ".join(__doc__.split("\n\n")[1].replace("``", "").split()))
    form = p.add_mutually_exclusive_group()
    form.add_argument("--quick", action="store_true", help="the pipeline check (one seed, a tiny model)")
    form.add_argument("--cpu", action="store_true", help="the smaller model for one CPU core (CPU settings)")
    p.add_argument("--device", default=None, type=device_arg,
                   help="cpu or cuda (default: cuda for the GPU size, else cpu)")
    p.add_argument("--out", type=Path, default=Path("results/mae-translation"))
    p.add_argument("--seeds", type=seed_arg, nargs="+", help="seeds (default: the form's)")
    p.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], metavar="VARIANT",
                   help=f"variants (default: all five: {', '.join(v.name for v in VARIANTS)})")
    p.add_argument("--data-dir", help="cache directory of the parallel text (default: ~/.cache/routelab)")
    args = p.parse_args(argv)
    settings = QUICK if args.quick else (CPU if args.cpu else GPU)
    device = args.device or ("cuda" if settings is GPU else "cpu")
    changes = {"device": device, "data_dir": args.data_dir, **given_options(args, "seeds", "variants")}
    settings = settings.with_(**changes)
    try:  # checked before anything runs
        check_settings_can_run(settings)
    except ValueError as err:
        p.error(str(err))
    return run_locked(args.out, p.prog, lambda: run(args.out, settings))


if __name__ == "__main__":
    sys.exit(main())
