"""The README's demo: examples/tutorial.py trained with strategy="autopart" on 2 CPU processes, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.utilities.model_summary import ModelSummary

ROOT = Path(__file__).resolve().parents[2]


def _demo(extra: list[str]) -> str:
    """The output of one run of the tutorial (Lightning's own launcher starts the second process)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, "-m", "examples.tutorial", "--max-steps", "6", "--hidden", "256", *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("extra", [[], ["--device-memory", "12MB"]], ids=["planner-decides", "small-memory"])
def test_tutorial_demo_trains_with_autopart_on_two_processes(extra: list[str]) -> None:
    # The model summary (on by default) must not try to run the whole model on a rank that holds one stage
    # (regression: it crashed with "mat2 must be a matrix").
    out = _demo(extra)
    assert "Plan for Net" in out and "Step time" in out
    assert "samples/s" in out
    assert "final train_loss=" in out
    # The summary counts the whole model, not rank 0's stage, and its FLOPs (2 samples x 10 layers x 2 x 256^2).
    assert "#Parameters=657920" in out
    assert re.search(r"Total params:?\s+657 K|657 K\s+Total params", out), out[-3000:]
    if hasattr(ModelSummary, "total_flops"):  # Lightning 2.6 on; 2.5's summary counts no FLOPs
        assert re.search(r"Total (FLOPs|Flops):?\s+2\.6 M|2\.6 M\s+Total Flops", out), out[-3000:]
    assert not re.search(r"Total (FLOPs|Flops):?\s+0\b", out)
    # Predicted and measured throughput side by side, and why they differ.
    found = re.search(r"throughput: predicted ([\d,]+) samples/s \(plan, measure on cpu\), measured ([\d,]+)", out)
    assert found is not None, out[-3000:]
    assert "why they differ: the plan prices compute" in out
    if extra:
        # 10.8 MB usable cannot hold 0.66M parameters with gradients and Adam state (10.5 MB) plus activations.
        assert "2 stages × 1 replica" in out
        # Seeded (weights and data order): another run ends at the same loss.
        again = _demo(extra)
        assert re.findall(r"final train_loss=\S+", again) == re.findall(r"final train_loss=\S+", out)
