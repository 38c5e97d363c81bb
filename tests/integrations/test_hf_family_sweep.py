"""tools/hf_family_sweep.py: patch_moe over transformers' MoE families, in this process.

The sweep itself (every family of the installed transformers, each in a subprocess) is a tool run
by hand (README, "Hugging Face transformers"); these tests run its per-family check on one family
of each outcome, so the tool keeps working and its verdicts stay right: Mixtral reproduces the
unpatched model, PhiMoE's own rule is replaced with a warning, JetMoE (no ``experts`` child) is
refused naming its modules.
"""

from __future__ import annotations

import pytest
import transformers as tf

from tool_modules import load_tool

sweep = load_tool("hf_family_sweep")


@pytest.mark.parametrize(("family", "model", "outcome"), [
    ("mixtral", "MixtralForCausalLM", "equal"),
    ("phimoe", "PhimoeForCausalLM", "warned"),
    ("jetmoe", "JetMoeForCausalLM", "refused"),
])
def test_one_family_of_each_outcome(family: str, model: str, outcome: str) -> None:
    if not hasattr(tf, model):
        pytest.skip(f"transformers {tf.__version__} has no {model}")
    result = sweep.run_family(family)
    assert result["outcome"].startswith(outcome), result["outcome"]
    if outcome == "equal":
        assert result["sensitivity"] > 0.1  # the output depends on the routing: equality means something
        assert result["padding"].startswith("equal") and result["backward"].startswith("ok")
        assert result["other"].startswith("ok")
    if outcome == "refused":
        assert "JetMoeMoE" in result["outcome"]
