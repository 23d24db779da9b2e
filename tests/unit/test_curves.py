"""Cost curves: blocks priced at every micro-batch size from profiles at a few sizes, the loss on the last block."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopart.errors import ProfileError
from lightning_autopart.planner import profile_model
from lightning_autopart.profile.curves import curve_sizes, join_curves, resize_batch
from lightning_autopart.profile.loss import LossCost
from lightning_autopart.records import BlockProfile, ModelProfile, cost_at


def _block(curve: tuple[tuple[int, float, float, int, int, int], ...] = ()) -> BlockProfile:
    return BlockProfile("b", ("b",), (), 0, 0, 0, 0, 0, 80.0, 160.0, 8.0, 16.0, 800, 64, curve=curve)


def test_cost_at_interpolates_between_points_and_extends_the_last_segment() -> None:
    curve = ((1, 10.0, 20.0, 100, 50, 8), (4, 10.0, 20.0, 400, 50, 32), (16, 40.0, 80.0, 1600, 200, 128))
    block = _block(curve)
    assert cost_at(block, 1, 16).fwd_us == 10.0 and cost_at(block, 2, 16).fwd_us == 10.0  # memory bound: flat
    at10 = cost_at(block, 10, 16)
    assert (at10.fwd_us, at10.bwd_us, at10.activation_bytes, at10.cut_bytes) == (25.0, 50.0, 1000, 80)
    assert cost_at(block, 32, 16).fwd_us == pytest.approx(80.0)  # beyond the last point: its segment
    assert cost_at(block, 16, 16).transient_bytes == 200
    linear = cost_at(_block(), 4, 8)  # no curve: fixed + per-sample from the profile's batch
    assert (linear.fwd_us, linear.bwd_us, linear.activation_bytes, linear.cut_bytes) == (44.0, 88.0, 400, 32)


def test_sizes_and_resizing() -> None:
    assert curve_sizes(64) == [1, 4, 16, 64] and curve_sizes(512) == [1, 4, 16, 64, 256, 512]
    assert curve_sizes(1) == [1] and curve_sizes(6) == [1, 4, 6]
    x, y, flag = torch.arange(6).reshape(3, 2), torch.arange(3), 7
    small = resize_batch((x, y, flag), 3, 2)
    assert small[0].tolist() == [[0, 1], [2, 3]] and small[2] == 7
    big = resize_batch({"x": x, "y": y}, 3, 7)
    assert big["x"].shape == (7, 2) and big["y"].tolist() == [0, 1, 2, 0, 1, 2, 0]


def _profile(batch: int, names: list[str], scale: float) -> ModelProfile:
    blocks = tuple(
        BlockProfile(n, (n,), (), 0, 0, 0, 0, 0, scale, 2 * scale, 0, 0, batch * 10, batch * 4) for n in names
    )
    return ModelProfile(model="Toy", blocks=blocks, batch_size=batch, input_bytes=0)


def test_join_curves_adds_the_loss_to_the_last_block() -> None:
    profiles = {4: _profile(4, ["a", "b"], 5.0), 16: _profile(16, ["a", "b"], 20.0)}
    losses = {4: LossCost(1.0, 2.0, 30, 500), 16: LossCost(4.0, 8.0, 120, 2000)}
    joined = join_curves(profiles, losses)
    first, last = joined.blocks
    assert first.curve == ((4, 5.0, 10.0, 40, 0, 16), (16, 20.0, 40.0, 160, 0, 64))
    assert last.curve == ((4, 6.0, 12.0, 70, 500, 16), (16, 24.0, 48.0, 280, 2000, 64))
    assert (last.fwd_us, last.transient_bytes) == (24.0, 2000) and joined.batch_size == 16
    assert joined.meta["curve_sizes"] == [4, 16] and joined.meta["loss_priced"]
    other = dataclasses.replace(profiles[4], blocks=profiles[4].blocks[:1])
    with pytest.raises(ProfileError, match="other blocks than the one at batch 16"):
        join_curves({4: other, 16: profiles[16]})


def test_measured_curves_and_the_loss_of_a_training_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)), nn.Linear(64, 1000))
    x = torch.randn(16, 64)
    labels = torch.randint(0, 1000, (64,))

    def loss(output: torch.Tensor, samples: int) -> torch.Tensor:
        return F.cross_entropy(output, labels[:samples])

    bare = profile_model(model, x, profile="measure", spec="cpu", up_to=64)
    priced = profile_model(model, x, profile="measure", spec="cpu", up_to=64, loss=loss)
    for prof in (bare, priced):
        assert [p[0] for p in prof.blocks[0].curve] == [1, 4, 16, 64] and prof.batch_size == 64
        assert all(b.optimizer_us > 0 for b in prof.blocks)
    head, with_loss = bare.blocks[-1], priced.blocks[-1]
    # The cross entropy saves its log-softmax (64 x 1000 floats) and allocates a gradient as large.
    assert with_loss.activation_bytes >= head.activation_bytes + 64 * 1000 * 4
    assert with_loss.transient_bytes >= 64 * 1000 * 4
    assert priced.meta["loss_priced"] and "loss_error" not in priced.meta

    def broken(output: torch.Tensor, samples: int) -> torch.Tensor:
        raise ValueError("reads a value")

    failed = profile_model(model, x, profile="measure", spec="cpu", up_to=16, loss=broken)
    assert failed.meta["loss_error"] == "ValueError: reads a value"
