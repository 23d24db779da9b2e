"""A forward that reads ``tensor.data`` (a weight clamped in place before use, as Gemma 3n's AltUp does in
training) is exported and trains as it does eagerly ([Note: .data in the forward] in
lightning_autopart/capture/data_reads.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from tests.eager import run_captured, run_stages

CLIP = 0.1


class Clipped(nn.Module):
    """A linear layer whose weight is clamped in place, around autograd, at each training call."""

    def __init__(self) -> None:
        super().__init__()
        self.coefs = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.coefs.weight.data.clamp_(-CLIP, CLIP)
        return self.coefs(x)


class Model(nn.Module):
    """Computes between its submodules (so module hooks cannot capture it) and scales by a statistic read
    through ``.data`` (no gradient through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.clipped = Clipped()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.clipped(self.embed(x))
        return self.head(h / h.data.abs().amax())


def _model() -> Model:
    torch.manual_seed(0)
    model = Model().train()
    with torch.no_grad():
        model.clipped.coefs.weight.mul_(4)  # beyond the clip: the forward's clamp changes it
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_weight_clamped_through_data_is_exported_and_trains_as_eagerly() -> None:
    model, x = _model(), torch.randn(3, 4)
    weight = model.clipped.coefs.weight
    before = weight.detach().clone()
    captured = capture(model, x)  # torch.export alone fails: "We found a fake tensor in the exported program"
    assert captured.method == "export"
    assert torch.equal(weight, before)  # capture leaves the model as it found it
    assert "data" not in vars(torch.Tensor)  # and Tensor.data as torch defines it
    model(x).square().sum().backward()
    eager, clamped = _grads(model), weight.detach().clone()
    assert clamped.abs().max() <= CLIP < before.abs().max()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        weight.copy_(before)
    run_captured(captured, x).square().sum().backward()
    assert torch.equal(weight, clamped)  # the clamp ran in the captured graph, on the parameter itself
    assert _grads(model).keys() == eager.keys()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, eager[name], msg=name)


@pytest.mark.parametrize("stages", [2, 3])
def test_forwards_of_several_micro_batches_run_before_their_backwards(stages: int) -> None:
    """A pipeline runs several forwards before their backwards: the clamp, a ``.data`` write as eagerly, must
    not bump the version of the weight the earlier forwards saved (``detach()`` would)."""
    model, x = _model(), torch.randn(3, 4)
    captured = capture(model, x)
    outs = [run_stages(captured, stages, x[i : i + 1]) for i in range(3)]
    for out in outs:
        out.square().sum().backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    for i in range(3):
        model(x[i : i + 1]).square().sum().backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(got[name], grad, msg=name)


def test_a_clamp_made_in_training_only_is_a_branch_on_the_mode() -> None:
    """The clamp feeds no output, yet evaluation mode, which skips it, runs other programs: the stages leave the
    weight as eager evaluation does."""
    model, x = _model(), torch.randn(3, 4)
    captured = capture(model, x, check_eval=True)
    assert captured.method == "export" and captured.eval_branches == ("clipped",)
    before = model.clipped.coefs.weight.detach().clone()
    model.eval()
    torch.testing.assert_close(run_stages(captured, 2, x), model(x))
    assert torch.equal(model.clipped.coefs.weight, before)
