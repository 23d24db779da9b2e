"""Ragged last batches (``drop_last=False``) under autopart equal one plain process (2 stages x 1 replica) and
plain DDP (2 stages x 2 replicas): losses, logged step and epoch means, validation, predictions and final
weights; a model normalising over the batch (BatchNorm) is refused before training."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed._ragged_script import EPOCHS, run_case
from tests.distributed.launch import run_job, side_by_side

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_ragged_script.py")

#: 22 training samples in batches of 8 (8, 8, 6 per epoch) and 13 validation samples (8, 5).
ONE_REPLICA = {"train": 22, "val": 13}
#: Over 2 replicas Lightning's DistributedSampler pads 21 samples to 11 per replica (8, 3), 13 to 7 (7).
TWO_REPLICAS = {"train": 21, "val": 13}

#: (launcher, processes, cases).
LAUNCHES: list[tuple[str, int, list[dict[str, Any]]]] = [
    (
        "lightning",
        2,
        [
            {
                **ONE_REPLICA,
                "stages": 2,
                "micro_batches": 2,
                "schedule": "GPipe",
            },  # micro-batches of 4: 4 + 2
            # micro-batches of 2: the last batch's fourth has no real sample (5: 2 + 2 + 1 + 0 in validation)
            {**ONE_REPLICA, "stages": 2, "micro_batches": 4, "schedule": "1F1B"},
            {**ONE_REPLICA, "stages": 2, "micro_batches": 2, "batch_norm": True},
        ],
    ),
    ("torchrun", 4, [{**TWO_REPLICAS, "stages": 2, "micro_batches": 2}]),
    ("lightning", 2, [{**TWO_REPLICAS, "plain": True}]),  # plain DDP on the same data
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, Any]]:
    """Every launch's results by rank (two launches at a time)."""

    def launch(i: int, out: Path) -> dict[int, Any]:
        how, world, cases = LAUNCHES[i]
        (out / "cases.json").write_text(json.dumps(cases))
        code, log = run_job([str(SCRIPT), str(out / "cases.json"), str(out), str(world)], world, how, 300)
        assert code == 0, f"launch {i} ({how}, {world}) failed ({code}):\n{log[-5000:]}"
        return {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)}

    outs = [tmp_path_factory.mktemp(f"ragged{i}") for i in range(len(LAUNCHES))]
    return side_by_side([partial(launch, i, out) for i, out in enumerate(outs)])


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One plain process on the same data and seed."""
    return run_case(ONE_REPLICA, "auto", 1)


def _assert_equal(got: dict[str, Any], expected: dict[str, Any], where: str, batches: int) -> None:
    steps = EPOCHS * batches  # per epoch, the last batch is ragged
    assert len(got["losses"]) == len(expected["losses"]) == steps, where
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"{where}: losses"
    assert got["logged"] == pytest.approx(expected["logged"], rel=1e-5), f"{where}: logged step values"
    assert len(got["epochs"]) == EPOCHS, where
    for epoch, (mine, theirs) in enumerate(zip(got["epochs"], expected["epochs"], strict=True)):
        assert set(mine) == set(theirs), f"{where}: epoch {epoch} names"
        assert mine == pytest.approx(theirs, rel=1e-5), f"{where}: epoch {epoch} metrics"
    assert got["validate"] == pytest.approx(expected["validate"], rel=1e-5), f"{where}: validate"
    torch.testing.assert_close(got["predictions"], expected["predictions"], rtol=1e-5, atol=1e-6)


def _assert_weights(
    results: dict[int, Any], index: int, expected: dict[str, torch.Tensor], ranks: list[int]
) -> None:
    seen = set()
    for rank in ranks:
        for name, value in results[rank][index]["params"].items():
            torch.testing.assert_close(
                value, expected[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
            )
            seen.add(name)
    assert seen == set(expected), f"parameters held by no rank: {sorted(set(expected) - seen)}"


@pytest.mark.parametrize("index", [0, 1], ids=["2x1-micro2-GPipe", "2x1-micro4-1F1B"])
def test_ragged_batches_equal_one_process(
    runs: list[dict[int, Any]], reference: dict[str, Any], index: int
) -> None:
    """The last batch of each epoch holds 6 of 8 samples, the last validation batch 5: nothing is dropped or
    counted twice, and the gradient is the mean over the real samples."""
    results = runs[0]
    for rank in results:
        got = results[rank][index]
        assert "error" not in got, got.get("error")
        _assert_equal(got, reference, f"rank {rank}", 3)
        assert len(got["predictions"]) == ONE_REPLICA["val"]
    _assert_weights(results, index, reference["params"], list(results))


def test_ragged_batches_over_replicas_equal_plain_ddp(runs: list[dict[int, Any]]) -> None:
    """2 stages x 2 replicas against Lightning's DDP on 2 processes: each replica's shard (padded by the
    sampler) ends in a batch of 3 samples; the gradient is averaged over the replicas as DDP averages it."""
    autopart, ddp = runs[1], runs[2]
    for rank, results in autopart.items():
        got = results[0]
        assert "error" not in got, got.get("error")
        expected = ddp[got["replica"]][0]
        _assert_equal(got, expected, f"rank {rank} (replica {got['replica']})", 2)
    _assert_weights(autopart, 0, ddp[0][0]["params"], list(autopart))
    torch.testing.assert_close(ddp[0][0]["params"], ddp[1][0]["params"])


def test_batch_norm_with_a_ragged_train_loader_is_refused_before_training(runs: list[dict[int, Any]]) -> None:
    for rank, results in runs[0].items():
        got = results[2]
        assert got.get("steps") == 0, f"rank {rank}: {got}"
        assert "train loader's last batch per replica holds 6 samples, not 8" in got["error"]
        assert "model.1 of the pipelined model normalise(s) over the batch" in got["error"]
        assert "drop_last=True" in got["error"] and "multiple of 8" in got["error"]
