"""What the GPU test run will find: torch, CUDA, the GPU, NCCL, and the packages the test suite imports.

``make test-gpu`` runs it with the machine's own ``python3`` before the suite::

    python3 tools/gpu_env.py [--require-cuda]

It prints one line per finding and exits 1 when the suite cannot run meaningfully: a package
routelab itself needs (``import routelab`` fails without it) or the test suite needs is missing,
or (``--require-cuda``) CUDA is not available. Optional packages only make some tests skip (the
conftest turns a missing one's ModuleNotFoundError into a skip); they are listed with their effect.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import sys

# `import routelab` needs these (of pyproject.toml's dependencies; the others are imported lazily).
REQUIRED_BY_ROUTELAB = ["torch", "numpy", "scipy"]
# Imported by the test suite at module level.
REQUIRED_BY_TESTS = ["pytest", "hypothesis"]
# Optional: the tests that need them skip, with the reason, when they are missing.
OPTIONAL = {
    "matplotlib": "a routelab dependency, imported only to draw the experiments' figures: the tests that draw "
                  "one skip (e.g. test_kool_toy's tiny sweep, test_dselect_recovery's report); bring its wheel",
    "tqdm": "a routelab dependency, imported only by the kool-toy progress bar (transformers brings it)",
    "transformers": "routelab.integrations.hf / lm-routers tests and README examples (the hf extra) skip",
    "numba": "the compiled assignment kernel's tests (tests/assignment/test_compiled_solver.py, "
             "test_sinkhorn_paths.py's compiled path) skip; the PyTorch solver is tested",
    "ot": "POT (bench extra): `routelab bench --peers` reports the peer as missing; no test needs it",
    "ortools": "OR-Tools (bench extra): as POT",
    "pandas": "MovieLens-100k loading (experiments extra, with `make data`): its test skips",
    "sacrebleu": "experiments extra: BLEU of the mae-translation experiment; its tests skip",
    "tokenizers": "experiments extra (transformers brings it): the mae-translation BPE; its tests skip",
    "ruff": "lint only (`make test` runs it; `make test-gpu` does not)",
}


def _version(name: str) -> str | None:
    """The installed version of top-level module ``name`` (``"?"`` if unknown), ``None`` if it is missing."""
    if importlib.util.find_spec(name) is None:
        return None
    dist = {"ot": "POT", "ortools": "ortools"}.get(name, name)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def cuda_report() -> tuple[list[str], bool]:
    """Lines describing torch, CUDA, the GPUs and NCCL, and whether CUDA is available."""
    import torch
    import torch.distributed as dist

    lines = [f"python {sys.version.split()[0]} ({sys.executable})",
             f"torch {torch.__version__}, built for CUDA {torch.version.cuda}"]
    available = torch.cuda.is_available()
    lines.append(f"torch.cuda.is_available(): {available}")
    if available:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
    nccl = dist.is_available() and dist.is_nccl_available()
    nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if nccl and available else "-"
    lines.append(f"NCCL available: {nccl} (version {nccl_version}); gloo available: "
                 f"{dist.is_available() and dist.is_gloo_available()}")
    triton = _version("triton")
    lines.append(f"triton {triton or 'missing'}")
    return lines, available


def package_report() -> tuple[list[str], list[str]]:
    """Lines about the packages, and the missing required ones."""
    lines, missing = [], []
    for name in REQUIRED_BY_ROUTELAB + REQUIRED_BY_TESTS:
        version = _version(name)
        lines.append(f"required {name}: {version or 'MISSING'}")
        if version is None:
            missing.append(name)
    for name, effect in OPTIONAL.items():
        version = _version(name)
        lines.append(f"optional {name}: {version}" if version else f"optional {name}: missing -> {effect}")
    return lines, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require-cuda", action="store_true", help="exit 1 when CUDA is not available")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        print(f"torch is not installed for {sys.executable}: run with the GPU machine's own python3 (PYTHON=...)")
        return 1
    lines, available = cuda_report()
    pkg_lines, missing = package_report()
    print("\n".join(["gpu_env:", *lines, *pkg_lines]))
    status = 0
    if missing:
        print(f"gpu_env: missing required package(s): {', '.join(missing)}. Without network: on a machine "
              "with network and the same Python version, `make gpu-wheels GPU_PY=<major.minor>` downloads "
              "their wheels into wheels/; copy that folder into this checkout and `make test-gpu` installs them.")
        status = 1
    if args.require_cuda and not available:
        print("gpu_env: CUDA is not available to this python (a CPU build of torch, or no driver/device)")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
