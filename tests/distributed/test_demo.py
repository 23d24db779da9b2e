"""The README's demo: examples/tutorial.py trained with strategy="autopart" on 2 CPU processes, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.parametrize("extra", [[], ["--device-memory", "12MB"]], ids=["planner-decides", "small-memory"])
def test_tutorial_demo_trains_with_autopart_on_two_processes(extra: list[str]) -> None:
    # Lightning's own launcher starts the second process; the model summary (on by default) must not try to run
    # the whole model on a rank that holds one stage (regression: it crashed with "mat2 must be a matrix").
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, "-m", "examples.tutorial", "--max-steps", "6", "--hidden", "256", *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Plan for Net" in out and "Step time" in out
    assert "samples/s" in out
    assert "final train_loss=" in out
    if extra:
        # 10.8 MB usable cannot hold 0.66M parameters with gradients and Adam state (10.5 MB) plus activations.
        assert "2 stages × 1 replica" in out
