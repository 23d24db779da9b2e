"""Capture's checks on a GPU: custom autograd Functions are checked on CUDA inputs, and checking one leaves
the CUDA generators as they were ([Note: custom autograd functions]); a stage captured on the CPU and moved
to the GPU runs its evaluation-mode program there ([Note: Python branches on the mode]), and fills masked
scores under CUDA's autocast as the eager model does ([Note: dtype extremes])."""

from __future__ import annotations

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


def test_a_function_on_cuda_is_checked_there() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Applies(Reverse), nn.Linear(4, 2)).cuda()
    x = torch.randn(3, 4, device="cuda")
    captured = capture(model, x)
    assert captured.method == "modules"
    assert_grads_equal_eager(model, captured, x)


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
