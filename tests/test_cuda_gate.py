"""The CUDA gate of tests/conftest.py (and its missing-optional-package skip), checked on CPU: small
pytest sessions run with a copy of the conftest.

``torch.cuda.is_available`` is monkeypatched (True: a pretend GPU machine; False: this one) so
every branch runs without a GPU: CUDA tests skip without ``ROUTELAB_REQUIRE_CUDA``; with it the
session stops when there is no CUDA, and a skip for lack of CUDA becomes a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import conftest as gate

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


@pytest.fixture(autouse=True)
def _triton_interpret_restored() -> Iterator[None]:
    """The inner conftest, seeing no CUDA, sets TRITON_INTERPRET=1 in this process's environment: on
    a GPU machine that leaked into the worker's later tests, whose Triton kernels then ran half in
    the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before

# Collected by the inner session after it started: from here on CUDA "disappears" (the pretend
# GPU machine passed the session-start check; its tests then meet a machine without CUDA).
INNER_TESTS = '''
import pytest
import torch

torch.cuda.is_available = lambda: {available_at_test}


@pytest.mark.requires_cuda
def test_marked():
    pass


@pytest.mark.requires_cuda(nccl=True)
def test_marked_nccl():
    pass


def test_skips_itself():
    pytest.skip("needs a CUDA device")


@pytest.mark.skipif(True, reason="CUDA is not available")
def test_skipif():
    pass


def test_skip_unrelated():
    pytest.skip("transformers is not installed")


@pytest.mark.requires_no_cuda
def test_without_cuda():
    pass


def test_plain():
    pass
'''


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *, require: str | None,
         available_at_start: bool, available_at_test: bool) -> pytest.RunResult:
    if require is None:
        monkeypatch.delenv(gate.REQUIRE_CUDA_ENV, raising=False)
    else:
        monkeypatch.setenv(gate.REQUIRE_CUDA_ENV, require)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available_at_start)  # restored afterwards
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS.format(available_at_test=available_at_test))
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA")


def test_without_the_variable_cuda_tests_skip_with_their_reason(pytester: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, require=None, available_at_start=False, available_at_test=False)
    result.assert_outcomes(passed=2, skipped=5)
    result.stdout.fnmatch_lines(["*needs a CUDA device (torch.cuda.is_available() is False)*"])


def test_zero_means_not_required(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, require="0", available_at_start=False, available_at_test=False)
    result.assert_outcomes(passed=2, skipped=5)


def test_required_without_cuda_stops_the_session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, require="1", available_at_start=False, available_at_test=False)
    assert result.ret == 3
    result.stdout.fnmatch_lines(["*ROUTELAB_REQUIRE_CUDA=1 but torch.cuda.is_available() is False*"])
    assert "passed" not in result.stdout.str() and "test_inner.py" not in result.stdout.str()  # nothing ran


def test_required_turns_cuda_skips_into_failures(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, require="1", available_at_start=True, available_at_test=False)
    # requires_cuda (both) and skipif(reason="CUDA ...") fail at setup (pytest counts them as errors),
    # pytest.skip("...CUDA...") fails in the call; the unrelated skip stays a skip; requires_no_cuda
    # and the plain test run (CUDA is absent at test time).
    result.assert_outcomes(passed=2, skipped=1, failed=1, errors=3)
    result.stdout.fnmatch_lines(["*ROUTELAB_REQUIRE_CUDA=1: this test needs a CUDA device*"])
    result.stdout.fnmatch_lines(["*forbids skipping for lack of CUDA/NCCL: needs a CUDA device*"])


def test_on_a_cuda_machine_marked_tests_run_and_no_cuda_tests_skip(pytester: pytest.Pytester,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    result = _run(pytester, monkeypatch, require="1", available_at_start=True, available_at_test=True)
    # Both requires_cuda tests pass; requires_no_cuda skips (allowed); the two hand-written CUDA skips fail.
    result.assert_outcomes(passed=3, skipped=2, failed=1, errors=1)


def test_missing_cuda_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA device" in gate.missing_cuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gate.missing_cuda() is None
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert "NCCL" in gate.missing_cuda(nccl=True)
    assert gate.missing_cuda(nccl=False) is None


@pytest.mark.parametrize(("value", "required"), [(None, False), ("", False), ("0", False), ("1", True),
                                                 ("yes", True)])
def test_cuda_required_reads_the_variable(monkeypatch: pytest.MonkeyPatch, value: str | None, required: bool) -> None:
    if value is None:
        monkeypatch.delenv(gate.REQUIRE_CUDA_ENV, raising=False)
    else:
        monkeypatch.setenv(gate.REQUIRE_CUDA_ENV, value)
    assert gate.cuda_required() is required


MISSING_PACKAGE_TESTS = '''
def test_needs_a_missing_optional_package():
    import routelab_absent_optional  # noqa: F401


def test_installed_package_broken():
    raise ModuleNotFoundError("No module named 'torch.nonexistent'", name="torch.nonexistent")


def test_needs_a_missing_unlisted_package():
    import routelab_absent_required  # noqa: F401
'''


def test_a_missing_optional_package_skips_the_test(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gate.REQUIRE_CUDA_ENV, raising=False)
    monkeypatch.setenv(gate.ALLOW_MISSING_ENV, "1")
    extra = '\nOPTIONAL_PACKAGES = OPTIONAL_PACKAGES | {"routelab_absent_optional", "torch"}\n'
    pytester.makeconftest(CONFTEST + extra)
    pytester.makepyfile(test_inner=MISSING_PACKAGE_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA")
    # Only the listed package that is really absent skips; an installed one (torch) or an unlisted one fails.
    result.assert_outcomes(skipped=1, failed=2)
    result.stdout.fnmatch_lines(["*routelab_absent_optional is not installed (an optional package for this test)*"])


def test_without_the_variable_a_missing_package_is_an_error(pytester: pytest.Pytester,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gate.REQUIRE_CUDA_ENV, raising=False)
    monkeypatch.delenv(gate.ALLOW_MISSING_ENV, raising=False)
    pytester.makeconftest(CONFTEST + '\nOPTIONAL_PACKAGES = OPTIONAL_PACKAGES | {"routelab_absent_optional"}\n')
    pytester.makepyfile(test_inner=MISSING_PACKAGE_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=3)  # make test / CI: every extra is installed, so absence is a real error


def test_missing_optional_package_names_only_absent_listed_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gate.ALLOW_MISSING_ENV, "1")
    assert gate.missing_optional_package(ModuleNotFoundError("x", name="torch")) is None  # installed
    assert gate.missing_optional_package(ValueError("matplotlib")) is None
    assert gate.missing_optional_package(ModuleNotFoundError("no name")) is None
