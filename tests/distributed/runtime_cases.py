"""The cases of the gloo runtime tests: data, losses and plans shared by the worker and the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_autopart.plan import Plan
from tests.pipeline_plans import make_plan

__all__ = ["BATCH", "MICRO", "STEPS", "batches", "loss_fn", "make_case_plan", "micro_example"]

#: Global batch size, micro-batch size and optimizer steps of every case.
BATCH, MICRO, STEPS = 8, 2, 3


def _data(model: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if model in ("gpt", "positional"):
        return torch.randint(0, 50, (n, 8), generator=g), torch.randint(0, 50, (n, 8), generator=g)
    if model == "residual":
        return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    return torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)


def micro_example(model: str) -> torch.Tensor:
    """Example inputs of one micro-batch (torch.export bakes the captured batch size into views)."""
    return _data(model, MICRO, torch.Generator().manual_seed(99))[0]


def batches(model: str, size: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global (inputs, target) batches of the ``STEPS`` steps."""
    g = torch.Generator().manual_seed(1)
    return [_data(model, size, g) for _ in range(STEPS)]


def loss_fn(model: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A mean loss for the model's output."""
    if model in ("gpt", "positional"):
        return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss


def make_case_plan(case: dict[str, Any], num_blocks: int) -> Plan:
    """The plan of a case: micro-batches of ``MICRO`` samples, pipeline-major ranks."""
    replicas = case["replicas"]
    return make_plan(
        num_blocks,
        case["stages"],
        replicas,
        schedule=case["schedule"],
        batch_size=BATCH,
        micro_batches=BATCH // (replicas * MICRO),
        chunks_per_rank=case.get("chunks", 1),
    )
