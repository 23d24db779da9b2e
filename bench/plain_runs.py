"""Plain Lightning on one device, measured for bench/fidelity.py: step times, phases, peak memory, op traces.

``measure_run`` trains a case with ``strategy="auto"`` and reads its median step, the forward / backward /
optimizer phases between Lightning's hooks (CUDA events on a GPU) and the peak memory; ``trace_ops`` traces the
device time per aten op in a separate fit, so the profiler's overhead stays out of the measured step.
``measure_autopart`` trains it with autopart's one-stage plan instead and reads its step beside the plan's own
prediction: the captured graph's host time, not the eager model's, is what that prediction prices.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_vs_plain import StepClock

__all__ = ["FidelityCase", "PhaseClock", "free_device", "measure_autopart", "measure_run", "trace_ops"]


@dataclass(frozen=True)
class FidelityCase:
    """``model()`` builds the LightningModule, ``data(n)`` makes ``n`` samples; trained with ``optimizer``."""

    name: str
    model: Callable[[], L.LightningModule]
    data: Callable[[int], Dataset[Any]]
    batch: int
    optimizer: str
    precision: str


def _use_optimizer(lm: L.LightningModule, kind: str) -> L.LightningModule:
    """``lm`` with ``configure_optimizers`` returning the case's optimizer instead of the example's."""

    def configure_optimizers(self: L.LightningModule) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01)
        return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](self.parameters(), lr=1e-4)

    lm.configure_optimizers = types.MethodType(configure_optimizers, lm)  # type: ignore[method-assign]
    return lm


def free_device(cuda: bool) -> None:
    """Collect garbage and, on a GPU, return the cached blocks and wait, so the next run starts clean."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()


def _fit_plain(
    case: FidelityCase,
    data: Dataset[Any] | DataLoader[Any],
    accelerator: str,
    steps: int,
    callback: L.Callback,
    strategy: Any = "auto",
    progress_bar: bool | None = None,
) -> Any:
    """Train ``case`` (built after seeding 0, with its optimizer) on one device for ``steps`` steps,
    ``callback`` watching, with plain Lightning (or ``strategy``); everything freed before and after.
    ``data``: pre-made batches, or a loader that makes them each step (then with the progress bar on, as a
    default Trainer has it, unless ``progress_bar`` says otherwise). Returns the strategy's plan, if it made
    one."""
    cuda = accelerator == "gpu"
    free_device(cuda)
    torch.manual_seed(0)
    model = _use_optimizer(case.model(), case.optimizer)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        precision=case.precision,  # type: ignore[arg-type]
        max_steps=steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=isinstance(data, DataLoader) if progress_bar is None else progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
    )
    loader = data if isinstance(data, DataLoader) else DataLoader(data, batch_size=None, shuffle=False)
    trainer.fit(model, loader)
    plan = getattr(trainer.strategy, "plan", None)
    del trainer, model
    free_device(cuda)
    return plan


