"""torchmetrics metrics and Lightning's callbacks under AutoPartitionStrategy give the values of one process.

Two launches of ``_metrics_script.py`` (2 stages x 1 replica with Lightning's launcher, 2 stages x 2 replicas
under torchrun) fit a classifier that logs metric objects in its training and validation steps, computes one
metric in ``on_train_epoch_end``, logs ``sync_dist`` losses, and runs LearningRateMonitor (StepLR),
CSVLogger, ModelCheckpoint(monitor="val_acc") and EarlyStopping(monitor="val_acc"); each rank's view is
compared with the same fit on one process. The refusals run in-process.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.hooks import LogRecord, capture_logs, merge_logs
from lightning_autopart.lightning.log_channel import LogChannel
from lightning_autopart.lightning.step_loss import step_loss
from tests.distributed._metrics_script import fit_case
from tests.distributed.launch import run_job

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_metrics_script.py")
#: Launches: (launcher, processes); each fits one 2-stage case (replicas = processes // 2).
LAUNCHES = [("lightning", 2), ("torchrun", 4)]
#: Step values of metric objects: a replica's own batch (torchmetrics' forward is local, as under DDP).
LOCAL_STEP_VALUES = {"train_acc_step", "train_mse_step", "train_acc", "train_mse"}
#: A maximum over ``self.parameters()`` in ``on_after_backward``: one stage's under autopart, logged per stage.
PER_STAGE = {"grad_max", "grad_max/stage_0", "grad_max/stage_1"}


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def _differences(got: dict[str, float], want: dict[str, float], skip: set[str]) -> dict[str, Any]:
    keys = (set(got) | set(want)) - skip
    return {
        k: (got.get(k), want.get(k)) for k in sorted(keys) if k not in want or not _close(got.get(k), want[k])
    }


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module", params=LAUNCHES, ids=[f"{how}{world}" for how, world in LAUNCHES])
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch's results by rank, rank 0's CSV rows, and the one-process reference."""
    how, world = request.param
    out = tmp_path_factory.mktemp(f"{how}{world}")
    (out / "cases.json").write_text(json.dumps([{"stages": 2}]))
    code, log = run_job([str(SCRIPT), str(out / "cases.json"), str(out), str(world)], world, how, 150)
    assert code == 0, f"{how} on {world} processes failed ({code}):\n{log[-5000:]}"
    ranks = {r: torch.load(out / f"rank{r}.pt", weights_only=False)[0] for r in range(world)}
    ref_dir = tmp_path_factory.mktemp(f"reference{world}")
    reference = fit_case({"stages": 2}, "auto", 1, world // 2, ref_dir)
    return {
        "replicas": world // 2,
        "ranks": ranks,
        "csv": _csv(out / "case0" / "csv" / "version_0" / "metrics.csv"),
        "reference": reference,
        "reference_csv": _csv(ref_dir / "csv" / "version_0" / "metrics.csv"),
    }


def test_logged_values_equal_one_process(launched: dict[str, Any]) -> None:
    """Metric objects (step and epoch values), a metric computed at epoch end and sync_dist losses, seen by every
    rank after each training batch and each validation, and at the end."""
    ref = launched["reference"]
    local = (LOCAL_STEP_VALUES if launched["replicas"] > 1 else set()) | PER_STAGE
    assert {"train_acc_epoch", "train_mse_epoch", "train_mean", "epoch_mean", "val_acc", "val_auroc"} <= set(
        ref["final"]
    )
    assert {"grad_2.0_norm_total", "grad_2.0_norm/model.4.weight", "lr_seen"} <= set(ref["final"])
    for rank, got in launched["ranks"].items():
        assert len(got["steps"]) == len(ref["steps"]) and len(got["validations"]) == len(ref["validations"])
        for i, (seen, want) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
            assert not _differences(seen, want, local), (
                f"rank {rank}, batch {i}: {_differences(seen, want, local)}"
            )
        for i, (seen, want) in enumerate(zip(got["validations"], ref["validations"], strict=True)):
            assert not _differences(seen, want, local), (
                f"rank {rank}, epoch {i}: {_differences(seen, want, local)}"
            )
        assert not _differences(got["final"], ref["final"], local), f"rank {rank}"
        assert all(math.isfinite(v) for v in got["final"].values()), f"rank {rank}: {got['final']}"


def test_gradient_hooks_log_the_whole_models_values(launched: dict[str, Any]) -> None:
    """What on_after_backward and on_before_optimizer_step log, gathered from both stages: grad_norm's
    per-parameter norms and total equal one process's (checked with the other values above), and a maximum over
    each stage's parameters is logged per stage, the larger being the whole model's."""
    ref = launched["reference"]
    for rank, got in launched["ranks"].items():
        for i, (seen, want) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
            assert "grad_max" not in seen and "grad_max" in want, f"rank {rank}, batch {i}"
            assert _close(max(seen["grad_max/stage_0"], seen["grad_max/stage_1"]), want["grad_max"]), (
                f"rank {rank}, batch {i}: {seen['grad_max/stage_0']}, {seen['grad_max/stage_1']} vs {want['grad_max']}"
            )
    names = [k for k in launched["csv"][0] if k.startswith("grad_")]
    assert sorted(names) == sorted(
        [k for k in launched["reference_csv"][0] if k.startswith("grad_") and k != "grad_max"]
        + ["grad_max/stage_0", "grad_max/stage_1"]
    )


def test_step_values_agree_along_each_pipeline(launched: dict[str, Any]) -> None:
    """With replicas, a metric object's step value is its replica's batch value on both stages of the pipeline."""
    by_replica: dict[int, list[dict[str, Any]]] = {}
    for got in launched["ranks"].values():
        by_replica.setdefault(got["replica"], []).append(got)
    assert sorted(len(members) for members in by_replica.values()) == [2] * launched["replicas"]
    for members in by_replica.values():
        first, last = members
        assert first["steps"] == last["steps"]


def test_the_loss_code_runs_once_per_micro_batch_on_the_last_stage(launched: dict[str, Any]) -> None:
    """training_step (with its metric updates) runs on real micro-batches only: never on uninitialised tensors."""
    ref = launched["reference"]
    assert ref["updates"] == ref["global_step"]
    for rank, got in launched["ranks"].items():
        assert got["global_step"] == ref["global_step"]
        if got["last_stage"]:
            assert got["updates"] == 2 * ref["global_step"], f"rank {rank}: 2 micro-batches per step"
        elif rank != 0:  # rank 0 also runs the step while planning (on meta tensors, its metrics kept)
            assert got["updates"] == 0, f"rank {rank}"


def test_other_stages_add_no_host_sync(launched: dict[str, Any]) -> None:
    """The stages that mirror the last stage's metrics read nothing back from a device to do it; the last stage
    runs the user's step (and its metric updates) once per micro-batch, 2 here."""
    want = launched["reference"]["host_syncs"][-1]
    for rank, got in launched["ranks"].items():
        limit = 2 * want if got["last_stage"] else want
        assert got["host_syncs"][-1] <= limit, f"rank {rank}: {got['host_syncs']} vs {want}"


def test_callbacks_decide_as_one_process(launched: dict[str, Any]) -> None:
    """ModelCheckpoint keeps the same best step and score, EarlyStopping stops at the same epoch on every rank."""
    ref = launched["reference"]
    assert ref["stopped_epoch"] > 0 and ref["epochs"] < 6, "the reference should stop early"
    for rank, got in launched["ranks"].items():
        assert got["best"][0] == ref["best"][0] and _close(got["best"][1], ref["best"][1]), f"rank {rank}"
        assert (got["stopped_epoch"], got["epochs"]) == (ref["stopped_epoch"], ref["epochs"]), f"rank {rank}"


def test_csv_logger_writes_the_rows_of_one_process(launched: dict[str, Any]) -> None:
    """Rank 0's metrics.csv: same columns and rows (LearningRateMonitor's lr-SGD included) as one process's."""
    rows, want = launched["csv"], launched["reference_csv"]
    assert set(rows[0]) - PER_STAGE == set(want[0]) - PER_STAGE and "lr-SGD" in rows[0]
    assert len(rows) == len(want)
    local = LOCAL_STEP_VALUES if launched["replicas"] > 1 else set()
    for i, (row, ref) in enumerate(zip(rows, want, strict=True)):
        for key, value in ref.items():
            if key in PER_STAGE:
                assert (row["grad_max/stage_0"] == "") == (value == ""), f"row {i}, {key}"
            elif key in local:
                assert (row[key] == "") == (value == ""), f"row {i}, {key}"
            elif value == "" or row[key] == "":
                assert row[key] == value, f"row {i}, {key}: {row[key]!r} vs {value!r}"
            else:
                assert _close(float(row[key]), float(value)), f"row {i}, {key}: {row[key]} vs {value}"


# In-process: what the last stage records, and what is refused.


class _Module(nn.Module):
    """Stands for a LightningModule: metric attributes and a ``log`` method."""

    def __init__(self, **metrics: nn.Module) -> None:
        super().__init__()
        for name, metric in metrics.items():
            setattr(self, name, metric)
        self.logged: list[tuple[str, Any]] = []

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        self.logged.append((name, value))


class _MeanState(Metric):
    """A metric whose state is averaged across processes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("value", torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, x: torch.Tensor) -> None:
        if not torch.isfinite(x).all():
            raise ValueError("not finite")
        self.value = self.value + x.sum()

    def compute(self) -> torch.Tensor:
        return self.value


def test_a_step_value_covers_every_micro_batch_and_notes_list_states() -> None:
    module = _Module(
        acc=MulticlassAccuracy(num_classes=3, average="macro"), auroc=MulticlassAUROC(3, thresholds=None)
    )
    preds = torch.tensor([0, 1, 1, 2, 2, 0])
    target = torch.tensor([0, 1, 2, 2, 1, 1])
    records: list[LogRecord] = []
    for lo, hi in ((0, 3), (3, 6)):  # two micro-batches, each logging the metric object
        with capture_logs(module, records):
            module.acc(preds[lo:hi], target[lo:hi])
            module.auroc.update(torch.nn.functional.one_hot(preds[lo:hi], 3).float(), target[lo:hi])
            module.log("acc", module.acc, on_step=True)
    merged = merge_logs(records)
    whole = MulticlassAccuracy(num_classes=3, average="macro")(preds, target)
    (acc,) = [r for r in merged if r.states is None]
    assert acc.metric == "acc" and torch.equal(acc.value, whole)  # not the mean of the micro-batch values
    notes = {r.metric: r.states for r in merged if r.states is not None}
    assert notes == {"acc": (), "auroc": (("preds", torch.float32, (3,)), ("target", torch.int64, ()))}
    assert "forward" not in module.acc.__dict__ and module.acc._update_count == 2
    # A pipeline of one stage logs the metric object itself, its step value as the forward cache.
    _, logs = LogChannel(None, 0, 0).share("training_step", torch.tensor(1.0), merged, module)
    assert [r.name for r in logs] == ["acc"] and logs[0].value is module.acc
    assert torch.equal(module.acc._forward_cache, whole)
    # The next step's value starts over.
    records = []
    with capture_logs(module, records):
        module.acc(preds[:3], target[:3])
        module.log("acc", module.acc)
    (acc, _) = merge_logs(records)
    assert torch.equal(acc.value, MulticlassAccuracy(num_classes=3, average="macro")(preds[:3], target[:3]))


@pytest.mark.parametrize(
    ("metric", "call", "match"),
    [
        (_MeanState(), "log", "reduced across processes by mean"),
        (_MeanState(), "update", "reduced across processes by mean"),
        (MulticlassAccuracy(num_classes=3, sync_on_compute=False), "log", "sync_on_compute=False"),
        (MulticlassAccuracy(num_classes=3, dist_sync_on_step=True), "forward", "dist_sync_on_step=True"),
    ],
    ids=["mean-logged", "mean-updated", "no-sync-on-compute", "sync-on-step"],
)
def test_metrics_that_would_differ_across_stages_are_refused(metric: Metric, call: str, match: str) -> None:
    module = _Module(m=metric)
    with capture_logs(module, []), pytest.raises(ConfigError, match=match) as error:
        if call == "log":
            module.log("m", metric)
        elif call == "update":
            metric.update(torch.ones(2))
        else:
            metric(torch.tensor([0, 1]), torch.tensor([0, 1]))
    assert "sync_on_compute=False and log metric.compute()" in str(error.value)
    assert "forward" not in metric.__dict__


def test_a_logged_metric_must_be_an_attribute() -> None:
    module = _Module()
    with capture_logs(module, []), pytest.raises(ConfigError, match="metric_attribute"):
        module.log("m", MulticlassAccuracy(num_classes=3))


def test_planning_the_loss_leaves_metrics_as_they_were() -> None:
    """The planner runs training_step on meta tensors; a metric update raising there must not leave the metric
    half-way (torchmetrics' forward turns its synchronisation off until it ends)."""

    class Lit(_Module):
        def __init__(self) -> None:
            super().__init__(m=_MeanState())
            self.model = nn.Linear(2, 2)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            out = self.model(batch)
            self.m(out)
            return out.sum()

    module = Lit()
    module.m.update(torch.ones(2))
    loss = step_loss(module, "model", torch.ones(4, 2), 4)
    with pytest.raises(Exception):  # noqa: B017 - whatever meta tensors make the update raise
        loss(torch.full((2, 2), math.inf), 2)
    assert module.m._to_sync and module.m._update_count == 1 and float(module.m.value) == 2.0
