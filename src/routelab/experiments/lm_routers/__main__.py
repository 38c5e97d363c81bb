"""``python -m routelab.experiments.lm_routers [--quick] [--device cuda] [--out DIR]``.

The same sweep as ``routelab reproduce lm-routers``, with the options ``reproduce`` does not have: the
device (``cuda`` runs every model, its routing included, on the GPU; the hooks that time the routing
then synchronise the device), the seeds, the number of steps, and ``--large``: 4 layers, d_model 256,
16 wide experts (for a GPU).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..._checks import positive_int_arg, seed_arg
from ..kit.cli_options import given_options
from ..kit.lock import run_locked
from . import FULL, LARGE, QUICK, ROUTER_SPECS, run_sweep


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routelab.experiments.lm_routers",
                                description=" ".join(__doc__.split("\n\n")[1].replace("``", "").split()))
    form = p.add_mutually_exclusive_group()
    form.add_argument("--quick", action="store_true", help="the quick form (3 seeds, 60 steps, a tiny model)")
    form.add_argument("--large", action="store_true", help="the larger form meant for a GPU (see LARGE)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("results/lm-routers"))
    p.add_argument("--seeds", type=seed_arg, nargs="+", help="seeds (default: the form's)")
    p.add_argument("--steps", type=positive_int_arg, help="training steps (default: the form's)")
    p.add_argument("--routers", nargs="+", choices=[s.name for s in ROUTER_SPECS], metavar="ROUTER",
                   help=f"routers (default: all; of {', '.join(s.name for s in ROUTER_SPECS)})")
    p.add_argument("--data-dir", help="cache directory of the parallel text (default: ~/.cache/routelab; "
                                      "make gpu-data writes one to data-cache/)")
    args = p.parse_args(argv)
    settings = QUICK if args.quick else (LARGE if args.large else FULL)
    changes = {"device": args.device, **given_options(args, "seeds", "steps", "routers")}
    settings = settings.with_(**changes)
    try:  # every setting checked before anything runs (a CUDA device where there is none, ...)
        settings.validate()
    except ValueError as err:
        p.error(str(err))
    return run_locked(args.out, p.prog, lambda: run_sweep(args.out, settings, data_dir=args.data_dir))


if __name__ == "__main__":
    sys.exit(main())
