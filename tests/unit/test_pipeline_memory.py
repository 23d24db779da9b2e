"""What a profile records for the memory a pipeline moves ([Note: pipeline buffers] in partition/cost.py): which
share of a cut a block saves as it is, the batch every rank holds, and a loss that saves its targets."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_autopart.cluster import Cluster
from lightning_autopart.lightning.step_loss import step_loss
from lightning_autopart.partition.tables import CostTables
from lightning_autopart.planner import profile_model
from lightning_autopart.profile.loss import batch_bytes, profile_loss
from lightning_autopart.profile.records import cost_at
from lightning_autopart.profile.step_checks import step_flow


class Chain(nn.Module):
    """Linear (saves its input), ReLU (saves its output), Linear, then a Tanh (saves its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.ReLU()
        self.c = nn.Linear(32, 16)
        self.d = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


def test_blocks_record_the_shares_of_their_cuts_they_save() -> None:
    prof = profile_model(Chain(), torch.randn(8, 16), profile="estimate", up_to=8)
    shares = {b.name: (b.saved_input_share, b.saved_output_share) for b in prof.blocks}
    assert shares["a"] == (1.0, 0.0)  # the model's input, saved for the weight's gradient
    assert shares["b"] == (0.0, 1.0)  # ReLU's backward reads its output
    assert shares["c"][0] == 1.0  # the ReLU's output, which block b saves too
    assert shares["d"] == (0.0, 1.0)


class Projections(nn.Module):
    """An attention's projections as blocks of their own (ALBERT's shared layer is captured so): ``q``, ``k`` and
    ``v`` each save the same input ``h``, which goes on past them to ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.q, self.k, self.v = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.out = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        return self.out(torch.cat([h, q, k, v], dim=-1))


def test_an_input_several_blocks_save_is_one_tensor_in_a_stage() -> None:
    prof = profile_model(Projections(), torch.randn(8, 16), profile="estimate", up_to=8)
    blocks = {b.name: b for b in prof.blocks}
    assert all(blocks[n].activation_bytes == 8 * 32 * 4 for n in "qkv")  # each saves h, profiled apart
    # k and v save the h that the block before them saves too (q's input, k's input): one tensor in a stage
    assert (blocks["k"].saved_by_previous, blocks["v"].saved_by_previous) == (0.5, pytest.approx(1 / 3))
    assert blocks["v"].saved_output_share == 0.25  # h goes on to out as v saved it: no second copy held
    cluster = Cluster(
        nodes=1, devices_per_node=1, device_memory_bytes=1 << 30, intra_node_bw=1e6, inter_node_bw=1e5,
        intra_allreduce_bw=1e3, inter_allreduce_bw=1e2,
    )
    at = CostTables(prof, cluster).at(8)
    # a stage of q and k receives h and sends it on, saved: its activations hold it, its sends are no copy
    assert (at.passed_through(1, 3), at.relayed_through(1, 3)) == (0, 8 * 32 * 4)
    whole = at.acts[-1] - at.acts[0] + at.shared[0]  # one stage: x, h and the concatenation, once each
    assert whole == (8 * 16 + 8 * 32 + 8 * 128) * 4 + sum(
        b.activation_bytes for b in prof.blocks if b.name not in ("inp", "q", "k", "v", "out")
    )


class StepLike:
    """What the strategy's step loss carries: the batch it was made from and its size."""

    def __init__(self, batch: object, batch_size: int) -> None:
        self.batch, self.batch_size = batch, batch_size
        self.sliced: object = ()

    def __call__(self, output: torch.Tensor, samples: int) -> torch.Tensor:
        self.sliced = part = self.batch["y"][:samples]  # type: ignore[index]
        return F.mse_loss(output, part)


def test_the_batch_every_rank_holds_counts_labels_and_follows_a_true_precision() -> None:
    batch = {"x": torch.randn(8, 16), "ids": torch.zeros(8, 4, dtype=torch.long), "y": torch.randn(8, 16)}
    loss = StepLike(batch, 8)
    assert batch_bytes(loss) == 16 * 4 + 4 * 8 + 16 * 4
    assert batch_bytes(loss, torch.bfloat16) == 16 * 2 + 4 * 8 + 16 * 2  # "-true" converts floating tensors
    assert batch_bytes(lambda out, n: out.sum()) is None  # a loss that carries no batch
    prof = profile_model(Chain(), torch.randn(8, 16), profile="estimate", up_to=8, loss=loss)
    assert prof.meta["batch_bytes"] == 16 * 4 + 4 * 8 + 16 * 4


def test_what_a_loss_saves_of_the_batch_is_not_the_loss_s_own() -> None:
    # MSE saves its input and its target; the target is a slice of the batch, held anyway.
    batch = {"y": torch.randn(8, 16)}
    loss = StepLike(batch, 8)
    cost = profile_loss(loss, torch.randn(8, 16), 8, warmup=0, repeats=1)
    assert cost.saved_bytes == 0  # the output is the stage's, the target the batch's
    assert cost.output_saved_bytes == 8 * 16 * 4  # what it saves of the output, told apart
    assert loss.sliced == ()  # no copy of the batch outlives the profile
    logits, labels = torch.randn(8, 10), torch.zeros(8, dtype=torch.long)
    entropy = profile_loss(lambda out, n: F.cross_entropy(out, labels[:n]), logits, 8, warmup=0, repeats=1)
    assert entropy.output_saved_bytes == 0 and entropy.saved_bytes >= 8 * 10 * 4  # its log-softmax, not the logits


class _Regressor(L.LightningModule):
    """A training step whose loss reads one column of the batch and not the other (the model's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(16, 16)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return (self.model(batch["x"]).square() - batch["y"]).square().mean()


def test_a_batch_on_another_device_than_the_output_is_not_the_loss_s_memory() -> None:
    """Estimate mode's outputs are on meta and the strategy's batch is not. On the device the last stage reads
    a view of the batch it holds, so a copy of its slice is not the loss's (the profile places the batch on
    the output's device first): on meta the loss costs what it costs beside the batch. Here it saves the
    difference, and its backward peaks at the mean's gradient, the outer square's power and two products, and
    two scalars."""
    batch = {"x": torch.randn(8, 16), "y": torch.randn(8, 16)}
    costs = {}
    for device in ("cpu", "meta"):
        loss = step_loss(_Regressor(), "model", batch, 8)
        costs[device] = profile_loss(loss, torch.randn(8, 16, device=device), 8, warmup=0, repeats=1)
        assert loss.sliced == () and loss._placed is None  # nothing left on the device
    tensor = 8 * 16 * 4
    for cost in costs.values():
        assert (cost.saved_bytes, cost.output_saved_bytes, cost.transient_bytes) == (tensor, tensor, 4 * tensor + 8)


class _Returning(_Regressor):
    """A step that returns its predictions (with their graph), a count and a name beside the loss."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:  # type: ignore[override]
        out = self.model(batch["x"])
        self.log("train_error", (out - batch["y"]).abs().mean())
        return {"loss": F.mse_loss(out, batch["y"]), "preds": out, "n": torch.tensor(8.0), "tag": "fit"}


def test_the_step_loss_keeps_only_numbers_of_what_the_step_returns_and_logs() -> None:
    """Profiling runs the step with its graph on the device: what it returns beside the loss (its predictions,
    their graph) is not kept past the run, only its numbers, detached, for the planner's combine checks; a
    traced call (fake tensors) leaves the last run's numbers as they were."""
    loss = step_loss(_Returning(), "model", {"x": torch.randn(8, 16), "y": torch.randn(8, 16)}, 8)
    profile_loss(loss, torch.randn(8, 16, requires_grad=True), 8, warmup=0, repeats=1)
    assert set(loss.returned) == {"n"} and loss.returned["n"].grad_fn is None
    assert loss.logged["train_error"].grad_fn is None
    before = (loss.returned["n"], loss.logged["train_error"])
    step_flow(loss, {2: torch.randn(2, 16), 4: torch.randn(4, 16)}, 8)
    assert (loss.returned["n"], loss.logged["train_error"]) == before


class _Watched(_Regressor):
    """A regressor whose step notes whether its step loss holds the batch placed, and raises at call ``fail``
    (the notes in a private attribute: a planning run restores the module's public ones)."""

    def __init__(self, fail: int | None = None) -> None:
        super().__init__()
        self.fail = fail
        self._placed_seen: list[bool] = []
        self.loss: Any = None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._placed_seen.append(self.loss._placed is not None)
        if len(self._placed_seen) == self.fail:
            raise RuntimeError("the user's loss failed")
        return super().training_step(batch, batch_idx)


def _watched(module: _Watched, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[torch.device | None]]:
    """The step loss of ``module`` and the devices its ``place`` is called with, in order."""
    loss = module.loss = step_loss(module, "model", {"x": torch.randn(8, 16), "y": torch.randn(8, 16)}, 8)
    calls: list[torch.device | None] = []
    real = loss.place

    def place(device: torch.device | None) -> None:
        calls.append(device)
        real(device)

    monkeypatch.setattr(loss, "place", place)
    return loss, calls


def test_the_timed_runs_read_the_batch_placed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measure mode's timed runs read the batch the profile placed before the metered run, as the last stage
    reads the batch it holds: no run copies its slice to the device and times the copy."""
    module = _Watched()
    loss, calls = _watched(module, monkeypatch)
    profile_loss(loss, torch.randn(8, 16), 8, warmup=1, repeats=2)
    assert module._placed_seen == [True] * 4  # the metered run and the three timed runs
    assert calls == [torch.device("cpu"), None]  # placed once before them, dropped once after
    assert loss.sliced == () and loss._placed is None


@pytest.mark.parametrize("fail", [1, 3], ids=["metered", "timed"])
def test_a_loss_that_raises_leaves_no_batch_placed(fail: int, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _Watched(fail)
    loss, calls = _watched(module, monkeypatch)
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        profile_loss(loss, torch.randn(8, 16), 8, warmup=1, repeats=2)
    assert len(module._placed_seen) == fail and calls[-1] is None
    assert loss.sliced == () and loss._placed is None  # nothing left on the device


def test_what_a_loss_saves_of_the_output_is_told_apart_from_its_own_saves_and_transient() -> None:
    # The same work, but the second loss saves a tensor of its own (o + 0) where the first saves the output.
    out = torch.randn(64, 256)
    of_output = profile_loss(lambda o, n: o.square().mean(), out, 64, warmup=0, repeats=1)
    own = profile_loss(lambda o, n: (o + 0).square().mean(), out, 64, warmup=0, repeats=1)
    assert (of_output.output_saved_bytes, of_output.saved_bytes) == (64 * 256 * 4, 0)
    assert (own.output_saved_bytes, own.saved_bytes) == (0, 64 * 256 * 4)
    assert of_output.transient_bytes == own.transient_bytes  # the output was allocated before the loss ran


@pytest.mark.parametrize("loss", ["mse", "cross_entropy", None])
def test_the_last_stage_holds_what_its_loss_saves_of_the_output(loss: str | None) -> None:
    """The runtime drops the model's outputs once the loss is computed ([Note: the last stage's outputs]): a
    priced loss's saves of them are the last block's activations, and no output is held besides; an unpriced
    loss might save it all, so all of it is held."""
    x = torch.randn(8, 16)
    fns: dict[str | None, Any] = {
        "mse": lambda out, n: (out**2).mean(),  # saves its input, the output
        "cross_entropy": lambda out, n: F.cross_entropy(out, out.new_zeros(n, dtype=torch.long)),
        None: None,
    }
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))  # the last block saves none of its output
    plain = profile_model(model, x, profile="estimate", up_to=8)
    prof = profile_model(model, x, profile="estimate", up_to=8, loss=fns[loss])
    cluster = Cluster(
        nodes=1, devices_per_node=2, device_memory_bytes=1 << 30, intra_node_bw=1e6, inter_node_bw=1e5,
        intra_allreduce_bw=1e3, inter_allreduce_bw=1e2,
    )
    tables = CostTables(prof, cluster)
    at = tables.at(4)
    output = 4 * 16 * 4  # a micro-batch's output bytes
    assert at.cuts[-1] == output
    grown = cost_at(prof.blocks[-1], 4, 8).activation_bytes - cost_at(plain.blocks[-1], 4, 8).activation_bytes
    if loss is None:
        assert at.held[-1] == output and grown == 0
    elif loss == "mse":  # the loss saves the output: the block's activations, not held
        assert at.held[-1] == 0 and grown == output
    else:  # its log-softmax (and labels), no part of the output
        assert at.held[-1] == 0 and grown >= 4 * 16 * 4


class Carry(nn.Module):
    """``x``, ``keep`` (bool) and ``scale`` (int64) reach the last block as they came in."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Tanh()
        self.c = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, self.c(self.b(self.a(x))) + x * scale, 0.0)


