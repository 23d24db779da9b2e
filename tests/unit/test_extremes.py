"""A fill value captured as float32's extreme follows its tensor's dtype under autocast ([Note: dtype
extremes]): pipelined stages fill what the eager model fills, in float32 and in bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.extremes import dtype_extreme
from lightning_autopart.runtime.stages import build_stage_module
from tests.hf_architectures import SMALL, Architecture, build, inputs


class MaskedAttention(nn.Module):
    """Scores filled where masked with their dtype's minimum, by ``masked_fill`` or by ``where``."""

    def __init__(self, use_where: bool) -> None:
        super().__init__()
        self.qk, self.use_where = nn.Linear(8, 16), use_where

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-1, -2)
        low = torch.finfo(scores.dtype).min
        scores = torch.where(mask, scores, low) if self.use_where else scores.masked_fill(~mask, low)
        return scores.softmax(-1) @ x


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    mask = torch.rand(2, 5, 5) > 0.4
    mask[0, 1] = False  # a fully masked row: its softmax is uniform with a finite fill, NaN with -inf
    return torch.randn(2, 5, 8), mask


@pytest.mark.parametrize("use_where", [False, True])
def test_a_stage_fills_what_eager_fills_in_float32_and_under_autocast(use_where: bool) -> None:
    model, (x, mask) = MaskedAttention(use_where), _inputs()
    captured = capture(model, (x, mask))
    stage = build_stage_module(captured, 0, captured.num_blocks)
    torch.testing.assert_close(stage(x, mask)[0], model(x, mask), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = stage(x, mask)[0], model(x, mask)  # before: masked_fill raised, where made NaN rows
    assert got.dtype == want.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert isinstance(stage, torch.fx.GraphModule)
    assert any(n.target is dtype_extreme for n in stage.graph.nodes)  # read when the stage runs


def test_other_fill_values_stay_as_captured() -> None:
    class Fills(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.lin(x)
            return x.masked_fill(x > 0, -1e4) + torch.where(x < 0, x, float("-inf")).exp()

    model, x = Fills(), torch.randn(3, 4)
    captured = capture(model, (x,))
    stage = build_stage_module(captured, 0, captured.num_blocks)
    assert isinstance(stage, torch.fx.GraphModule)
    assert not any(n.target is dtype_extreme for n in stage.graph.nodes)
    torch.testing.assert_close(stage(x)[0], model(x), rtol=0, atol=0)


def test_deberta_v2_trains_in_bf16_mixed_through_its_captured_graph() -> None:
    """DeBERTa-v2's attention fills masked scores with ``finfo(query.dtype).min``: captured in float32, its
    stage raised "value cannot be converted to type c10::BFloat16 without overflow" under autocast."""
    padded: dict[str, tuple[int, ...]] = {"input_ids": (4, 12), "attention_mask": (4, 12)}
    arch = Architecture("DebertaV2Config", "DebertaV2ForMaskedLM", SMALL, padded)
    torch.manual_seed(0)
    model, batch = build(arch, "cpu", dropout=False), inputs(arch, "cpu")
    captured = capture(model, batch)
    stage = build_stage_module(captured, 0, captured.num_blocks)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(**batch).logits
        got = stage(batch["input_ids"], batch["attention_mask"])[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)
