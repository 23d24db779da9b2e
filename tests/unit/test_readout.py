"""[Note: step readout]: rank 0 times steps START+1..START+COUNT and reports their median against the plan."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_autopart.lightning import readout
from lightning_autopart.lightning.readout import COUNT, START, StepReadout, predicted_step_ms, watch_steps
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.strategy_cases import Lit, dataset
from tests.unit.test_plan_io import make_plan


class _Clock:
    """perf_counter as a list of step ends: each call returns the next."""

    def __init__(self, ends: list[float]) -> None:
        self.ends = iter(ends)

    def __call__(self) -> float:
        return next(self.ends)


def _run(
    monkeypatch: pytest.MonkeyPatch,
    step_s: list[float],
    predicted_ms: float,
    accumulate: int = 1,
    resumed: int = 0,
) -> Any:
    """Drive a readout through batches whose optimizer steps last ``step_s`` (from step START on)."""
    ends, now = [], 0.0
    for s in step_s:
        now += s
        ends.append(now)
    monkeypatch.setattr(readout.time, "perf_counter", _Clock([0.0, *ends]))
    callback = StepReadout(predicted_ms, torch.device("cpu"), "the cause")
    trainer = SimpleNamespace(global_step=resumed, is_global_zero=True)
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    for batch in range(accumulate * (START + len(step_s))):
        trainer.global_step = resumed + (batch + 1) // accumulate
        callback.on_train_batch_end(trainer)  # type: ignore[arg-type]
    return callback


def test_reports_the_median_step_once_the_window_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ten steps of 20 ms, one of them 500 ms (a validation run or a checkpoint inside the window): 20 ms.
    steps = [0.02] * 4 + [0.5] + [0.02] * 5 + [0.02] * 3
    messages: list[str] = []
    monkeypatch.setattr(readout, "rank_zero_info", messages.append)
    callback = _run(monkeypatch, steps, predicted_ms=16.0)
    assert callback.step_ms == pytest.approx(20.0) and callback.ratio == pytest.approx(1.25)
    assert messages == [
        f"autopart: a training step took 20.0 ms (median of steps {START + 1}-{START + COUNT}); the plan "
        "predicted 16.0 ms (1.25x)"
    ]


def test_warns_with_the_cause_beyond_the_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match=r"took 40\.0 ms .* predicted 20\.0 ms \(2\.00x\)\. the cause"):
        _run(monkeypatch, [0.04] * COUNT, predicted_ms=20.0)
    with pytest.warns(UserWarning, match=r"\(0\.50x\)"):
        _run(monkeypatch, [0.01] * COUNT, predicted_ms=20.0)


def test_waits_for_the_whole_window_and_counts_optimizer_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(monkeypatch, [0.02] * (COUNT - 1), predicted_ms=20.0).step_ms is None  # one step short
    # Accumulating 3 batches per step: a mark per optimizer step, not per batch.
    with monkeypatch.context() as patch:
        patch.setattr(readout, "rank_zero_info", lambda line: None)
        assert _run(monkeypatch, [0.06] * COUNT, 60.0, accumulate=3).step_ms == pytest.approx(60.0)
        assert _run(monkeypatch, [0.06] * COUNT, 60.0, resumed=1000).step_ms == pytest.approx(60.0)


class _Events:
    """``torch.cuda.Event``'s stand-in: each event records the next scripted device time (ms); ``done`` says
    whether the device has reached the events (``query``), and ``synchronize`` calls are counted."""

    def __init__(self, times_ms: list[float]) -> None:
        self.times = iter(times_ms)
        self.done = False
        self.syncs = 0
        events = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at: float | None = None

            def record(self) -> None:
                self.at = next(events.times)

            def query(self) -> bool:
                return events.done

            def synchronize(self) -> None:  # the host waits until the device is there
                events.syncs += 1
                events.done = True

            def elapsed_time(self, end: Event) -> float:
                assert self.at is not None and end.at is not None and events.done
                return end.at - self.at

        self.Event = Event


def test_on_cuda_it_reads_events_once_the_device_reached_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path without a GPU: events mark the steps, the report waits for the last one (query, no host
    sync) while training goes on, and the end of training waits for it (one synchronize)."""
    ends = [10.0 + 30.0 * i for i in range(COUNT + 1)]  # 30 ms device steps
    messages: list[str] = []
    monkeypatch.setattr(readout, "rank_zero_info", messages.append)
    for finish_with in ("query", "train_end"):
        events = _Events(ends)
        monkeypatch.setattr(readout.torch.cuda, "Event", events.Event)
        callback = StepReadout(25.0, torch.device("cuda", 0), "")
        trainer = SimpleNamespace(global_step=0, is_global_zero=True)
        callback.on_train_start(trainer, None)  # type: ignore[arg-type]
        for step in range(1, START + COUNT + 3):  # two steps beyond the window: the device has not caught up
            trainer.global_step = step
            callback.on_train_batch_end(trainer)  # type: ignore[arg-type]
        assert len(callback._marks) == COUNT + 1 and callback.step_ms is None and events.syncs == 0
        events.done = finish_with == "query"
        if finish_with == "query":
            trainer.global_step += 1
            callback.on_train_batch_end(trainer)  # type: ignore[arg-type]
        else:
            callback.on_train_end(trainer, None)  # type: ignore[arg-type]
        assert callback.step_ms == pytest.approx(30.0) and callback.ratio == pytest.approx(1.2)
        assert events.syncs == 1  # only once the last event is known done (query) or at the end of training
    assert len(messages) == 2 and all("took 30.0 ms" in m for m in messages)


