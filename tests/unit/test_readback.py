"""What a training loop reads back from the device, and how often ([Note: reads back]): recorded from the step's
own code and Lightning's loop, and priced by whether the loader's fetch overlaps the device's work ([Note: loader
in the step])."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.first_batch import lightning_syncs_each_step, loop_facts
from lightning_autopart.lightning.step_loss import step_loss
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.partition.cost import Config, CostTables, config_costs
from lightning_autopart.partition.dp import solve
from lightning_autopart.partition.scoring import evaluate_config
from lightning_autopart.profile.loader import LoaderCost
from lightning_autopart.profile.readback import LoopFacts, StepReads, ValueReads, readback_every, reads_of
from tests.unit.test_cost import PROFILE, _cluster

# -- combining the reads ------------------------------------------------------------------------------------


def _seen(**kwargs: Any) -> StepReads:
    return StepReads(seen=True, **kwargs)


@pytest.mark.parametrize(
    ("reads", "loop", "every"),
    [
        (None, LoopFacts(), 1),  # unknown: every step, as the examples' steps do
        (StepReads(progress_bar=True), LoopFacts(progress_every=0, log_every=0), 1),  # the step never ran
        (_seen(values=["item"]), LoopFacts(progress_every=0, log_every=0), 1),
        (_seen(), LoopFacts(scaler=True), 1),
        (_seen(progress_bar=True, logger=True), LoopFacts(), 1),
        (_seen(progress_bar=True, logger=True), LoopFacts(progress_every=10), 10),
        (_seen(progress_bar=True, logger=True), LoopFacts(progress_every=0), 50),
        (_seen(logger=True), LoopFacts(log_every=20), 20),
        (_seen(logger=True), LoopFacts(log_every=0), 0),
        (_seen(progress_bar=True), LoopFacts(progress_every=0), 0),
        (_seen(), LoopFacts(), 0),  # logs nothing, reads nothing: the host runs ahead
        (_seen(), LoopFacts(progress_every=0, log_every=0, synced=True), 1),  # the loop reads an exchanged value
    ],
)
def test_the_steps_between_two_reads(reads: StepReads | None, loop: LoopFacts, every: int) -> None:
    assert readback_every(reads, loop) == every


def test_a_negative_rate_is_refused_with_what_to_give() -> None:
    with pytest.raises(ConfigError, match=r"refresh rate \(-1\).*give 0 or more \(0: no progress bar"):
        LoopFacts(progress_every=-1)
    with pytest.raises(ConfigError, match=r"steps between logs \(-5\)"):
        LoopFacts(log_every=-5)


def test_a_log_counts_at_each_step_unless_it_is_an_epoch_value() -> None:
    reads = StepReads()
    reads.note_log(prog_bar=True, logger=None, on_step=False)
    assert not reads.progress_bar and not reads.logger
    reads.note_log(prog_bar=False, logger=False, on_step=None)
    assert not reads.progress_bar and not reads.logger
    reads.note_log(prog_bar=True, logger=None, on_step=True)
    assert reads.progress_bar and reads.logger


def test_value_reads_are_seen_on_device_tensors_and_only_there() -> None:
    reads = StepReads()
    x, host = torch.ones(3, device="meta"), torch.ones(3)
    calls = [
        lambda: x.sum().item(), lambda: bool(x.sum()), lambda: float(x[0]), lambda: x.tolist(),
        lambda: x.cpu(), lambda: x.to("cpu"), lambda: x.to(device=torch.device("cpu")),
    ]  # fmt: skip
    with ValueReads(reads):
        for call in calls:
            with pytest.raises((RuntimeError, NotImplementedError)):  # meta tensors hold no values
                call()
        x.to(torch.float16), x.to("meta"), x.sum(), host.sum().item(), host.tolist()  # no read of a device value
    assert reads.values == ["item", "__bool__", "__float__", "tolist", "cpu", "to", "to"]


# -- the step's own code ------------------------------------------------------------------------------------


class Logged(L.LightningModule):
    """A regression step that logs its loss (to the progress bar or not), and may read a value."""

    def __init__(self, prog_bar: bool = False, log: bool = True, read: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.prog_bar, self.logs, self.read = prog_bar, log, read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        if self.logs:
            self.log_dict({"train_loss": loss}, prog_bar=self.prog_bar)
            self.log("lr", 0.05, prog_bar=True)  # numbers and CPU tensors are shown without a read
            self.log("seen", torch.tensor(float(index)), prog_bar=True)
        if self.read and loss.item() > 1e6:
            raise AssertionError("unreachable on these data")
        return loss

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        x = torch.randn(64, 6)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize(("prog_bar", "read"), [(False, False), (True, False), (False, True)])
def test_the_loss_records_what_the_step_logs_and_reads(prog_bar: bool, read: bool) -> None:
    module = Logged(prog_bar=prog_bar, read=read)
    batch = next(iter(module.train_dataloader()))
    loss = step_loss(module, "", batch, 8)
    assert reads_of(loss) is loss.reads and reads_of(F.mse_loss) is None
    output = torch.empty(8, 1, device="meta", requires_grad=True)
    if read:  # on meta the read fails, as it did before it was watched
        with pytest.raises(RuntimeError, match="meta"):
            loss(output, 8)
        assert loss.reads.values == ["item"] and not loss.reads.seen
    else:
        loss(output, 8).backward()
        assert loss.reads.seen and loss.reads.values == []
    assert (loss.reads.progress_bar, loss.reads.logger) == (prog_bar, True)
    every = readback_every(loss.reads, LoopFacts())
    assert every == (1 if prog_bar or read else 50)


def test_the_loop_facts_of_a_trainer(tmp_path: Any) -> None:
    quiet = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    assert loop_facts(quiet) == LoopFacts(progress_every=0, log_every=0, scaler=False)
    bar = L.Trainer(
        accelerator="cpu", callbacks=[TQDMProgressBar(refresh_rate=7)], log_every_n_steps=20, default_root_dir=tmp_path
    )
    assert loop_facts(bar) == LoopFacts(progress_every=7, log_every=20, scaler=False)
    # two processes: Lightning's loop broadcasts rank 0's SIGTERM flag on the device and reads it, every batch
    ddp = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    assert ddp.world_size == 2 and loop_facts(ddp).synced == lightning_syncs_each_step(2)
    assert not loop_facts(ddp, sigterm_broadcast=False).synced  # autopart's pre-emption leaves it out
    assert lightning_syncs_each_step(2) == hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")
    assert not lightning_syncs_each_step(1)


def test_the_installed_lightning_reads_its_broadcast_flag_every_batch() -> None:
    """The fact behind ``synced``: if a Lightning release drops (or renames) the per-batch broadcast, this says so."""
    if not hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        pytest.skip("this Lightning's loop exchanges nothing per batch")
    source = inspect.getsource(_TrainingEpochLoop._broadcast_sigterm_tensor)
    assert "broadcast" in source and ".item()" in source and "root_device" in source
    assert "_broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)


# -- the price ----------------------------------------------------------------------------------------------

#: Host time of each block's forward and backward launches on a host that runs ahead of its device (us).
_HOST_F, _HOST_B = 5.0, 10.0


def _tables(sample_us: float, every: int, async_host: bool = True) -> CostTables:
    blocks = tuple(dataclasses.replace(b, host_fwd_us=_HOST_F, host_bwd_us=_HOST_B) for b in PROFILE.blocks)
    loader = LoaderCost(sample_us, 0, 4, 3, readback_every=every)
    profile = dataclasses.replace(PROFILE, blocks=blocks, meta={**PROFILE.meta, "loader": loader.as_meta()})
    return CostTables(profile, dataclasses.replace(_cluster(), async_host=async_host))


def test_a_fetch_after_a_read_back_adds_and_one_without_overlaps_the_device() -> None:
    cfg, bounds, batch = Config(1, 1, 2, "GPipe"), (0, 3), 8  # one stage, K = 2 micro-batches of 4
    bare = evaluate_config(_tables(0.0, 1), cfg, batch, bounds).step_us
    host = cfg.ticks * len(PROFILE.blocks) * (_HOST_F + _HOST_B)  # the host's launches of one step: 90 us
    assert host < bare
    for fetch in (0.25 * (bare - host), 2.0 * bare):  # a batch quicker than the device's step, then slower
        sample_us = fetch / batch
        every_step = evaluate_config(_tables(sample_us, 1), cfg, batch, bounds)
        assert every_step.step_us == pytest.approx(bare + fetch)
        never = evaluate_config(_tables(sample_us, 0), cfg, batch, bounds)
        assert never.step_us == pytest.approx(max(bare, fetch + host))
        assert never.stages[0].data_us == pytest.approx(never.step_us - bare)
        tenth = evaluate_config(_tables(sample_us, 10), cfg, batch, bounds)
        assert tenth.step_us == pytest.approx(0.1 * (bare + fetch) + 0.9 * max(bare, fetch + host))
        # a host that does the math waits for nothing: the fetch adds however rarely the loop reads back
        cpu = evaluate_config(_tables(sample_us, 0, async_host=False), cfg, batch, bounds)
        cpu_bare = evaluate_config(_tables(0.0, 0, async_host=False), cfg, batch, bounds)
        assert cpu.step_us == pytest.approx(cpu_bare.step_us + fetch)


@pytest.mark.parametrize("every", [0, 3])
@pytest.mark.parametrize("sample_us", [10.0, 450.0, 3000.0])  # the overlap binds for neither cut, one, both
def test_the_dp_finds_the_brute_force_optimum_when_the_fetch_overlaps(every: int, sample_us: float) -> None:
    tables = _tables(sample_us, every)
    for cfg in (Config(1, 2, 4, "GPipe"), Config(2, 2, 2, "1F1B"), Config(1, 3, 2, "1F1B")):
        got = solve(tables, config_costs(tables, cfg, 8))
        n, nv = tables.num_blocks, cfg.virtual_stages
        brute = min(
            evaluate_config(tables, cfg, 8, (0, *cut, n)).step_us
            for cut in itertools.combinations(range(1, n), nv - 1)
        )
        assert got is not None and got[0] == pytest.approx(brute)


def test_old_plans_without_a_readback_read_back_every_step() -> None:
    meta = LoaderCost(1.0, 0, 4, 3).as_meta()
    del meta["readback_every"]
    cost = LoaderCost.from_meta(meta)
    assert cost is not None and cost.readback_every == 1


# -- under the strategy -------------------------------------------------------------------------------------


def _fit(module: Logged, **trainer: Any) -> AutoPartitionStrategy:
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=1, profile="estimate")
    options: dict[str, Any] = {"accelerator": "cpu", "enable_progress_bar": False, "logger": False, **trainer}
    L.Trainer(
        devices=1, strategy=strategy, max_steps=2, enable_checkpointing=False, enable_model_summary=False, **options
    ).fit(module)
    torch.distributed.destroy_process_group()
    return strategy


@pytest.mark.usefixtures("master_port")
def test_the_strategys_plan_says_how_often_its_loop_reads_back() -> None:
    quiet = _fit(Logged(prog_bar=True))  # logs for a progress bar that is off, and no logger
    assert quiet.plan is not None and quiet.plan.notes["loader"].endswith("reads back never")
    shown = _fit(Logged(prog_bar=True), enable_progress_bar=True, callbacks=[TQDMProgressBar(refresh_rate=5)])
    assert shown.plan is not None and shown.plan.notes["loader"].endswith("reads back every 5 steps")
    read = _fit(Logged(read=True))
    assert read.plan is not None and read.plan.notes["loader"].endswith("reads back every step")
