"""Every ```python block of README.md runs verbatim, so the README's examples cannot rot.

Each block runs on its own, in a fresh namespace (a reader copies one block, not the page):
every block must define or import everything it uses. A block whose first line names a script
(``# train.py — every rank runs it``) is written to that file and run as the README says to run
it, here with ``torchrun --standalone --nproc_per_node=1`` (one gloo process). A block that
imports ``transformers`` is skipped when transformers is not installed (``make test`` installs it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SCRIPT = re.compile(r"^# (\w+\.py)\b")


def blocks() -> list[tuple[int, str]]:
    """``(line number, code)`` of every python block of the README, in order."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_readme_has_its_examples():
    found = blocks()
    assert len(found) >= 7
    assert any("patch_moe" in code for _, code in found)  # "Use with Hugging Face transformers"
    assert "## Use with Hugging Face transformers" in README.read_text(encoding="utf-8")


@pytest.mark.parametrize("line, code", blocks(), ids=[f"README.md:{line}" for line, _ in blocks()])
def test_readme_block_runs(line, code, tmp_path, monkeypatch, capsys):
    if "transformers" in code and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install routelab[hf])")
    script = SCRIPT.match(code)
    if script:
        path = tmp_path / script.group(1)
        path.write_text(code, encoding="utf-8")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                               str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README.md:{line} ({path.name}) failed:\n{done.stdout}\n{done.stderr}"
        return
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})  # noqa: S102
