"""A NaN training loss on 2 processes stops every rank at the same step with the same message, naming the first
bad batch, the last stage and the rank that computed it: a pipeline's two stages, and two replicas of which only
one sees the NaN (the ranks agree with one all-reduce at the check)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.distributed._bad_inputs_script import NAN_FROM, STEPS
from tests.distributed.launch import run_job

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_bad_inputs_script.py")


@pytest.mark.parametrize(
    ("stages", "nan_rank", "named"),
    [(2, 1, "(stage 1, on rank 1)"), (1, 1, "(stage 0, on rank 1)"), (1, 0, "(stage 0, on rank 0)")],
)
def test_a_nan_loss_stops_every_rank_together(tmp_path: Path, stages: int, nan_rank: int, named: str) -> None:
    start = time.monotonic()
    code, log = run_job([str(SCRIPT), str(tmp_path), str(stages), str(nan_rank)], 2, "torchrun", 180)
    elapsed = time.monotonic() - start
    assert code != 0 and elapsed < 120, f"exit {code} after {elapsed:.0f} s:\n{log[-4000:]}"
    for rank in range(2):  # each rank wrote its own NonFiniteLossError and exited with RAISED
        path = tmp_path / f"rank{rank}.txt"
        assert path.exists(), f"rank {rank} did not raise NonFiniteLossError:\n{log[-4000:]}"
        step, message = path.read_text().split("\n", 1)
        assert int(step) == STEPS  # read when training ends (log_every_n_steps is 50): both ranks alike
        assert message.startswith(
            f"the training loss was NaN or infinite at epoch 0, batch {NAN_FROM} (global step {NAN_FROM}), as "
            f"computed by the last stage {named}"
        ), message
