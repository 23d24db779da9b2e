"""The training loader's time in the step ([Note: loader time], [Note: loader in the step]): timed from the
loader's own dataset without disturbing training's data order or random draws, added to the step where the
training process makes each batch, a floor on it where workers do."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.partition import partition
from lightning_autopart.partition.cost import Config, CostTables, config_costs
from lightning_autopart.partition.dp import solve, solve_memory
from lightning_autopart.partition.scoring import evaluate_config
from lightning_autopart.plan.report import print_plan
from lightning_autopart.profile import loader as loader_module
from lightning_autopart.profile.loader import LoaderCost, time_loader
from tests.unit.test_cost import PROFILE, _cluster


class Sleepy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples that take ``ms`` each to make, drawing from every global generator as augmentations do."""

    def __init__(self, n: int, ms: float = 0.0) -> None:
        self.n, self.ms = n, ms
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(index)
        if self.ms:
            time.sleep(self.ms / 1e3)
        noise = torch.rand(()) + random.random() + float(np.random.rand())
        return torch.full((4,), float(index)) + 0 * noise, torch.tensor(index)


def _states() -> tuple[torch.Tensor, object, object]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist()  # type: ignore[index]


def test_a_batch_is_timed_from_the_dataset_at_its_first_indices() -> None:
    data = Sleepy(100, ms=1.0)
    cost = time_loader(DataLoader(data, batch_size=8, shuffle=True), samples=8, batches=3)
    assert cost is not None and (cost.samples, cost.batches, cost.workers) == (8, 3, 0)
    assert data.read == list(range(24))  # the sampler was not asked for an order
    assert cost.sample_us >= 1000.0  # each sample sleeps 1 ms
    assert cost.fetch_us(16) == pytest.approx(16 * cost.sample_us)


