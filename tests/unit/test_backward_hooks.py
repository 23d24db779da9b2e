"""Backward hooks run in the captured stages as they run eagerly, or the capture is refused ([Note: backward
hooks] in lightning_autopart/capture/backward_hooks.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

from lightning_autopart.capture import capture
from lightning_autopart.errors import CaptureError
from tests.eager import assert_grads_equal_eager


class Halves(nn.Module):
    """Halves the gradient of its output with a tensor hook registered in its forward."""

    def __init__(self, guarded: bool = True) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.guarded = guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        if y.requires_grad or not self.guarded:
            y.register_hook(lambda g: g * 0.5)
        return y * 1.0


@pytest.mark.parametrize("guarded", [True, False])
def test_a_tensor_hook_in_a_forward_keeps_its_module_whole(guarded: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Halves(guarded), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "modules"  # an exported graph leaves tensor hooks out
    assert ("1",) in [b.modules for b in captured.blocks]  # the module that registers the hook runs whole
    assert any("Tensor.register_hook, in the forward of '1'" in n for n in captured.notes), captured.notes
    assert_grads_equal_eager(model, captured, x)


def test_a_tensor_hook_in_the_root_forward_is_refused() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            if x.requires_grad:
                x.register_hook(lambda g: g * 0.5)
            return self.b(x)

    with pytest.raises(CaptureError, match=r"registers hooks on tensors.*register them inside a submodule"):
        capture(Root(), torch.randn(3, 4))


def test_a_module_backward_hook_runs_in_the_stages() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "modules"
    assert any("module '1' of Sequential has backward hooks" in n for n in captured.notes), captured.notes
    assert_grads_equal_eager(model, captured, x)


def test_backward_hooks_above_the_blocks_make_their_module_one_block() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 2))
    inner.register_full_backward_pre_hook(lambda module, grad_out: (grad_out[0] * 2.0,))
    x = torch.randn(3, 4)
    captured = capture(model, x, max_blocks=16)
    assert ("1",) in [b.modules for b in captured.blocks]
    assert any(n.startswith("'1' is one block: Sequential has backward hooks") for n in captured.notes)
    assert_grads_equal_eager(model, captured, x)


@pytest.fixture
def global_backward_hook() -> Iterator[None]:
    handle = module_globals.register_module_full_backward_hook(lambda module, grad_in, grad_out: None)
    yield
    handle.remove()


def test_backward_hooks_on_the_root_are_refused(global_backward_hook: None) -> None:
    with pytest.raises(CaptureError, match=r"has backward hooks.*register them on its submodules"):
        capture(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), torch.randn(3, 4))


def test_parameter_hooks_need_nothing() -> None:
    """Gradient loggers hook parameters: the stages accumulate into the user's parameters, which run them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.register_hook(lambda g: g * 0.5)
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "export"
    assert_grads_equal_eager(model, captured, x)
