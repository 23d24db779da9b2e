"""Fixed and per-sample time from two batch sizes; blocks timed together in stage order."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.errors import ProfileError
from lightning_autopart.planner import profile_model
from lightning_autopart.profile import profile
from lightning_autopart.profile.scaling import fit_fixed_costs, small_batch
from lightning_autopart.records import BlockProfile, ModelProfile


def _profile(batch: int, times: list[tuple[float, float]], launch: float = 1.0) -> ModelProfile:
    blocks = tuple(
        BlockProfile(f"b{i}", (f"b{i}",), (), 0, 0, 0, 0, 0, f, b, launch, 2 * launch, 0, 0)
        for i, (f, b) in enumerate(times)
    )
    return ModelProfile(model="Toy", blocks=blocks, batch_size=batch, input_bytes=0)


def test_the_line_through_both_batches_gives_the_fixed_part() -> None:
    # Block 0: 10 us + 1 us/sample forward, 30 + 2/sample backward. Block 1: purely per-sample.
    large = _profile(64, [(10 + 64, 30 + 128), (64.0, 128.0)])
    small = _profile(8, [(10 + 8, 30 + 16), (8.0, 16.0)])
    fitted = fit_fixed_costs(large, small)
    first, second = fitted.blocks
    assert first.fwd_fixed_us == pytest.approx(10) and first.bwd_fixed_us == pytest.approx(30)
    assert (first.fwd_us, first.bwd_us) == (74, 158)  # the measured times stay
    # A line through the origin keeps the kernel-count floor; the record says which batches were used.
    assert second.fwd_fixed_us == pytest.approx(1.0) and second.bwd_fixed_us == pytest.approx(2.0)
    assert fitted.meta["fixed_fit_batches"] == [64, 8]


def test_noise_cannot_make_the_fixed_part_exceed_most_of_the_time() -> None:
    # The forward ran slower on fewer samples (noise): its line would put 61 us of 50 in the fixed part.
    fitted = fit_fixed_costs(_profile(64, [(50.0, 100.0)]), _profile(8, [(60.0, 90.0)]))
    assert fitted.blocks[0].fwd_fixed_us == pytest.approx(0.9 * 50.0)
    assert fitted.blocks[0].bwd_fixed_us == pytest.approx((90 * 64 - 100 * 8) / 56)  # 88.6 of 100: kept


def test_mismatched_profiles_are_refused() -> None:
    with pytest.raises(ProfileError, match="smaller second batch, got 64 against 8"):
        fit_fixed_costs(_profile(8, [(1.0, 2.0)]), _profile(64, [(1.0, 2.0)]))
    other = dataclasses.replace(_profile(8, [(1.0, 2.0)]), blocks=(_profile(8, [(1.0, 2.0)]).blocks[0],) * 2)
    with pytest.raises(ProfileError, match="other blocks than the one at batch 64"):
        fit_fixed_costs(_profile(64, [(1.0, 2.0)]), other)
    assert [small_batch(b) for b in (1, 2, 8, 64, 100)] == [0, 1, 1, 8, 12]


def test_measure_mode_fits_fixed_times_and_times_blocks_in_order() -> None:
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(10)))
    prof = profile_model(model, torch.randn(16, 32), profile="measure", spec="cpu")
    assert prof.meta["fixed_fit_batches"] == [16, 2]
    assert all(0 <= b.fwd_fixed_us <= 0.9 * b.fwd_us and b.bwd_us > 0 for b in prof.blocks)
    # Ten blocks are timed as two windows (at most 8 together) and every block gets its own record.
    captured = capture(model, torch.randn(16, 32))
    alone = profile(captured, "measure", device="cpu", warmup=1, repeats=2)
    assert [b.name for b in alone.blocks] == [b.name for b in prof.blocks] and alone.num_blocks == 10
