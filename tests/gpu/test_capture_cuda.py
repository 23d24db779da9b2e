"""Capture's checks on a GPU: custom autograd Functions are checked on CUDA inputs, and checking one leaves
the CUDA generators as they were ([Note: custom autograd functions])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from tests.eager import assert_grads_equal_eager
from tests.idioms import Reverse
from tests.unit.test_autograd_functions import Applies, Square

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
