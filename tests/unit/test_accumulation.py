"""A step of M micro-batches adds M - 1 of them into the gradients the first made, and the plan prices that
([Note: gradient accumulation] in lightning_autopart/profile/step.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_autopart.cluster import Cluster
from lightning_autopart.partition import partition
from lightning_autopart.profile import profile, resolve_spec
from lightning_autopart.profile.opcount import OpCounter
from lightning_autopart.profile.step import accumulate_us
from tests.unit.test_profile import chain

_ADD = "aten.add_.Tensor"


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_later_backwards_add_into_every_gradient() -> None:
    """What the note prices: the first backward keeps the gradients it makes, each later one adds into
    them."""
    model, x = _mlp(), torch.randn(4, 32)
    adds = []
    for _ in range(3):
        counter = OpCounter(keep_ops=True)
        with counter:
            counter.phase = "bwd"
            model(x).sum().backward()
        adds.append(sum(o.op == _ADD for o in counter.ops))
    assert adds == [0, 4, 4]  # two weights and two biases


def test_each_block_carries_its_accumulation_and_the_plan_adds_it_per_later_micro_batch() -> None:
    captured = chain(_mlp(), torch.randn(8, 32))
    prof = profile(captured, "estimate", spec="h100")
    spec = resolve_spec("h100")
    for block in prof.blocks:
        tensors = len(block.param_shapes)
        assert block.accumulate_us == pytest.approx(accumulate_us(block.grad_bytes, tensors, spec))
    assert [b.accumulate_us > 0 for b in prof.blocks] == [True, False, True]
    unpriced = tuple(dataclasses.replace(b, accumulate_us=0.0) for b in prof.blocks)
    zero = dataclasses.replace(prof, blocks=unpriced)
    cluster = Cluster.from_spec("h100", devices=1)
    total = sum(b.accumulate_us for b in prof.blocks)
    for micro in (1, 4):
        with_acc = partition(prof, cluster, 8, num_stages=1, micro_batches=micro).prediction.step_us
        without = partition(zero, cluster, 8, num_stages=1, micro_batches=micro).prediction.step_us
        assert with_acc - without == pytest.approx((micro - 1) * total)
