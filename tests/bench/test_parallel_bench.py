"""The expert-parallel benchmark (tiny sizes): local gloo workers, the CLI flag, and torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch.distributed as dist

from routelab import cli
from routelab.bench import moe_parallel

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

TINY = replace(moe_parallel.QUICK, d_model=16, d_hidden=32, experts=4, tokens_per_rank=24, warmup=1, repeats=1,
               timeout=60.0)


def _rows(text: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first}")]


def test_run_benchmark_tiny_world_sizes_1_and_2():
    text = moe_parallel.run_benchmark(world_sizes=(1, 2), config=TINY, deepspeed=False)
    assert "DeepSpeed absent (disabled)" in text
    for world in (1, 2):
        rows = _rows(text, str(world))
        modes = [r[1] for r in rows if r[1] in moe_parallel.MODES]
        assert modes == list(moe_parallel.MODES)
        for r in rows:
            if r[1] in moe_parallel.MODES:
                assert float(r[2].replace(",", "")) > 0  # routelab tokens/s
        check = [r for r in rows if r[1] not in moe_parallel.MODES][0]
        assert float(check[1]) < 1e-5  # routelab == single process on the global batch


def test_run_benchmark_rejects_world_sizes_that_do_not_divide_experts():
    with pytest.raises(ValueError, match="does not divide"):
        moe_parallel.run_benchmark(world_sizes=(3,), config=TINY, deepspeed=False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="positive integers"):
            moe_parallel.run_benchmark(world_sizes=(bad,), config=TINY, deepspeed=False)


def test_cli_world_size(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(moe_parallel, "QUICK", TINY)
    out = tmp_path / "table.md"
    assert cli.main(["bench", "moe", "--world-size", "2", "--quick", "--out", str(out)]) == 0
    assert "| 2 | dropless |" in out.read_text()
    assert cli.main(["bench", "assignment", "--world-size", "2"]) == 2
    assert "--world-size applies to `routelab bench moe` only" in capsys.readouterr().err


def test_torchrun_entry_point():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "routelab.bench.moe_parallel", "--quick", "--no-deepspeed", "--tokens-per-rank", "16",
           "--d-model", "16", "--d-hidden", "32", "--experts", "4", "--repeats", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchrun" in done.stdout and "| 2 | dropless |" in done.stdout


def test_header_names_the_gpu_under_nccl(monkeypatch):
    """Under NCCL the timings are GPU timings: the header names the GPU model (a review found it
    named the CPU only); under gloo it names none."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU 80GB")
    nccl = "\n".join(moe_parallel._header(TINY, False, (False, "disabled"), "nccl", "torchrun"))
    gloo = "\n".join(moe_parallel._header(TINY, False, (False, "disabled"), "gloo", "local workers"))
    machine = next(line for line in nccl.splitlines() if line.startswith("- machine:"))
    assert "NVIDIA Test GPU 80GB" in machine and "backend nccl" in machine
    assert "NVIDIA Test GPU" not in gloo
