"""Custom autograd Functions keep their backward, and activation checkpointing its gradients, in a capture
([Note: custom autograd functions] in lightning_autopart/capture/functions.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.checkpoint as checkpointing
from torch import nn

from lightning_autopart.capture import capture
from tests.eager import assert_grads_equal_eager
from tests.idioms import Reverse


class StraightThrough(torch.autograd.Function):
    """Rounding with the gradient passed straight through (quantization-aware training); new style."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.round()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Square(torch.autograd.Function):
    """The derivative written by hand, saving the input: exporting it changes nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class TanhGelu(torch.autograd.Function):
    """BLOOM's GeLU: saves its input alone and recomputes the tanh in backward (its operations save five tensors)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class Applies(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x)


@pytest.mark.parametrize("function", [Reverse, StraightThrough])
def test_a_function_whose_backward_is_not_the_derivative_keeps_it(function: type) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Applies(function), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "modules"  # torch.export would differentiate the forward's operations instead
    assert any(function.__name__ in n and "not the derivative" in n for n in captured.notes), captured.notes
    assert_grads_equal_eager(model, captured, x)
    assert torch.autograd.Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"  # put back


def test_a_function_is_checked_on_meta_inputs_too() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Applies(Reverse), nn.Linear(4, 2))
        x = torch.randn(3, 4)
    assert capture(model, x).method == "modules"


def test_a_hand_written_derivative_is_exported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Applies(Square), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "export" and captured.notes == ()
    assert_grads_equal_eager(model, captured, x)


def test_a_function_that_saves_less_than_its_operations_is_exported_with_a_note() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), Applies(TanhGelu), nn.Linear(256, 8))
    x = torch.randn(16, 64)
    with pytest.warns(UserWarning, match=r"Function TanhGelu saves less .* hold 7.0x the bytes") as warned:
        captured = capture(model, x)
    assert captured.method == "export"
    assert_grads_equal_eager(model, captured, x)
    assert captured.notes == (str(warned[0].message),) and "torch.library.custom_op" in captured.notes[0]


def test_checking_a_function_leaves_the_random_generators_as_they_were() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), Applies(Square), nn.Linear(4, 2))
    state = torch.get_rng_state()
    assert capture(model, torch.ones(3, 4)).method == "export"  # Square was checked, on random inputs
    assert torch.equal(torch.get_rng_state(), state)


class Checkpointed(nn.Module):
    """A layer that checkpoints its activations, reentrant (torch's default) or not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(lambda t: self.layer(t).tanh(), x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_layers_get_their_gradients(reentrant: bool) -> None:
    """Reentrant checkpointing runs its forward under no_grad, which torch.export recorded: the layers it
    wrapped had no gradient at all. The capture runs checkpointed functions plainly and says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Checkpointed(reentrant), Checkpointed(reentrant), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "export" and captured.num_blocks == 4
    assert any("checkpointing (torch.utils.checkpoint, 2 calls)" in n for n in captured.notes), captured.notes
    assert_grads_equal_eager(model, captured, x)
    assert checkpointing.CheckpointFunction.__name__ == "CheckpointFunction"  # put back


def test_hugging_face_reentrant_gradient_checkpointing_trains_every_parameter() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    captured = capture(model, {"input_ids": ids})
    assert captured.method == "export" and captured.split_graph is not None
    model(input_ids=ids).logits.square().mean().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    captured.split_graph(ids)[0].square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, eager[name], msg=name)
