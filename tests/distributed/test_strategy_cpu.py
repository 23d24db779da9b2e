"""AutoPartitionStrategy on 1, 2 and 4 gloo CPU processes, launched as users do: equal to plain one-process Lightning."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_autopart.runtime.checkpoint import consolidate
from tests.census import StepProbe
from tests.distributed.launch import run_job, side_by_side
from tests.distributed.strategy_cases import STEPS, fit

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_strategy_script.py")
ROOT = Path(__file__).resolve().parents[2]

#: Launches: (launcher, processes, cases). Each case: model, stages (replicas = processes // stages), options.
LAUNCHES: list[tuple[str, int, list[dict[str, Any]]]] = [
    ("lightning", 1, [{"model": "mlp", "stages": 1}, {"model": "gpt", "stages": 1, "accumulate": 2}]),
    (
        "lightning",
        2,
        [
            {"model": "mlp", "stages": 2},
            {"model": "mlp", "stages": 1},
            {"model": "residual", "stages": 2, "schedule": "1F1B"},
            {"model": "gpt", "stages": 2},
            {"model": "cnn", "stages": 2},
            {"model": "two_inputs", "stages": 2},
            {"model": "residual", "stages": 2, "via_submodule": True},
            # a Python branch on self.training: validation runs the stages' evaluation-mode programs
            {"model": "mode_branch", "stages": 2, "accumulate": 2, "validate": True},
            {"model": "gpt", "stages": 2, "clip": 0.1},
            {"model": "mlp", "stages": 1, "accumulate": 2},
            {"model": "mlp", "stages": 2, "extra_logs": True, "validate": True},
            {"model": "loss", "stages": 2},
            {"model": "structured", "stages": 2, "schedule": "1F1B", "validate": True},
            {"model": "gpt", "stages": 2, "precision": "bf16-mixed", "validate": True},
            # bfloat16 weights and inputs: capture and planning see the precision plugin's converted batch
            {"model": "mlp", "stages": 2, "precision": "bf16-true"},
            # float16 weights and inputs on the CPU (issue 10): the pipeline and one process round alike
            {"model": "mlp", "stages": 2, "precision": "16-true"},
            # fp16 gradients overflow at first: every stage must skip the same steps as one process does
            {"model": "mlp", "stages": 2, "precision": "16-mixed", "scale": 2.0**40},
            # a custom autograd Function, a tensor hook and a backward hook: module hooks run them in the stages
            {"model": "gradient_tricks", "stages": 2},
            # custom autograd Functions among other operations: exported, each kept whole with its backward
            {"model": "kept_functions", "stages": 2},
            # a batch norm frozen in a forward: the stages must keep its eval() call
            {"model": "frozen_norm", "stages": 2},
            # a loss summed over samples: the micro-batches' losses are added, not averaged
            {"model": "mlp", "stages": 2, "schedule": "1F1B", "reduction": "sum", "lr": 0.002},
        ],
    ),
    ("torchrun", 2, [{"model": "mlp", "stages": 2, "schedule": "1F1B"}, {"model": "gpt", "stages": 1}]),
    (
        "torchrun",
        4,
        [
            {"model": "mlp", "stages": 4},
            {"model": "mlp", "stages": 2},
            {"model": "gpt", "stages": 2, "schedule": "1F1B"},
            {"model": "residual", "stages": 4, "micro_batches": 4},
            {"model": "gpt", "stages": 2, "accumulate": 2, "extra_logs": True},
            {"model": "loss", "stages": 2, "schedule": "1F1B"},
            # training_step returns a dict: on_train_batch_end sees it merged, on the first stage's ranks too
            {"model": "mlp", "stages": 2, "outputs": True},
        ],
    ),
]
CASES = [(launch, case) for launch, (_, _, cases) in enumerate(LAUNCHES) for case in cases]


def launch(
    how: str, world: int, cases: list[dict[str, Any]], out: Path, timeout: float = 120.0
) -> tuple[int, str]:
    """Run the script on ``world`` processes (Lightning's launcher or torchrun); kill them all on timeout."""
    (out / "cases.json").write_text(json.dumps(cases))
    return run_job([str(SCRIPT), str(out / "cases.json"), str(out), str(world)], world, how, timeout)


def _launched(index: int, out: Path) -> dict[Any, Any]:
    """Launch ``LAUNCHES[index]`` into ``out``: its results by rank, and ``out`` under "dir"."""
    how, world, cases = LAUNCHES[index]
    code, log = launch(how, world, cases, out, timeout=240.0)
    assert code == 0, f"{how} on {world} processes failed ({code}):\n{log[-5000:]}"
    result: dict[Any, Any] = {r: torch.load(out / f"rank{r}.pt") for r in range(world)}
    result["dir"] = out
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    """Every launch's results by rank, and its output folder under "dir" (two launches at a time)."""
    longest = max(range(len(LAUNCHES)), key=lambda i: len(LAUNCHES[i][2]) * LAUNCHES[i][1])
    outs = [tmp_path_factory.mktemp(f"launch{i}") for i in range(len(LAUNCHES))]
    return side_by_side([partial(_launched, i, out) for i, out in enumerate(outs)], longest)


def _case_id(index: int) -> str:
    launch_index, case = CASES[index]
    how, world, _ = LAUNCHES[launch_index]
    sub = "-submodule" if case.get("via_submodule") else ""
    keys = ("accumulate", "clip", "validate", "extra_logs", "schedule", "reduction", "outputs")
    options = "".join(f"-{k}" for k in keys if k in case) + (f"-{case['precision']}" if "precision" in case else "")
    return f"{how}{world}-{case['model']}{sub}-{case['stages']}x{world // case['stages']}{options}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=_case_id)
def test_strategy_equals_single_process(runs: list[dict[Any, Any]], index: int, tmp_path: Path) -> None:
    launch_index, case = CASES[index]
    _, world, cases = LAUNCHES[launch_index]
    position = cases.index(case)
    replicas = world // case["stages"]
    probe = StepProbe(1, STEPS)
    model, expected_losses, expected_metrics = fit({**case, "ckpt_dir": str(tmp_path)}, "auto", 1, replicas, probe)
    expected = dict(model.named_parameters())
    seen: set[str] = set()
    # bfloat16 (8-bit mantissa) and float16 (11-bit) matmuls over micro-batches round differently from one over
    # the whole batch
    precision = str(case.get("precision"))
    tolerance = 2e-2 if precision.startswith("bf16") else 5e-3 if precision == "16-true" else 1e-5
    for rank, results in runs[launch_index].items():
        if rank == "dir":
            continue
        got = results[position]
        assert got["plan_stages"] == case["stages"]
        # A rank keeps only its own stage's weights: every other parameter was freed (left on the meta device).
        assert all(d == "meta" for d in got["held_elsewhere"].values()), f"rank {rank}: {got['held_elsewhere']}"
        # Validation built an evaluation schedule and dropped it with its receive buffers when the loop ended.
        assert got["schedules"] == (["train"] if case["stages"] > 1 else []), f"rank {rank}: {got['schedules']}"
        assert set(got["params"]) | set(got["held_elsewhere"]) == set(expected)
        accumulate = case.get("accumulate", 1)  # the gradients are all-reduced once per optimizer step
        assert got["syncs"] == [i % accumulate == accumulate - 1 for i in range(STEPS * accumulate)]
        # No host sync plain Lightning does not do, on any stage, in a steady step: by batch 2 every case has logged
        # each of its layouts once (a new log name is sent pickled, once).
        assert got["host_syncs"][-1] <= probe.syncs[-1], f"rank {rank}: {got['host_syncs']} vs {probe.syncs}"
        assert got["losses"] == pytest.approx(expected_losses, rel=tolerance), f"rank {rank}: loss curve differs"
        assert got["metrics"] == pytest.approx(expected_metrics, rel=tolerance), f"rank {rank}: metrics differ"
        for name, value in got["params"].items():
            ref = expected[name].detach()
            error = ((value - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert error < tolerance, f"rank {rank}: {name} differs (relative error {error:.2e})"
            seen.add(name)
    assert seen == set(expected), f"parameters held by no rank: {sorted(set(expected) - seen)}"
    if case.get("validate"):  # ModelCheckpoint(monitor="val_loss") wrote every stage, sharded by name
        (path,) = (runs[launch_index]["dir"] / f"ckpt{position}").glob("*.ckpt")
        consolidate(path, tmp_path / "whole.ckpt")
        saved = torch.load(tmp_path / "whole.ckpt", weights_only=True)["state_dict"]
        for name, ref in expected.items():
            torch.testing.assert_close(saved[name], ref.detach(), rtol=tolerance, atol=max(1e-7, tolerance**2), msg=name)


def test_a_failing_rank_stops_every_rank(tmp_path: Path) -> None:
    """The last rank raises in its training step: the launch ends with an error, nothing hangs or lingers."""
    start = time.monotonic()
    code, log = launch("lightning", 2, [{"model": "mlp", "stages": 2, "fail_at": 1}], tmp_path, timeout=90)
    assert code not in (0, -9), f"expected an error exit, got {code}:\n{log[-3000:]}"
    assert "injected failure on rank 1" in log
    assert time.monotonic() - start < 90
