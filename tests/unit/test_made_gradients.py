"""[Note: gradients made by the peak] in profile/transient.py: where backward makes the parameters' gradients
instead of adding into them, those it has made by its peak are there too, and the profile says how many."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopart.planner import profile_model
from tests.census import PeakTracker


class MLP(nn.Module):
    """Two layers in one block: its backward peaks in the first, after the second's weight gradient is made."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _backward_peak(block: nn.Module, x: torch.Tensor, fresh: bool) -> int:
    """The peak bytes a forward and backward of ``block`` allocate, its gradients made (``fresh``) or added
    into gradients that exist (zeros)."""
    for p in block.parameters():
        p.grad = None if fresh else torch.zeros_like(p)
    x = x.detach().requires_grad_()
    with PeakTracker() as tracker:
        block(x).backward(torch.ones(x.shape[0], 64))
    return tracker.peak


def test_the_profile_counts_the_gradients_a_backward_has_made_by_its_peak() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), MLP())
    x = torch.randn(8, 64)
    measured = profile_model(model, x, profile="measure", spec="cpu")
    estimated = profile_model(model, torch.randn(8, 64), profile="estimate", spec="cpu")
    second = measured.blocks[1]
    # the second layer's weight gradient (256 x 64 floats) exists while the first one's backward runs
    assert 0 < second.fresh_extra_bytes <= 256 * 64 * 4 + 64 * 4
    assert [b.fresh_extra_bytes for b in estimated.blocks] == [b.fresh_extra_bytes for b in measured.blocks]
    # as a real backward shows: the peak with its gradients made, less the peak adding into zeros
    block = model[1]
    assert _backward_peak(block, x, fresh=True) - _backward_peak(block, x, fresh=False) == second.fresh_extra_bytes
    assert _backward_peak(block, x, fresh=False) - second.activation_bytes - second.transient_bytes in (0, 8 * 64 * 4)


def test_one_layer_makes_its_weight_gradient_after_its_peak() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    prof = profile_model(model, torch.randn(8, 64), profile="estimate", spec="cpu")
    assert [b.fresh_extra_bytes for b in prof.blocks] == [0, 0, 0]
