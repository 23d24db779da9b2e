"""Unit tests of partial profiles: a subset of blocks, merging parts (also from other devices), progress,
and a profile's round trip through a dict."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from lightning_autopart.errors import ProfileError
from lightning_autopart.profile import merge_profiles, profiled_blocks
from lightning_autopart.profile.records import ModelProfile
from tests.unit.test_profile import TiedLM, capture_tied, mlp, profile_cpu


def test_blocks_subset_and_merge_round_trip() -> None:
    cap = capture_tied(TiedLM(), torch.randint(0, 50, (4, 7)))
    full = profile_cpu(cap, "estimate", spec="a100", optimizer="adam")
    parts = [profile_cpu(cap, "estimate", spec="a100", optimizer="adam", blocks=b) for b in ([2, 0], [1])]
    assert profiled_blocks(parts[0]) == [0, 2] and parts[0].num_blocks == 2
    assert [b.name for b in parts[0].blocks] == ["emb", "head"]
    merged = merge_profiles(list(reversed(parts)))
    assert merged.blocks == full.blocks and merged.tied == full.tied
    assert merged.meta["profiled_blocks"] == [0, 1, 2] and merged.meta["per_block"] == full.meta["per_block"]
    assert merge_profiles([full]).blocks == full.blocks


def test_merge_errors() -> None:
    cap = mlp()
    a = profile_cpu(cap, "estimate", spec="a100", blocks=[0, 1])
    b = profile_cpu(cap, "estimate", spec="a100", blocks=[1, 2])
    with pytest.raises(ProfileError, match=r"block 1 .* held by both part 0 and part 1"):
        merge_profiles([a, b])
    with pytest.raises(ProfileError, match=r"no part holds blocks \[2\]"):
        merge_profiles([a])
    other = profile_cpu(cap, "estimate", spec="a100", optimizer="adam", blocks=[2])
    with pytest.raises(ProfileError, match="optimizer='adam'"):
        merge_profiles([a, other])
    with pytest.raises(ProfileError, match="at least one"):
        merge_profiles([])


def test_merge_measured_parts_across_devices() -> None:
    cap = mlp()
    parts = [profile_cpu(cap, blocks=[i], warmup=0, repeats=1) for i in range(3)]
    renamed = [ModelProfile.from_dict({**p.to_dict(), "device": f"cuda:{i}"}) for i, p in enumerate(parts)]
    assert merge_profiles(renamed).device == "cuda"
    assert merge_profiles(parts).device == "cpu"


def test_progress_called_once_per_block() -> None:
    calls: list[tuple[int, int, str]] = []
    profile_cpu(mlp(), "estimate", spec="a100", progress=lambda d, t, n: calls.append((d, t, n)))
    assert calls == [(1, 3, "0"), (2, 3, "1"), (3, 3, "2")]
    calls.clear()
    profile_cpu(mlp(), warmup=0, repeats=1, blocks=[2], progress=lambda d, t, n: calls.append((d, t, n)))
    assert calls == [(1, 1, "2")]


@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_to_dict_from_dict_round_trip(mode: str) -> None:
    prof = profile_cpu(capture_tied(TiedLM(), torch.randint(0, 50, (2, 3))), mode, spec="v100", repeats=1)
    data: dict[str, Any] = json.loads(json.dumps(prof.to_dict()))
    assert ModelProfile.from_dict(data) == prof