class PhaseClock(StepClock):
    """A :class:`StepClock` that also marks each timed step's forward (to ``on_before_backward``), backward (to
    ``on_after_backward``) and optimizer step (``on_before_optimizer_step`` to ``on_train_batch_end``), to set
    against the prediction's parts."""

    _PHASES = ("before_backward", "after_backward", "before_optimizer", "batch_end")

    def __init__(self, warmup: int, steps: int, cuda: bool) -> None:
        super().__init__(warmup, steps, cuda)
        self.phase_marks: list[dict[str, Any]] = []

    def _mark(self, trainer: L.Trainer, phase: str) -> None:
        if not self.warmup <= trainer.global_step < self.warmup + self.steps or not self.phase_marks:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.phase_marks[-1][phase] = event
        else:
            self.phase_marks[-1][phase] = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.warmup <= batch_idx < self.warmup + self.steps:
            self.phase_marks.append({"start": self.marks[-1]})

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: Tensor) -> None:
        self._mark(trainer, "before_backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._mark(trainer, "after_backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._mark(trainer, "before_optimizer")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self._mark(trainer, "batch_end")

    def phase_ms(self) -> dict[str, float]:
        """Median milliseconds of forward (with the loss), backward and the optimizer step over the timed steps."""

        def span(a: Any, b: Any) -> float:
            return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

        spans: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
        for m in self.phase_marks:
            if all(k in m for k in self._PHASES):
                spans["forward"].append(span(m["start"], m["before_backward"]))
                spans["backward"].append(span(m["before_backward"], m["after_backward"]))
                spans["optimizer"].append(span(m["before_optimizer"], m["batch_end"]))
        return {k: statistics.median(v) for k, v in spans.items() if v}


def measure_run(
    case: FidelityCase,
    data: Dataset[Any] | DataLoader[Any],
    *,
    accelerator: str,
    warmup: int,
    steps: int,
    progress_bar: bool | None = None,
) -> dict[str, Any]:
    """Train ``case`` with plain Lightning; its median step (ms), raw peak bytes (GPU), every step time and the
    median forward, backward and optimizer phases (ms)."""
    cuda = accelerator == "gpu"
    free_device(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    clock = PhaseClock(warmup, steps, cuda)
    _fit_plain(case, data, accelerator, warmup + steps + 1, clock, progress_bar=progress_bar)
    seconds = clock.step_seconds()
    if len(seconds) != steps:
        raise RuntimeError(f"{case.name}: timed {len(seconds)} steps, expected {steps}")
    peak = clock.peak if cuda else None
    return {"step_ms": statistics.median(seconds) * 1e3, "peak_bytes": peak, "before_bytes": before,
            "steps_s": seconds, "phases_ms": clock.phase_ms()}  # fmt: skip


def measure_autopart(
    case: FidelityCase,
    data: Dataset[Any],
    *,
    accelerator: str,
    warmup: int,
    steps: int,
    profile: str = "measure",
) -> dict[str, Any]:
    """Train ``case`` with autopart's one-stage, one-micro-batch plan (profiled in ``profile`` mode): its
    median step (ms), raw peak bytes (GPU) and every step time, with the plan's predicted step (ms) and
    peak bytes."""
    from lightning_autopart import AutoPartitionStrategy

    cuda = accelerator == "gpu"
    free_device(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    clock = StepClock(warmup, steps, cuda)
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=1, profile=profile)
    plan = _fit_plain(case, data, accelerator, warmup + steps + 1, clock, strategy)
    seconds = clock.step_seconds()
    if len(seconds) != steps or plan is None:
        got = f"timed {len(seconds)} autopart steps of {steps}, plan made: {plan is not None}"
        raise RuntimeError(f"{case.name}: {got}")
    return {"step_ms": statistics.median(seconds) * 1e3, "peak_bytes": clock.peak if cuda else None,
            "before_bytes": before, "steps_s": seconds, "predicted_ms": plan.prediction.step_us / 1e3,
            "predicted_peak_bytes": plan.prediction.peak_memory_bytes}  # fmt: skip


class _OpTrace(L.Callback):
    """Records steps ``warmup .. warmup + steps - 1`` under ``torch.profiler``; :attr:`ops` per aten op, device us."""

    def __init__(self, warmup: int, steps: int, cuda: bool) -> None:
        self.warmup, self.steps, self.cuda = warmup, steps, cuda
        self.ops: dict[str, dict[str, float]] = {}
        self._prof: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()
        elif batch_idx == self.warmup + self.steps and self._prof is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            for ev in self._prof.key_averages():
                own = getattr(ev, "self_device_time_total", 0.0) if self.cuda else ev.self_cpu_time_total
                if own > 0 or ev.key.startswith("aten::"):
                    self.ops[ev.key] = {"calls": ev.count / self.steps, "self_us": own / self.steps}
            self._prof = None


def trace_ops(
    case: FidelityCase, data: Dataset[Any], *, accelerator: str, warmup: int, steps: int
) -> dict[str, Any]:
    """Device time per op and step of plain Lightning on ``case`` (``torch.profiler``), for finding the op the
    estimate gets wrong; a separate run, so that the profiler's overhead stays out of the measured step."""
    trace = _OpTrace(warmup, steps, accelerator == "gpu")
    _fit_plain(case, data, accelerator, warmup + steps + 1, trace)
    return trace.ops
