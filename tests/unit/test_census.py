"""The step probes of tests/census.py on small cases whose answers are known."""

from __future__ import annotations

import gc
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.census import PeakTracker, StepProbe, SyncCounter, live_tensor_bytes

MB = 1 << 20
F32 = 4


# ---------------------------------------------------------------------------------------------------------
# SyncCounter
# ---------------------------------------------------------------------------------------------------------


def test_an_item_call_counts_one() -> None:
    t = torch.ones(3)
    with SyncCounter() as counter:
        t.sum().item()
    assert counter.count == 1


def test_every_scalar_conversion_counts() -> None:
    t = torch.tensor([1.5, -2.0])
    with SyncCounter() as counter:
        float(t[0])
        int(t[0])
        bool(t[0] > 0)
        if t[1] < 0:  # a Python branch on a tensor is a bool() conversion
            pass
        f"{t[0]:.2f}"
        t.add(1).mul(2)  # no conversion: no sync
    assert counter.count == 5
    assert counter.to_host == 0  # nothing left an accelerator


def test_trace_names_the_calling_line() -> None:
    t = torch.ones(2)
    with SyncCounter(trace=True) as counter:
        t.sum().item()
    assert counter.count == 1 and len(counter.where) == 1
    assert "test_census.py" in counter.where[0] and "test_trace_names_the_calling_line" in counter.where[0]
    with SyncCounter() as quiet:
        t.sum().item()
    assert quiet.where == []


# ---------------------------------------------------------------------------------------------------------
# live_tensor_bytes
# ---------------------------------------------------------------------------------------------------------


