"""Normalizations that reduce over more than a thread block holds are priced at two passes over their input
([Note: normalization passes]): batch norm in training, group norm, layer norm's backward with weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_autopart.devices import device_spec
from lightning_autopart.profile.opcount import OpCounter, OpRecord, Roofline

X_SHAPE = (8, 16, 32, 32)
X_BYTES = math.prod(X_SHAPE) * 4  # float32
#: Slack for the small per-channel operands (weights, statistics) every norm op also moves.
SMALL = 64 * 1024


def _norm_ops(module: nn.Module, shape: tuple[int, ...] = X_SHAPE) -> dict[str, OpRecord]:
    """The norm ops a forward and a backward of ``module`` run on meta, by phase."""
    counter = OpCounter(Roofline.of(device_spec("h100"), "float32"), keep_ops=True)
    x = torch.randn(shape, device="meta", requires_grad=True)
    module = module.to("meta")
    with counter:
        counter.phase = "fwd"
        y = module(x)
        counter.phase = "bwd"
        y.backward(torch.ones_like(y))
    return {op.phase: op for op in counter.ops if "norm" in op.op}


def _passes(record: OpRecord) -> int:
    """The record's bytes in whole input-sized passes (the small operands are the rest)."""
    passes = int(record.nbytes // X_BYTES)
    assert record.nbytes - passes * X_BYTES < SMALL, record
    return passes


def test_batch_norm_in_training_reads_its_input_and_gradient_twice() -> None:
    ops = _norm_ops(nn.BatchNorm2d(16))
    assert "batch_norm" in ops["fwd"].op and "backward" in ops["bwd"].op
    assert _passes(ops["fwd"]) == 3  # input twice, output once
    assert _passes(ops["bwd"]) == 5  # gradient and input twice, the input's gradient once


def test_batch_norm_in_evaluation_is_one_pass() -> None:
    ops = _norm_ops(nn.BatchNorm2d(16).eval())
    assert _passes(ops["fwd"]) == 2


def test_group_norm_is_two_passes_both_ways() -> None:
    ops = _norm_ops(nn.GroupNorm(4, 16))
    assert _passes(ops["fwd"]) == 3
    assert _passes(ops["bwd"]) == 5


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_reads_again_for_its_weights_gradients_only(affine: bool) -> None:
    ops = _norm_ops(nn.LayerNorm(32, elementwise_affine=affine))
    assert _passes(ops["fwd"]) == 2  # a row stays in registers
    assert _passes(ops["bwd"]) == (5 if affine else 3)


def test_other_ops_move_their_operands_once() -> None:
    counter = OpCounter(keep_ops=True)
    x = torch.randn(X_SHAPE, device="meta")
    with counter:
        counter.phase = "fwd"
        torch.relu(x)
    assert [op.nbytes for op in counter.ops] == [2 * X_BYTES]
