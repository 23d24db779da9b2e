"""Cost curves: blocks priced at every micro-batch size from profiles at a few sizes, the loss on the last block."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopart.errors import ProfileError
from lightning_autopart.planner import profile_model
from lightning_autopart.profile.curves import add_loss, curve_sizes, estimate_sizes, join_curves, resize_batch
from lightning_autopart.profile.loss import LossCost
from lightning_autopart.profile.records import BlockProfile, ModelProfile, cost_at


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
    assert estimate_sizes(24) == [1, 2, 4, 8, 16, 24] and estimate_sizes(1) == [1]
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
    joined = add_loss(join_curves(profiles), losses)
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


def test_the_loss_between_and_beyond_its_sizes() -> None:
    profiles = {1: _profile(1, ["a"], 1.0), 4: _profile(4, ["a"], 4.0), 16: _profile(16, ["a"], 16.0)}
    losses = {1: LossCost(1.0, 2.0, 10, 100), 4: LossCost(4.0, 8.0, 40, 400)}  # labels for 4 samples only
    last = add_loss(join_curves(profiles), losses).blocks[-1]
    assert [p[1] for p in last.curve] == [2.0, 8.0, 32.0]  # at 16: the line through 1 and 4 gives 16
    assert [p[3] for p in last.curve] == [20, 80, 320]
    flat = add_loss(_profile(8, ["a"], 8.0), {8: LossCost(2.0, 3.0, 5, 7)}).blocks[-1]
    assert (flat.fwd_us, flat.bwd_us, flat.activation_bytes, flat.curve) == (10.0, 19.0, 85, ())


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(256, 256) for _ in range(3)))
        self.head = nn.Linear(256, 4000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_estimated_curves_price_every_size_and_the_loss() -> None:
    """Estimate mode: two meta captures give every block a point at each power of two, priced as a capture at
    that size would be, and the loss (on meta) lands on the last block at each size."""
    with torch.device("meta"):
        model = _Head()
    x = torch.empty(2, 256, device="meta")
    labels = torch.zeros(64, dtype=torch.long)

    def loss(output: torch.Tensor, samples: int) -> torch.Tensor:
        return F.cross_entropy(output, labels[:samples].to(output.device))

    prof = profile_model(model, x, profile="estimate", spec="a100-40gb", up_to=64, loss=loss)
    assert prof.batch_size == 64 and prof.meta["curve_sizes"] == [1, 2, 4, 8, 16, 32, 64]
    assert prof.meta["loss_priced"] and "tf32_matmuls" in prof.meta
    for size in (8, 64):  # each point is what a profile captured at that size gives
        alone = profile_model(model, torch.empty(size, 256, device="meta"), profile="estimate", spec="a100-40gb")
        for block, exact in zip(prof.blocks[:-1], alone.blocks[:-1], strict=True):
            point = next(p for p in block.curve if p[0] == size)
            assert point[1] == pytest.approx(exact.fwd_us, rel=1e-6)
            assert point[2] == pytest.approx(exact.bwd_us, rel=1e-6)
            assert point[3] == exact.activation_bytes and point[5] == exact.cut_bytes
    head = [p for p in prof.blocks[-1].curve]
    assert head[-1][3] >= 64 * 4000 * 4  # the cross entropy's saved log-softmax at 64 samples
    assert head[-1][4] >= 64 * 4000 * 4  # and the logits' gradient
    bf16 = profile_model(model, x, profile="estimate", spec="a100-40gb", up_to=64, dtype="bf16-mixed")
    assert bf16.blocks[0].curve[-1][3] < prof.blocks[0].curve[-1][3]  # saved in bfloat16
    # Autocast's copies the backward keeps: none in the first layer (its input needs no gradient, so its
    # weight's copy dies with the matmul), the weight's alone in the next (a bias's gradient needs no bias).
    assert [b.cast_bytes for b in bf16.blocks[:2]] == [0, 256 * 256 * 2]


def _eager_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves in one eager forward, one count per storage, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(n for key, n in seen.items() if key not in params)


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_a_tensor_two_blocks_save_counts_once_in_a_stage(mode: str) -> None:
    """A ResNet block's output is saved by its last ReLU and by the next block's first convolution: one tensor
    in one stage (see [Note: saved twice]); across a stage boundary the receiver holds its own copy."""
    from examples.resnet import ResNet
    from lightning_autopart.cluster import Cluster
    from lightning_autopart.partition import partition

    torch.manual_seed(0)
    model = ResNet(depth=50, width_factor=1, image_size=32, num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    eager = _eager_saved_bytes(model, x)
    prof = profile_model(model, x, profile=mode, spec="cpu" if mode == "measure" else "a100-40gb")
    assert sum(b.activation_bytes for b in prof.blocks) > 1.2 * eager  # each block counted alone
    assert sum(b.saved_by_previous > 0 for b in prof.blocks) >= 10
    cluster = Cluster.from_spec("a100-40gb", devices=2)
    one = partition(prof, cluster, 4, num_stages=1, replicas=1, micro_batches=1)
    assert one.stages[0].activation_bytes == pytest.approx(eager, rel=0.04)
    two = partition(prof, cluster, 4, num_stages=2, micro_batches=2)
    start = two.stages[1].block_start
    received = prof.blocks[start].saved_by_previous * prof.blocks[start - 1].cut_bytes / 2  # half the batch
    assert two.stages[1].activation_bytes >= received


def test_a_size_batch_norm_cannot_profile_is_left_out_of_the_curve() -> None:
    """Training-mode BatchNorm needs two values per channel: at one sample and a 1x1 map it fails, and the
    measured curve starts at the next size instead of failing the plan."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2))
    prof = profile_model(model, torch.randn(8, 3, 4, 4), profile="measure", spec="cpu", up_to=16)
    assert [p[0] for p in prof.blocks[0].curve] == [4, 16]
    assert prof.meta["curve_skipped"][0].startswith("1: CaptureError")