def test_time_spent_waiting_for_a_core_is_not_the_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    waits = itertools.count()  # each batch's thread waits 15 ms for a core (as a busy machine makes it)
    monkeypatch.setattr(loader_module, "_queued_s", lambda: 0.015 * ((next(waits) + 1) // 2))
    cost = time_loader(DataLoader(Sleepy(8, ms=10.0), batch_size=2), samples=2, batches=3)
    assert cost is not None
    assert 2_000 <= cost.sample_us < 9_000  # (20 ms asleep - 15 ms queued) / 2 samples, not 10 ms a sample


def test_a_wait_between_the_last_two_reads_is_not_taken_off_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread put off its core between reading the clock and its run-queue wait: taking that wait off the
    batch priced a loaded machine's batches at 0 (seen under two test workers on two cores)."""
    clock = {"now": 0.0, "queued": 0.0}
    reads = itertools.count()

    def queued() -> float:
        if next(reads) % 2:  # each batch's second read: its thread waits 50 ms for a core just before it
            clock["now"] += 0.05
            clock["queued"] += 0.05
        return clock["queued"]

    monkeypatch.setattr(loader_module, "_queued_s", queued)
    monkeypatch.setattr(loader_module.time, "perf_counter", lambda: clock["now"])

    class Work(Sleepy):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            clock["now"] += 0.001  # 1 ms of work a sample
            return super().__getitem__(index)

    cost = time_loader(DataLoader(Work(8), batch_size=2), samples=2, batches=3)
    assert cost is not None and cost.sample_us >= 1_000.0


def test_training_sees_the_same_order_and_draws_after_timing() -> None:
    def epoch() -> tuple[list[int], tuple[torch.Tensor, object, object]]:
        loader = DataLoader(Sleepy(40), batch_size=4, shuffle=True)
        order = [int(i) for _, idx in loader for i in idx]
        return order, _states()

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    plain = epoch()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    before = _states()
    assert time_loader(DataLoader(Sleepy(40), batch_size=4, shuffle=True), samples=4) is not None
    after = _states()
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    timed = epoch()
    assert plain[0] == timed[0] and torch.equal(plain[1][0], timed[1][0]) and plain[1][1:] == timed[1][1:]


class Batched(Sleepy):
    """A dataset that reads a batch at once (``__getitems__``, as Hugging Face datasets do)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.batches: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.batches.append(list(indices))
        return [Sleepy.__getitem__(self, i) for i in indices]


def test_a_dataset_that_reads_batches_is_read_so() -> None:
    data = Batched(10)
    cost = time_loader(DataLoader(data, batch_size=4), samples=4, batches=2)
    assert cost is not None and data.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]


class Stream(IterableDataset[torch.Tensor]):
    """``n`` samples of ``ms`` each, counted from 0 by every fresh iterator; each draws from the global
    generators and the stream's own, and ``__iter__`` records the last iterator on the dataset."""

    def __init__(self, n: int, ms: float = 0.0) -> None:
        self.n, self.ms = n, ms
        self.rng = torch.Generator().manual_seed(1)
        self.np_rng = np.random.default_rng(2)
        self.py_rng = random.Random(3)
        self.position = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.last = object()  # as Hugging Face's IterableDataset records its state on itself
        for i in range(self.n):
            self.position = i
            if self.ms:
                time.sleep(self.ms / 1e3)
            noise = torch.rand((), generator=self.rng) + self.np_rng.random() + self.py_rng.random()
            yield torch.full((2,), float(i)) + noise + torch.rand(()) + random.random()


def _drawn(loader: DataLoader[torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    random.seed(0)
    return list(loader)


def test_an_iterable_dataset_is_timed_from_a_fresh_iterator_and_training_reads_the_same() -> None:
    untouched = _drawn(DataLoader(Stream(10), batch_size=4))
    data = Stream(10, ms=2.0)
    loader = DataLoader(data, batch_size=4)
    torch.manual_seed(0)
    random.seed(0)
    cost = time_loader(loader, samples=4, batches=3)
    # the last batch holds the stream's two last samples: timed per sample all the same
    assert cost is not None and (cost.samples, cost.batches, cost.workers) == (4, 3, 0)
    assert cost.sample_us >= 2000.0
    assert not hasattr(data, "last") and data.position == 0  # its attributes are as before
    data.ms = 0.0
    timed = list(loader)  # the global generators were restored too (seeded above)
    assert len(timed) == len(untouched) == 3
    assert all(torch.equal(a, b) for a, b in zip(timed, untouched, strict=True))


class OneShot(IterableDataset[torch.Tensor]):
    """A stream that iterates once: ``iter()`` gives back the same generator each time."""

    def __init__(self) -> None:
        self.samples = (torch.zeros(2) for _ in range(4))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return self.samples


class SelfIterating(IterableDataset[torch.Tensor]):
    def __init__(self) -> None:
        self.left = 4

    def __iter__(self):  # type: ignore[no-untyped-def]
        return self

    def __next__(self) -> torch.Tensor:
        if not self.left:
            raise StopIteration
        self.left -= 1
        return torch.zeros(2)


@pytest.mark.parametrize("make", [OneShot, SelfIterating], ids=["same-iterator", "its-own-iterator"])
def test_a_single_stream_is_not_read_aside(make: type[IterableDataset[torch.Tensor]]) -> None:
    data = make()
    assert time_loader(DataLoader(data, batch_size=2), samples=2) is None
    assert len(list(DataLoader(data, batch_size=2))) == 2  # training still reads all four samples


class WorkersOnly(IterableDataset[torch.Tensor]):
    """A stream that opens only inside a loader worker (its shard comes from ``get_worker_info()``)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        if torch.utils.data.get_worker_info() is None:
            raise RuntimeError("open me in a worker")
        return iter([torch.zeros(2)])


def test_a_stream_that_fails_to_open_is_left_to_training() -> None:
    assert time_loader(DataLoader(WorkersOnly(), batch_size=1, num_workers=1), samples=1) is None


def test_a_loader_that_is_no_dataloader_is_not_timed() -> None:
    assert time_loader([torch.zeros(2)], samples=2) is None
    assert time_loader(DataLoader(Sleepy(0), batch_size=2), samples=2) is None


class Batches(Dataset[torch.Tensor]):
    """Each item a whole batch of ``rows`` samples (read with ``batch_size=None``), ``ms`` per sample."""

    def __init__(self, n: int, rows: int, ms: float) -> None:
        self.n, self.rows, self.ms = n, rows, ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.rows * self.ms / 1e3)
        return torch.zeros(self.rows, 2)


def test_without_automatic_batching_each_item_is_a_whole_batch() -> None:
    cost = time_loader(DataLoader(Batches(3, rows=8, ms=0.5), batch_size=None), samples=8, batches=2)
    assert cost is not None and (cost.samples, cost.batches) == (8, 2)
    assert 500.0 <= cost.sample_us < 2000.0  # 0.5 ms a sample, not 4 ms (the item's whole time)


def test_a_batch_sampler_batches_as_batch_size_does() -> None:
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(16)), 4, drop_last=False)
    cost = time_loader(DataLoader(Sleepy(16, ms=1.0), batch_sampler=sampler), samples=4, batches=2)
    assert cost is not None and (cost.samples, cost.batches) == (4, 2)
    assert cost.sample_us >= 1000.0  # each sample sleeps 1 ms: not a whole batch per item


class OwnGenerators(Sleepy):
    """Augmentations drawn from generators the dataset holds (torch's, NumPy's new and legacy, Python's)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.rng = torch.Generator().manual_seed(0)
        self.np_rng = np.random.default_rng(0)
        self.np_legacy = np.random.RandomState(0)
        self.py_rng = random.Random(0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(index)
        noise = torch.rand((), generator=self.rng) + self.np_rng.random() + self.np_legacy.rand()
        return x + noise + self.py_rng.random(), y


def test_the_datasets_own_generators_draw_in_training_as_if_untimed() -> None:
    untouched = list(DataLoader(OwnGenerators(8), batch_size=4))
    data = OwnGenerators(8)
    assert time_loader(DataLoader(data, batch_size=4), samples=4, batches=2) is not None
    timed = list(DataLoader(data, batch_size=4))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(timed, untouched, strict=True))


class Broken(Sleepy):
    """Samples from ``bad`` on fail to load."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index >= self.bad:
            raise OSError(f"sample {index} is unreadable")
        return super().__getitem__(index)


def test_a_sample_that_fails_to_load_is_left_to_training() -> None:
    assert time_loader(DataLoader(Broken(8, bad=0), batch_size=2), samples=2) is None  # the first batch fails
    cost = time_loader(DataLoader(Broken(8, bad=3), batch_size=2), samples=2, batches=3)  # the second one does
    assert cost is not None and cost.batches == 1


def test_workers_are_recorded_and_samples_capped_by_the_dataset() -> None:
    cost = time_loader(DataLoader(Sleepy(5), batch_size=4, num_workers=2), samples=64, batches=2)
    assert cost is not None and (cost.workers, cost.samples) == (2, 5)
    assert LoaderCost.from_meta(cost.as_meta()) == cost and LoaderCost.from_meta(None) is None


def _with_loader(sample_us: float, workers: int, async_host: bool = True) -> CostTables:
    meta = {**PROFILE.meta, "loader": LoaderCost(sample_us, workers, 4, 3).as_meta()}
    cluster = dataclasses.replace(_cluster(), async_host=async_host)
    return CostTables(dataclasses.replace(PROFILE, meta=meta), cluster)


def test_without_workers_the_batch_adds_to_every_stage_of_the_step() -> None:
    cfg, bounds = Config(2, 2, 2, "1F1B"), (0, 2, 3)
    bare = evaluate_config(CostTables(PROFILE, _cluster()), cfg, 8, bounds)
    fed = evaluate_config(_with_loader(50.0, 0), cfg, 8, bounds)
    # each replica fetches its 8 / 2 = 4 samples every step
    for a, b in zip(bare.stages, fed.stages, strict=True):
        assert b.term_us == pytest.approx(a.term_us + 200.0) and b.data_us == pytest.approx(200.0)
    assert fed.step_us == pytest.approx(bare.step_us + 200.0)


def test_workers_bound_the_step_from_below() -> None:
    cfg, bounds = Config(1, 2, 4, "GPipe"), (0, 2, 3)
    bare = evaluate_config(CostTables(PROFILE, _cluster()), cfg, 4, bounds)
    slow = 4 * bare.step_us  # per sample: the 4-sample batch takes 4 steps' time on one worker
    assert evaluate_config(_with_loader(slow / 4, 4), cfg, 4, bounds).step_us == pytest.approx(bare.step_us)
    two = evaluate_config(_with_loader(slow / 4, 2), cfg, 4, bounds)
    assert two.step_us == pytest.approx(2 * bare.step_us)
    assert two.stages[two.bottleneck].data_us == pytest.approx(bare.step_us)
    # where the host does the math, the workers share its cores: their batch adds as with none
    shared = evaluate_config(_with_loader(slow / 4, 2, async_host=False), cfg, 4, bounds)
    alone = evaluate_config(_with_loader(slow / 4, 0, async_host=False), cfg, 4, bounds)
    assert shared.step_us == pytest.approx(alone.step_us) and shared.step_us > 2 * bare.step_us


@pytest.mark.parametrize(("sample_us", "workers"), [(40.0, 0), (600.0, 1), (90.0, 2)])
def test_the_dp_finds_the_brute_force_optimum_with_a_loader(sample_us: float, workers: int) -> None:
    tables = _with_loader(sample_us, workers)
    for cfg in (Config(1, 2, 4, "GPipe"), Config(2, 2, 2, "1F1B"), Config(1, 3, 2, "1F1B")):
        cc = config_costs(tables, cfg, 8)
        got = solve(tables, cc)
        n, nv = tables.num_blocks, cfg.virtual_stages
        brute = min(
            evaluate_config(tables, cfg, 8, (0, *cut, n)).step_us
            for cut in itertools.combinations(range(1, n), nv - 1)
        )
        assert got is not None and got[0] == pytest.approx(brute)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_memory_search_does_not_see_the_loader(workers: int) -> None:
    bare, fed = CostTables(PROFILE, _cluster()), _with_loader(500.0, workers)
    for cfg in (Config(1, 2, 4, "GPipe"), Config(1, 3, 2, "1F1B")):
        assert solve_memory(fed, config_costs(fed, cfg, 8)) == solve_memory(bare, config_costs(bare, cfg, 8))


def test_the_plan_shows_the_loaders_part_of_the_step() -> None:
    meta = {**PROFILE.meta, "loader": LoaderCost(250.0, 0, 4, 3).as_meta()}
    prof = dataclasses.replace(PROFILE, meta=meta)
    plan = partition(prof, _cluster(), 4, num_stages=2, replicas=1, micro_batches=4, schedules=["GPipe"])
    p = plan.prediction
    assert p.data_us == pytest.approx(1000.0)
    parts = p.compute_us + p.bubble_us + p.p2p_us + p.allreduce_us + p.optimizer_us + p.host_us + p.data_us
    assert parts == pytest.approx(p.step_us)
    assert plan.notes["loader"] == "0.25 ms/sample, 0 workers, reads back every step"
    console = Console(record=True, width=200)
    print_plan(plan, console)
    assert "data 1.00" in console.export_text()


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Regression samples whose inputs get noise from torch's global generator (an augmentation)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(6, generator=g)
        return x + 0.1 * torch.randn(6), x.sum(0, keepdim=True)


class NoisyStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The same samples as a stream with its own generator, recording its position on itself."""

    def __init__(self) -> None:
        self.rng = torch.Generator().manual_seed(5)
        self.position = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for index in range(32):
            self.position = index
            x, y = Noisy()[index]
            yield x + 0.1 * torch.randn(6, generator=self.rng), y


class Regression(L.LightningModule):
    def __init__(self, data: str = "map-style") -> None:
        super().__init__()
        # built once, as a DataModule's setup() builds them: the strategy reads the very loader training reads
        self.stream = NoisyStream() if data == "iterable" else None
        self.shuffle = torch.Generator().manual_seed(3) if data == "own-shuffle" else None
        self.persistent = None
        if data == "persistent-workers":  # its workers draw the noise; a read aside must not keep them alive
            self.persistent = DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        if self.stream is not None:
            return DataLoader(self.stream, batch_size=4)
        if self.persistent is not None:
            return self.persistent
        return DataLoader(Noisy(), batch_size=4, shuffle=True, generator=self.shuffle)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(strategy: object, data: str = "map-style") -> Regression:
    torch.manual_seed(7)
    model = Regression(data)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=6, logger=False,  # type: ignore[arg-type]
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,  # the loader as given: its order drawn from torch's global generator
    )  # fmt: skip
    trainer.fit(model)
    return model


@pytest.mark.usefixtures("master_port")
@pytest.mark.parametrize("data", ["map-style", "iterable", "own-shuffle", "persistent-workers"])
def test_the_strategy_prices_its_loader_and_training_draws_the_same_data(data: str) -> None:
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=1, profile="estimate")
    got = _fit(strategy, data)
    assert strategy.plan is not None and strategy.plan.prediction.data_us > 0
    workers = 1 if data == "persistent-workers" else 0
    assert f"ms/sample, {workers} workers" in strategy.plan.notes["loader"]
    torch.distributed.destroy_process_group()
    assert got.losses == pytest.approx(_fit("auto", data).losses, rel=1e-5)  # same order, same noise


class SpentOnce(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Regression samples as a single stream: ``__iter__`` gives back one generator each time."""

    def __init__(self) -> None:
        self.samples = (Noisy()[i] for i in range(32))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return self.samples


class FromOneStream(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.data = SpentOnce()

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(self.data, batch_size=4)


@pytest.mark.usefixtures("master_port")
def test_a_single_stream_is_refused_before_a_batch_is_taken_from_it() -> None:
    model = FromOneStream()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=AutoPartitionStrategy(profile="estimate"), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"SpentOnce\) is a single stream: its __iter__ returns the same iterator"):
        trainer.fit(model)
    assert len(list(model.data)) == 32  # nothing was read from it
