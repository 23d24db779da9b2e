"""Planning under load ([Note: planning under load] in lightning_autopart/lightning/load.py): while rank 0
plans on CPUs, the other ranks of its machine compute; ranks elsewhere, and every rank without a measured
profile, only wait. Rank 1 follows rank 0's pipeline probes ([Note: pipeline probe])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed._load_worker import PLANNING_S
from tests.distributed.launch import run_job

pytestmark = [pytest.mark.distributed, pytest.mark.alone]  # deadlines or CPU load: run with nothing beside


def test_rank_zeros_machine_is_busy_while_it_plans(tmp_path: Path) -> None:
    code, log = run_job([str(Path(__file__).with_name("_load_worker.py")), str(tmp_path)], 3, "torchrun", 90)
    assert code == 0, log[-4000:]
    cpu = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    # Rank 1 shares rank 0's machine (2 ranks per machine): it computed for most of rank 0's planning.
    assert cpu[1]["loaded"] > 0.4 * PLANNING_S, cpu
    # Rank 2 is on another machine, and nobody loads without a measured profile.
    assert cpu[2]["loaded"] < 0.3 * PLANNING_S, cpu
    assert all(c["idle"] < 0.3 * PLANNING_S for c in cpu), cpu
    # Only rank 0, and only under load, holds the probe; rank 1 followed both of its probes (the probe's
    # messages need it), and each measured a finite, non-negative overhead per micro-batch.
    assert [c["loaded_probe"] for c in cpu] == [True, False, False] and not any(c["idle_probe"] for c in cpu)
    overheads = cpu[0]["overheads"]
    assert len(overheads) == 2 and all(0.0 <= o < 1e6 for o in overheads), overheads
