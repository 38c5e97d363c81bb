"""Contracts of :func:`routelab.parallel.run_workers` found missing by mutation testing of launch.py.

Each test starts a few short-lived gloo ranks (forked on a machine without a GPU) and checks one promise
of the docstring: results come back ordered by rank, a failing rank's whole traceback reaches the parent
(the first failure first, the other ranks' failures too), a rank that dies is named with its exit code
(also when a signal killed it), the deadline is ``timeout`` seconds, ranks still running at the deadline
are terminated, and ``threads`` sets every child's torch thread count.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from routelab.parallel import run_workers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _late_low_ranks_worker(rank: int, world: int) -> int:
    time.sleep(0.4 * (world - 1 - rank))  # the highest rank finishes first, rank 0 last
    return rank


def test_results_are_ordered_by_rank_not_by_arrival():
    """run_workers returns ``[result of rank 0, rank 1, ...]`` even when the ranks finish in reverse order."""
    assert run_workers(_late_low_ranks_worker, 3, timeout=30) == [0, 1, 2]


def _deep_helper_that_raises(rank: int) -> None:
    raise ValueError(f"deliberate failure on rank {rank}")


def _one_rank_raises_worker(rank: int, world: int) -> None:
    if rank == 1:
        _deep_helper_that_raises(rank)


def test_a_failing_ranks_full_traceback_reaches_the_parent():
    """The RuntimeError carries the rank's whole traceback (frames included), not just the exception line."""
    with pytest.raises(RuntimeError) as info:
        run_workers(_one_rank_raises_worker, 2, timeout=30)
    message = str(info.value)
    assert "rank 1 of 2 failed:" in message
    assert "Traceback (most recent call last)" in message
    assert "_deep_helper_that_raises" in message  # a frame of the failing call stack
    assert "ValueError: deliberate failure on rank 1" in message


def _both_ranks_raise_worker(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(0.6)  # rank 1 fails first, rank 0 a moment later (within the 2 s grace)
    raise ValueError(f"failure number {world - rank} on rank {rank}")


def test_every_ranks_failure_is_reported_the_first_failure_first():
    """Failures that follow the first within the grace period are reported too, in order of arrival:
    rank 1 (failed first) before rank 0, not sorted by rank."""
    with pytest.raises(RuntimeError) as info:
        run_workers(_both_ranks_raise_worker, 2, timeout=30)
    message = str(info.value)
    assert "failure number 1 on rank 1" in message
    assert "failure number 2 on rank 0" in message
    assert message.index("rank 1 of 2 failed:") < message.index("rank 0 of 2 failed:")


def _exit_worker(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_a_dead_rank_is_named_with_its_exit_code():
    """A rank that exits without reporting (``os._exit(3)``) is a RuntimeError naming the rank and its code."""
    with pytest.raises(RuntimeError, match=r"^rank 1 died with exit code 3$"):
        run_workers(_exit_worker, 2, timeout=30)


def _killed_worker(rank: int, world: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_a_rank_killed_by_a_signal_is_reported_at_once_not_at_the_deadline():
    """A signal gives a negative exit code (-9 for SIGKILL): still a death, reported long before the timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 1 died with exit code -9$"):
        run_workers(_killed_worker, 2, timeout=30)
    assert time.monotonic() - start < 20


def _hang_worker(rank: int, world: int, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 0:
        time.sleep(300)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_deadline_is_timeout_seconds_and_hanging_ranks_are_terminated(tmp_path: Path):
    """A rank that hangs makes run_workers raise TimeoutError after ``timeout`` seconds (not a multiple of
    it), and that rank's process is gone when run_workers returns (terminated, not left to sleep)."""
    timeout = 5.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within 5 s"):
        run_workers(_hang_worker, 2, str(tmp_path), timeout=timeout)
    elapsed = time.monotonic() - start
    pid = int((tmp_path / "rank0").read_text())
    alive = _alive(pid)
    if alive:  # leave no process behind, whatever the outcome
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the hanging rank was left running"
    assert timeout <= elapsed < timeout + 3.5


def _threads_worker(rank: int, world: int) -> int:
    return torch.get_num_threads()


def test_threads_sets_every_childs_torch_thread_count():
    """``threads=n`` is applied in every child, whatever the parent's thread count."""
    want = torch.get_num_threads() + 1
    assert run_workers(_threads_worker, 2, threads=want, timeout=30) == [want, want]


def _raise_while_the_peer_waits_worker(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(0.2)  # rank 0 is in the barrier by then
        raise ValueError("the cause, on rank 1")
    dist.barrier()


def test_the_cause_comes_first_when_a_peer_fails_on_the_lost_connection():
    """A rank that raises while its peer waits in a collective reports its error before it tears its
    process group down, so the peer's error about the lost connection (if it has time to report one)
    comes after the cause (it came first: the teardown reset the peer's connection before the cause
    was sent; found by the mutation review of launch.py)."""
    with pytest.raises(RuntimeError) as info:
        run_workers(_raise_while_the_peer_waits_worker, 2, timeout=30)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed:"), message[:300]
    assert "the cause, on rank 1" in message.split("rank 0 of 2 failed:")[0]
