"""What stages share besides activations, on gloo ranks: the last stage's logs along each pipeline (2 stages x 2
replicas), every stage's gradient-hook logs within its pipeline, and a gradient scaler's overflow flag over
every rank."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_autopart.lightning.hooks import LogRecord
from lightning_autopart.lightning.log_channel import LogChannel
from tests.distributed._channel_worker import TIMEOUT, gradient_logs, steps
from tests.distributed.launch import run_job

pytestmark = pytest.mark.distributed


def test_every_pipeline_rank_receives_its_last_stage_logs(tmp_path: Path) -> None:
    code, log = run_job(
        [str(Path(__file__).with_name("_channel_worker.py")), str(tmp_path)], 4, "torchrun", 90
    )
    assert code == 0, log[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert sorted(r["replica"] for r in results) == [0, 0, 1, 1]
    # the channel's group, the pipeline's and the replicas' (a DeviceMesh's), a tie's: the job's timeout, which
    # torch gives none of them by itself ([Note: a subgroup's timeout])
    assert [len(r["timeouts"]) for r in results] == [4] * 4
    assert all(t == TIMEOUT for r in results for t in r["timeouts"]), [r["timeouts"] for r in results]
    for rank, result in enumerate(results):
        expected = steps(result["replica"])
        assert len(result["got"]) == len(expected)
        for (kind, loss, records), (got_loss, got_records) in zip(expected, result["got"], strict=True):
            assert isinstance(got_loss, torch.Tensor) and got_loss.dim() == 0, f"rank {rank} {kind}"
            assert math.isnan(got_loss) if loss is None else float(got_loss) == loss, f"rank {rank} {kind}"
            _same_records(got_records, records, f"rank {rank} {kind}")
        # every stage's gradient-hook logs reach every rank of its pipeline ([Note: gradient hooks])
        assert len(result["gathered"]) == len(gradient_logs(0))
        for call, by_stage in enumerate(result["gathered"]):
            assert len(by_stage) == 2
            for stage, got_records in enumerate(by_stage):
                _same_records(got_records, gradient_logs(stage)[call], f"rank {rank}, call {call}, stage {stage}")


def _same_records(got_records: list[LogRecord], records: list[LogRecord], where: str) -> None:
    assert [(r.name, r.kwargs) for r in got_records] == [(r.name, r.kwargs) for r in records], where
    for want, got in zip(records, got_records, strict=True):
        assert type(got.value) is type(want.value), f"{where}: {want.name}"
        if isinstance(want.value, torch.Tensor):
            assert got.value.dtype == want.value.dtype and torch.equal(got.value, want.value), where
        else:
            assert got.value == want.value, where


def test_a_pipeline_of_one_stage_needs_no_messages() -> None:
    channel = LogChannel(None, 0, 0)
    records = [LogRecord("a", 1.0, {})]
    loss = torch.tensor(0.5)
    assert channel.share("training_step", loss, records) == (loss, records)
    nothing, same = channel.share("training_step", None, records)
    assert math.isnan(nothing) and same is records


def test_every_stage_agrees_on_a_gradient_overflow(tmp_path: Path) -> None:
    """One stage's fp16 gradients overflow: every rank skips the step and lowers its scale, as one process would."""
    code, log = run_job(
        [str(Path(__file__).with_name("_overflow_worker.py")), str(tmp_path)], 3, "torchrun", 90
    )
    assert code == 0, log[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert [r["before"] for r in results] == [[0.0], [1.0], [0.0]]
    assert all(r["after"] == [1.0] and r["scale"] == 2.0**7 for r in results)
