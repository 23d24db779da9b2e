"""``AutoPartitionStrategy()`` with the planner's own choices on 2 gloo processes: equal to one-process Lightning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Subset

from tests.distributed.launch import TIMED_OUT, run_job
from tests.distributed.strategy_cases import LOCAL_BATCH, STEPS, dataset, global_order, make_lit

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_auto_plan_script.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
SAMPLES = LOCAL_BATCH * 2 * STEPS  # as in the script


def _launch(out: Path, mode: str, timeout: float = 90.0) -> str:
    """Run the script on WORLD processes through Lightning's launcher."""
    code, text = run_job([str(SCRIPT), str(out), str(WORLD), mode], WORLD, "lightning", timeout)
    if code == TIMED_OUT:
        pytest.fail(f"{mode} run timed out after {timeout} s:\n{text[-4000:]}")
    assert code == 0, f"{mode} run failed ({code}):\n{text[-5000:]}"
    return text


def _reference(replicas: int) -> dict[str, torch.Tensor]:
    """One process, the same global batches: shard k of every replica's DistributedSampler, in one batch."""
    model = make_lit({"model": "mlp"})
    data = Subset(dataset("mlp", SAMPLES), global_order(SAMPLES, replicas))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=LOCAL_BATCH * replicas))
    return {n: p.detach() for n, p in model.named_parameters()}


def _check_equal(results: list[dict[str, Any]], expected: dict[str, torch.Tensor]) -> None:
    seen: set[str] = set()
    for rank, result in enumerate(results):
        for name, value in result["params"].items():
            ref = expected[name]
            error = ((value - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert error < 1e-5, f"rank {rank}: {name} differs (relative error {error:.2e})"
            seen.add(name)
    assert seen == set(expected), f"parameters held by no rank: {sorted(set(expected) - seen)}"


def test_planner_decides_and_a_saved_plan_reloads(tmp_path: Path) -> None:
    log = _launch(tmp_path, "save")
    assert "Stages (ms per " in log and "Replicas × ranks" in log, f"no stage table:\n{log}"
    assert "Profile      measure" in log, "the strategy should profile by measuring by default"
    assert (tmp_path / "plan.json").is_file()
    saved = [torch.load(tmp_path / f"save_rank{r}.pt") for r in range(WORLD)]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert all(json.loads(s["plan"]) == plan for s in saved), "ranks ran different plans"
    expected = _reference(saved[0]["replicas"])
    _check_equal(saved, expected)

    log = _launch(tmp_path, "load")
    assert "Stages (ms per " in log
    loaded = [torch.load(tmp_path / f"load_rank{r}.pt") for r in range(WORLD)]
    assert all(json.loads(r["plan"]) == plan for r in loaded), "the loaded run did not use the saved plan"
    _check_equal(loaded, expected)
    for a, b in zip(saved, loaded, strict=True):
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=0, atol=0, msg=name)