def test_a_resumed_fit_skips_its_own_first_steps() -> None:
    callback = StepReadout(10.0, torch.device("cpu"), "")
    trainer = SimpleNamespace(global_step=1000, is_global_zero=True)  # resumed from a checkpoint at step 1000
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    for step in range(1001, 1001 + START):
        assert callback._marks == []  # its warm-up steps are not timed
        trainer.global_step = step
        callback.on_train_batch_end(trainer)  # type: ignore[arg-type]
    assert len(callback._marks) == 1  # the end of its START-th step opens the window


def test_other_ranks_do_nothing() -> None:
    callback = StepReadout(10.0, torch.device("cpu"), "")
    for step in range(START + COUNT + 2):
        callback.on_train_batch_end(SimpleNamespace(global_step=step, is_global_zero=False))  # type: ignore[arg-type]
    assert callback.step_ms is None and callback._marks == []


def test_prediction_of_an_accumulated_step() -> None:
    plan = make_plan()
    p = dataclasses.replace(plan.prediction, step_us=10_000.0, allreduce_us=1_000.0, optimizer_us=500.0)
    plan = dataclasses.replace(plan, prediction=p)
    assert predicted_step_ms(plan, 1) == pytest.approx(10.0)
    # Three batches of pipeline work (8.5 ms each), then one all-reduce and one optimizer step.
    assert predicted_step_ms(plan, 3) == pytest.approx(3 * 8.5 + 1.5)


@pytest.mark.usefixtures("master_port")
def test_a_fit_reports_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real one-process fit: the strategy's readout times steps 6-15 and reports them on rank 0."""
    messages: list[str] = []
    monkeypatch.setattr(readout, "rank_zero_info", messages.append)
    strategy = AutoPartitionStrategy(num_stages=1, profile="estimate")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=START + COUNT + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="estimated for the device spec"):  # a CPU step is not an A100's
        trainer.fit(Lit("mlp"), DataLoader(dataset("mlp", 64), batch_size=4))
    torch.distributed.destroy_process_group()
    assert strategy.step_readout is not None and strategy.step_readout.step_ms is not None
    assert strategy.step_readout.step_ms > 0
    assert sum(isinstance(c, StepReadout) for c in trainer.callbacks) == 1  # type: ignore[attr-defined]
    assert messages == []  # it warned instead


def test_the_gpu_check_runs_on_the_cpu() -> None:
    """The GPU tier's readout check (tests/gpu/test_single_gpu.py), on the CPU."""
    from tests.gpu.harness import CASES
    from tests.gpu.test_single_gpu import check_step_readout

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the readout may warn: measured here, this CPU is shared
        check_step_readout(CASES["tutorial"], "cpu")


def test_a_second_fit_replaces_the_readout() -> None:
    trainer = SimpleNamespace(
        callbacks=[StepReadout(1.0, torch.device("cpu"), "")], accumulate_grad_batches=1
    )
    plan = make_plan()
    fresh = watch_steps(trainer, plan, torch.device("cpu"))  # type: ignore[arg-type]
    assert trainer.callbacks == [fresh]
