"""Blocks of a "-mixed" profile run on their inputs in the dtypes autocast gives them ([Note: cut dtypes
under autocast]): a tensor two neighbouring blocks save is counted once, as in float32, and the profile's
saved bytes equal what real autocast saves over the whole model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.profile import profile
from lightning_autopart.profile.autocast_cuts import autocast_dtypes, with_autocast_dtypes
from lightning_autopart.profile.saved import SavedTensorMeter
from tests.unit.test_autocast_meta import _Residual


def _conv(channels: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())


def _convnet(channels_last: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    head = (nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    model = nn.Sequential(_conv(8), _conv(8), _conv(8), *head)
    x = torch.randn(4, 8, 12, 12)
    if channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        x = x.to(memory_format=torch.channels_last)
    return model, x


def test_a_conv_chain_crosses_its_cuts_in_bf16_and_a_residual_stream_in_float32() -> None:
    model, x = _convnet()
    cap = capture(model, (x,), max_blocks=6)
    dtypes = autocast_dtypes(cap, torch.bfloat16)
    convs = [t.name for k in range(3) for t in cap.cuts[k]]
    assert convs and all(dtypes[n] == torch.bfloat16 for n in convs)  # conv, batch norm, ReLU: all bf16
    assert dtypes[cap.blocks[-1].outputs[0].name] == torch.bfloat16  # the head's linear
    residual = capture(nn.Sequential(_Residual(16), _Residual(16)), (torch.randn(4, 16),), max_blocks=2)
    assert [autocast_dtypes(residual, torch.bfloat16)[t.name] for t in residual.cuts[0]] == [torch.float32]


def test_the_capture_is_left_as_it_was() -> None:
    model, x = _convnet()
    cap = capture(model, (x,), max_blocks=6)
    before = ([t.dtype for t in cap.cuts[0]], [a.dtype for a in cap.blocks[1].args])
    mixed, how = with_autocast_dtypes(cap, torch.bfloat16)
    assert how == "autocast on meta"
    assert (mixed.cuts[0][0].dtype, mixed.blocks[1].args[0].dtype) == ("bfloat16", torch.bfloat16)
    assert mixed.cuts[0][0].nbytes * 2 == cap.cuts[0][0].nbytes
    assert ([t.dtype for t in cap.cuts[0]], [a.dtype for a in cap.blocks[1].args]) == before


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_mixed_blocks_save_what_autocast_saves_over_the_whole_model(mode: str, channels_last: bool) -> None:
    """ResNet-50x4 at batch 32 in bf16-mixed was priced at 1.34x an H200's peak: every block ran on float32
    inputs, saved autocast's bf16 copy of them, and the ReLU output two blocks share was counted twice."""
    model, x = _convnet(channels_last)
    cap = capture(model, (x,), max_blocks=6)
    prof = profile(cap, mode, device="cpu", dtype="bf16-mixed", warmup=0, repeats=1)
    fp32 = profile(cap, mode, device="cpu", warmup=0, repeats=1)
    shared = [b.saved_by_previous for b in prof.blocks]
    assert shared == [b.saved_by_previous for b in fp32.blocks] and shared.count(1.0) == 2  # ReLU to conv
    cuts = [0] + [sum(t.nbytes for t in cut) // 2 for cut in cap.cuts[:-1]]  # bf16, as autocast leaves them
    pairs = zip(prof.blocks, cuts, strict=True)
    own = [b.activation_bytes - round(b.saved_by_previous * c) for b, c in pairs]
    planned = sum(own)
    weights = sum(p.numel() * 2 for p in model.parameters() if p.dim() > 1)  # their bf16 copies, saved apart
    meter = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers(), x])
    with meter.hooks(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).sum()
    assert planned + weights == meter.nbytes


def test_a_chain_that_fails_on_meta_keeps_the_old_assumption() -> None:
    model, x = _convnet()
    cap = capture(model, (x,), max_blocks=6)
    broken = dataclasses.replace(cap.blocks[1], args=cap.blocks[1].args[:0])  # no tensor for its input
    cap = dataclasses.replace(cap, blocks=[cap.blocks[0], broken, *cap.blocks[2:]])
    mixed, how = with_autocast_dtypes(cap, torch.bfloat16)
    assert how.startswith("assumed torch.bfloat16 (autocast on meta failed: ValueError")
    assert mixed.blocks[1].args == () and all(t.dtype == "bfloat16" for cut in mixed.cuts for t in cut)
