"""Capture's checks on a GPU: custom autograd Functions are checked on CUDA inputs and kept whole, one captured
on the CPU trains on the GPU under CUDA's autocast, and checking one leaves the CUDA generators as they were
([Note: custom autograd functions], [Note: Functions kept whole]); a stage captured on the CPU and moved
to the GPU runs its evaluation-mode program there ([Note: Python branches on the mode]), and fills masked
scores under CUDA's autocast as the eager model does ([Note: dtype extremes]); a view of attention's output
captured on the CPU holds on the layout CUDA's kernel gives it ([Note: views on any layout])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.runtime.runner import move_in_place
from lightning_autopart.runtime.stages import build_stage_module
from tests.eager import assert_grads_equal_eager
from tests.idioms import Reverse
from tests.unit.test_autograd_functions import Applies, Square
from tests.unit.test_eval_branches import Residual, _model
from tests.unit.test_extremes import MaskedAttention, _inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_function_on_cuda_is_checked_there_and_kept_whole() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Applies(Reverse), nn.Linear(4, 2)).cuda()
    x = torch.randn(3, 4, device="cuda")
    captured = capture(model, x)
    assert captured.method == "export" and any("Reverse runs whole" in n for n in captured.notes)
    assert_grads_equal_eager(model, captured, x)


class ClippedProduct(torch.autograd.Function):
    """A product with a clipped gradient, written for CUDA's autocast (``custom_fwd``/``custom_bwd``)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        grad = grad.clamp(-0.05, 0.05)
        return grad @ w.t(), x.t() @ grad


class _Clipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ClippedProduct.apply(x, self.w)


def test_a_kept_function_captured_on_the_cpu_trains_on_cuda_under_autocast_as_eagerly() -> None:
    """The operator's backward runs the Function's forward again under the CUDA autocast it ran in
    ([Note: Functions kept whole])."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), _Clipped(), nn.Linear(8, 2)), torch.randn(5, 8)
    captured = capture(model, x)  # on the CPU, as the strategy captures before moving
    assert captured.method == "export"
    stage = build_stage_module(captured, 0, captured.num_blocks)
    move_in_place(stage, torch.device("cuda"))
    x = x.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = model(x)
    want.float().square().sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = stage(x)[0]
    assert got.dtype == want.dtype == torch.bfloat16
    got.float().square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, eager[name], msg=name)


def test_checking_a_function_leaves_the_cuda_generators_as_they_were() -> None:
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    for device in ("cpu", "cuda"):
        model = nn.Sequential(nn.Linear(4, 4), Applies(Square), nn.Linear(4, 2)).to(device)
        assert capture(model, torch.ones(3, 4, device=device)).method == "export"
        assert torch.equal(torch.cuda.get_rng_state(), state), device


def test_a_stage_moved_to_cuda_runs_its_evaluation_program_there() -> None:
    model, x = _model(Residual(0.5)), torch.randn(4, 8)
    captured = capture(model, x, check_eval=True)  # on the CPU, as the strategy captures before moving
    assert captured.evaluates
    stage = build_stage_module(captured, 0, captured.num_blocks)
    move_in_place(stage, torch.device("cuda"))
    model.eval()
    got = stage(x.cuda())[0]
    assert got.device.type == "cuda"
    torch.testing.assert_close(got, model(x.cuda()))  # no path dropped
    model.train()
    stage(x.cuda())[0].sum().backward()  # and training runs the training program, on the GPU
    assert model[3].layer.weight.grad is not None and model[3].layer.weight.grad.device.type == "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_stage_fills_masked_scores_under_cuda_autocast_as_eager_does(dtype: torch.dtype) -> None:
    model, (x, mask) = MaskedAttention(use_where=False), _inputs()
    captured = capture(model, (x, mask))  # on the CPU, in float32
    stage = build_stage_module(captured, 0, captured.num_blocks)
    move_in_place(stage, torch.device("cuda"))
    x, mask = x.cuda(), mask.cuda()
    with torch.autocast("cuda", dtype=dtype):
        got, want = stage(x, mask)[0], model(x, mask)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_view_after_grouped_attention_captured_on_the_cpu_runs_on_cuda_in_float32() -> None:
    """[Note: views on any layout]: captured on the CPU, whose flash kernel made the ``contiguous()`` after
    attention a no-op (none recorded), the stage runs on CUDA, whose math path (grouped heads in float32)
    lays the output out otherwise; the view that followed it copies there, as ``contiguous()`` does eagerly."""
    from tests.unit.test_capture_idioms import GroupedAttention

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), GroupedAttention()), torch.randn(2, 6, 16)
    captured = capture(model, x)
    stage = build_stage_module(captured, 0, captured.num_blocks)
    move_in_place(stage, torch.device("cuda"))
    got = stage(x.cuda())[0]
    torch.testing.assert_close(got, model(x.cuda()))