def test_what_a_stage_sends_on_as_received_is_not_held_twice() -> None:
    """An output a stage received as it is (an earlier block made it, none of the stage's blocks saves it) is its
    receive buffer or the batch: not held again ([Note: pipeline buffers] in partition/cost.py). A one-byte
    value travels converted ([Note: wire format] in runtime/wire.py), so a copy is held."""
    from lightning_autopart.partition.configs import Config
    from lightning_autopart.partition.scoring import evaluate_config

    n = 8
    inputs = (torch.randn(n, 16), torch.rand(n, 16) > 0.5, torch.randint(0, 3, (n, 16)))
    prof = profile_model(Carry(), inputs, profile="estimate", up_to=8)
    assert [b.name for b in prof.blocks][:2] == ["a", "b"]
    x, keep, scale = 16 * 4, 16, 16 * 8  # per sample
    cut_a, cut_b = x + keep + scale + 32 * 4, x + keep + scale + 32 * 4
    # a's Linear saves x as it passes it on; keep is one byte wide
    assert prof.blocks[0].passed_shares == ((-1, pytest.approx(scale / cut_a)),)
    assert prof.blocks[0].saved_passed_shares == ((-1, pytest.approx(x / cut_a)),)
    assert prof.blocks[1].passed_shares == ((-1, pytest.approx((x + scale) / cut_b)),)
    assert prof.blocks[1].saved_passed_shares == ()
    cluster = Cluster(
        nodes=1, devices_per_node=2, device_memory_bytes=1 << 30, intra_node_bw=1e6, inter_node_bw=1e5,
        intra_allreduce_bw=1e3, inter_allreduce_bw=1e2,
    )
    at = CostTables(prof, cluster).at(2)
    assert at.passed_through(0, 2) == at.passed_through(1, 2) == 2 * (x + scale)
    assert at.passed_through(0, 1) == 2 * scale and at.passed_through(0, 3) == 0  # the model's outputs
    # what a stage sends as received, saved or not: no copy kept with its finished sends either
    assert at.relayed_through(0, 1) == at.relayed_through(0, 2) == 2 * (x + scale)
    # Stage [0, 2) of a 2-stage 1F1B holds 2 micro-batches of 2 samples in flight; without the record it held a
    # copy of x and scale for each.
    cfg, ends = Config(1, 2, 4, "1F1B"), (0, 2, len(prof.blocks))
    stripped = dataclasses.replace(
        prof, blocks=tuple(dataclasses.replace(b, passed_shares=()) for b in prof.blocks)
    )
    now, before = (evaluate_config(CostTables(p, cluster), cfg, 8, ends).stages[0] for p in (prof, stripped))
    assert now.in_flight == 2
    assert before.memory_bytes - now.memory_bytes == before.io_bytes - now.io_bytes == 2 * 2 * (x + scale)