def test_a_tensor_in_a_list_is_found_and_freed_bytes_disappear() -> None:
    before = live_tensor_bytes()
    kept = [torch.empty(MB // F32)]
    assert live_tensor_bytes() - before == MB
    kept.append(kept[0].view(2, -1))  # a view shares the storage: no new bytes
    kept.append(kept[0][: MB // F32 // 2])
    assert live_tensor_bytes() - before == MB
    kept.clear()
    assert live_tensor_bytes() == before


def test_optimizer_state_and_gradients_are_found() -> None:
    before = live_tensor_bytes()
    model = nn.Linear(256, 256, bias=False)  # 256 KiB of weight
    weight = 256 * 256 * F32
    model(torch.randn(4, 256)).sum().backward()  # the gradient exists only in C++ until read
    assert live_tensor_bytes() - before == 2 * weight
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.step()  # exp_avg and exp_avg_sq: two more weights (and a 4-byte step count)
    assert live_tensor_bytes() - before == 4 * weight + 4
    del model, optimizer
    assert live_tensor_bytes() == before


def test_a_reference_cycle_is_seen_until_collected() -> None:
    class Holder:
        def __init__(self) -> None:
            self.me = self
            self.data = torch.empty(MB // F32)

    gc.collect()
    gc.disable()  # the collector must not run before we look
    try:
        before = live_tensor_bytes()
        Holder()  # unreachable at once, alive until the collector runs
        assert live_tensor_bytes() - before == MB
    finally:
        gc.enable()
    gc.collect()
    assert live_tensor_bytes() == before


def test_meta_and_empty_tensors_count_nothing() -> None:
    before = live_tensor_bytes()
    kept = [torch.empty(1000, 1000, device="meta"), torch.empty(0)]
    assert live_tensor_bytes() == before
    del kept


# ---------------------------------------------------------------------------------------------------------
# PeakTracker
# ---------------------------------------------------------------------------------------------------------


def test_the_peak_of_a_known_sequence_of_allocations() -> None:
    with PeakTracker() as tracker:
        a = torch.empty(MB // F32)  # 1 MiB
        b = torch.empty(2 * MB // F32)  # 3 MiB live: the peak
        del a  # 2 MiB
        c = torch.empty(MB // F32 // 2)  # 2.5 MiB
        view = b.view(2, -1)  # views and in-place results are no new memory
        b.add_(1)
        assert tracker.current == 2 * MB + MB // 2
        assert tracker.peak == 3 * MB
        tracker.reset_peak()
        assert tracker.peak == tracker.current
        d = torch.empty(MB // F32)  # 3.5 MiB: a new peak
        del d
    assert tracker.peak == 3 * MB + MB // 2
    del b, view  # frees are seen after the mode exits
    assert tracker.current == MB // 2
    del c
    assert tracker.current == 0


def test_storages_made_before_the_mode_are_not_counted_unless_asked() -> None:
    old = torch.empty(MB // F32)
    with PeakTracker() as tracker:
        old.mul_(2)
        alias = old.view(-1)
    assert tracker.current == tracker.peak == 0
    with PeakTracker(include_live=True) as seeded:
        start = seeded.current
        assert start >= MB  # the census found ``old`` (and whatever else is alive)
        del old, alias
        assert seeded.current == start - MB
        torch.empty(MB // F32)  # freed at once: the peak is still the start
    assert seeded.peak == start


def test_backward_allocations_are_seen() -> None:
    w = torch.randn(512, 512, requires_grad=True)  # 1 MiB
    x = torch.randn(128, 512)
    act = 128 * 512 * F32  # 256 KiB per activation
    with PeakTracker() as tracker:
        y = torch.relu(x @ w).sum()  # the matmul output is saved by relu... as relu's result
        forward = tracker.current
        y.backward()
    assert forward >= act  # relu's output, saved for backward, is alive
    assert w.grad is not None
    # After backward the graph is gone; the gradient (made by backward's own matmul) is alive.
    assert tracker.current == w.numel() * F32 + F32  # the grad and the scalar loss
    assert tracker.peak >= w.numel() * F32 + act  # the grad was made while backward's inputs lived


def test_a_storage_held_only_by_autograd_is_followed_until_backward_frees_it() -> None:
    """torch keeps a storage's Python object alive as long as the storage: the weak reference fires when
    autograd drops its saved copy, not when Python's last reference goes."""
    x = torch.randn(MB // F32, requires_grad=True)
    with PeakTracker() as tracker:
        y = x.exp()  # exp saves its result for backward
        loss = y.sum()
        del y  # no Python reference left: autograd alone holds the storage
        assert tracker.current >= MB
        loss.backward()  # frees the saved result; x.grad (1 MiB) is made
    assert x.grad is not None
    assert tracker.current == MB + F32  # x.grad and the loss; the saved result is gone
    assert tracker.peak >= 2 * MB


def test_growing_an_existing_tracked_storage_is_remeasured() -> None:
    with PeakTracker() as tracker:
        t = torch.empty(16)
        t.resize_(MB // F32)  # the same storage, grown to 1 MiB
        assert tracker.current == MB
        src = torch.ones(2 * MB // F32)
        torch.add(src, 1, out=t.resize_(0))  # ``out=`` grows t's storage again, to 2 MiB
        assert tracker.current == 4 * MB
    del t, src
    assert tracker.current == 0


# ---------------------------------------------------------------------------------------------------------
# StepProbe
# ---------------------------------------------------------------------------------------------------------


class _Lit(L.LightningModule):
    def __init__(self, syncs: int) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)
        self.syncs = syncs
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        for _ in range(self.syncs):
            loss.item()
        self.kept.append(torch.empty(MB // F32))  # 1 MiB more alive at every step start
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_step_probe_counts_a_window_of_steps() -> None:
    probe = StepProbe(2, 5, trace=True)
    model = _Lit(syncs=3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(64, 64)), batch_size=8))
    assert len(probe.syncs) == len(probe.live) == len(probe.peaks) == len(probe.where) == 3
    # The step's own three syncs; Lightning may add its own, the same at every steady step.
    assert all(n >= 3 for n in probe.syncs) and len(set(probe.syncs)) == 1
    assert sum("training_step" in w for w in probe.where[0]) == 3
    assert [b - a for a, b in zip(probe.live, probe.live[1:], strict=False)] == [MB, MB]
    for live, peak in zip(probe.live, probe.peaks, strict=True):
        assert peak >= live + MB  # the step's new MiB, on top of what was alive at its start
    assert torch._C._len_torch_dispatch_stack() == 0  # every mode was popped


@pytest.mark.parametrize("stop", [0, 1])
def test_step_probe_outside_its_window_records_nothing(stop: int) -> None:
    probe = StepProbe(5, 5 + stop)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(_Lit(syncs=0), DataLoader(TensorDataset(torch.randn(16, 64)), batch_size=8))
    assert probe.syncs == probe.live == probe.peaks == []


class _LeavesAMode(L.Callback):
    """Enters a mode in on_train_batch_start (after the probe's) and never leaves it."""

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        SyncCounter().__enter__()


def test_step_probe_refuses_to_pop_a_mode_it_did_not_push() -> None:
    from torch.utils._python_dispatch import _pop_mode

    probe = StepProbe(0, 1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, _LeavesAMode()],
    )
    try:
        with pytest.raises(RuntimeError, match="on top of the dispatch mode stack"):
            trainer.fit(_Lit(syncs=0), DataLoader(TensorDataset(torch.randn(8, 64)), batch_size=8))
    finally:
        while torch._C._len_torch_dispatch_stack() > 0:
            _pop_mode()


def test_labels_say_what_made_the_bytes_at_the_peak() -> None:
    """``labels=True`` (StepPeak's ``AUTOPART_PEAK_LABELS``): the bytes alive at the peak by phase, op, shape and
    dtype; they sum to the peak."""
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    tracker = PeakTracker(labels=True)
    with tracker:
        y = (x @ w).relu()
        y.sum().backward()
    assert sum(tracker.at_peak.values()) == tracker.peak
    assert tracker.at_peak["F aten.relu.default (4, 16) float32"] == 4 * 16 * 4  # saved for the backward
    assert tracker.at_peak["B aten.mm.default (16, 16) float32"] == 16 * 16 * 4  # the weight's gradient
    assert PeakTracker().labels is None  # off by default: nothing recorded
