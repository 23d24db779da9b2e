"""Around fit, as a Lightning user works: loops after fit and on fresh Trainers, checkpoints by name, resumes under
other plans and across strategies; each equal to one plain process on the same data (2, 4 and 1 gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_autopart.runtime.checkpoint import consolidate
from tests.distributed.launch import run_job
from tests.distributed.lifecycle_cases import EPOCH, TOTAL_STEPS, LifecycleLit, run_action

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_lifecycle_script.py")

#: (launcher, processes, actions); later launches read the checkpoints of earlier ones.
LAUNCHES: list[tuple[str, int, list[dict[str, Any]]]] = [
    (
        "lightning",
        2,
        [
            {"do": "fit", "stages": 2, "steps": EPOCH, "save": "A.ckpt"},
            {"do": "validate", "same": True},
            {"do": "test", "same": True},
            {"do": "predict", "same": True},
            {"do": "validate", "stages": 2, "ckpt": "A.ckpt"},  # a fresh Trainer plans from the val batch
            {"do": "predict", "stages": 2, "ckpt": "A.ckpt"},
            {"do": "fit", "stages": 2, "ckpt": "A.ckpt"},  # resume, same plan
            {"do": "fit", "stages": 1, "replicas": 2, "ckpt": "A.ckpt"},  # 2 stages -> 2 replicas
            {"do": "fit", "stages": 2, "steps": EPOCH, "checkpoint": "full", "save": "F.ckpt"},
            {"do": "fit", "plain": True, "replicas": 2, "ckpt": "F.ckpt"},  # autopart -> plain DDP
            {"do": "fit", "plain": True, "replicas": 2, "steps": EPOCH, "save": "P.ckpt"},
            {"do": "fit", "stages": 2, "ckpt": "P.ckpt"},  # plain DDP -> autopart
        ],
    ),
    (
        "torchrun",
        4,
        [
            {"do": "fit", "stages": 4, "ckpt": "A.ckpt"},  # 2 stages -> 4
            {"do": "fit", "stages": 2, "replicas": 2, "ckpt": "A.ckpt"},  # -> 2 x 2
        ],
    ),
    ("lightning", 1, [{"do": "fit", "stages": 1, "ckpt": "A.ckpt"}]),  # -> one process
]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[int, Any]]]:
    """Every launch's results by rank (one output folder: later launches read earlier checkpoints)."""
    out = tmp_path_factory.mktemp("lifecycle")
    results = []
    for i, (how, world, actions) in enumerate(LAUNCHES):
        (out / f"actions{i}.json").write_text(json.dumps(actions))
        code, log = run_job([str(SCRIPT), str(out / f"actions{i}.json"), str(out), str(world)], world, how, 180)
        assert code == 0, f"launch {i} ({how}, {world}) failed ({code}):\n{log[-5000:]}"
        results.append({r: torch.load(out / f"rank{r}.pt") for r in range(world)})
        for r in range(world):
            (out / f"rank{r}.pt").unlink()
    return out, results


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One plain process: the uninterrupted runs' losses (the replicas of each epoch's run: Lightning's sampler
    shards and shuffles by them), and the loops after the first epoch."""
    out = tmp_path_factory.mktemp("reference")
    curves = {tuple(order): run_action({"do": "fit", "order": order}, out, "auto", 1)["losses"] for order in
              ([1, 1], [1, 2], [2, 1])}  # fmt: skip
    first = run_action({"do": "fit", "steps": EPOCH, "save": "ref.ckpt"}, out, "auto", 1)
    assert first["losses"] == curves[(1, 1)][:EPOCH]
    model = run_action({"do": "validate", "same": True}, out, "auto", 1)
    test = run_action({"do": "test", "same": True}, out, "auto", 1)
    predicted = run_action({"do": "predict", "same": True}, out, "auto", 1)
    params = {n: p.detach().clone() for n, p in torch.load(out / "ref.ckpt", weights_only=False)["state_dict"].items()}
    return {"losses": curves, "first": first["losses"], "val": model["metrics"], "test": test["metrics"],
            "predictions": predicted["predictions"], "params": params}  # fmt: skip


def _every_rank(results: dict[int, Any], index: int) -> list[dict[str, Any]]:
    return [results[r][index] for r in sorted(results)]


def test_fit_then_every_loop_equals_one_process(job: Any, reference: dict[str, Any]) -> None:
    _, (first, *_) = job
    for got in _every_rank(first, 0):
        assert got["losses"] == pytest.approx(reference["first"], rel=1e-5)
    for index, name in ((1, "val"), (2, "test"), (4, "val")):
        for got in _every_rank(first, index):
            assert got["metrics"] == pytest.approx(reference[name], rel=1e-5), f"action {index}"
    for index in (3, 5):  # predict returns the predictions, in order, on every rank of the pipeline
        for got in _every_rank(first, index):
            torch.testing.assert_close(got["predictions"], reference["predictions"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("launch", "index", "order"),
    [(0, 6, (1, 1)), (0, 7, (1, 2)), (0, 9, (1, 2)), (0, 11, (2, 1)), (1, 0, (1, 1)), (1, 1, (1, 2)), (2, 0, (1, 1))],
    ids=["2to2", "2to1x2", "autopart-to-ddp", "ddp-to-autopart", "2to4", "2to2x2", "2to1"],
)
def test_resume_continues_the_uninterrupted_loss_curve(
    job: Any, reference: dict[str, Any], launch: int, index: int, order: tuple[int, int]
) -> None:
    """Model, Adam state, scheduler and loops restored, whatever plan or strategy wrote the checkpoint."""
    _, results = job
    for got in _every_rank(results[launch], index):
        assert len(got["losses"]) == TOTAL_STEPS - EPOCH
        assert got["losses"] == pytest.approx(reference["losses"][order][EPOCH:], rel=1e-5)


@pytest.mark.parametrize("tool", ["autopart", "lightning"])
def test_sharded_checkpoint_consolidates_into_a_file_plain_lightning_loads(
    job: Any, reference: dict[str, Any], tool: str, tmp_path: Path
) -> None:
    out, _ = job
    whole = tmp_path / "whole.ckpt"
    assert (out / "A.ckpt").is_dir() and not list(out.glob(".*partial"))
    if tool == "autopart":
        consolidate(out / "A.ckpt", whole)
    else:
        command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(out / "A.ckpt")]
        subprocess.run([*command, "--output_file", str(whole)], check=True, capture_output=True, timeout=120)
    model = LifecycleLit.load_from_checkpoint(whole, weights_only=False)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-7, msg=name)
    saved = torch.load(whole, weights_only=False)
    assert saved["global_step"] == EPOCH and len(saved["optimizer_states"]) == 1
    # Optimizer state by name, every parameter in the configured order: a plain Adam over the model loads it.
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(saved["optimizer_states"][0])
    assert len(optimizer.state) == len(list(model.parameters()))
