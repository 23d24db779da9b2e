"""Model outputs the training loss does not read (a Hugging Face model's logits beside its loss) get no gradient
in the profile and are freed before backward, as in training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopart.planner import profile_model


class _Head(nn.Module):
    """A body and a head that computes its own loss: returns (logits, loss), or the loss alone."""

    def __init__(self, with_logits: bool) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(32, 64), nn.Linear(64, 1000)
        self.with_logits = with_logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(torch.relu(self.body(x)))
        loss = F.cross_entropy(logits, labels)
        return (logits, loss) if self.with_logits else loss


def _loss(output: Any, samples: int) -> torch.Tensor:
    return output[1] if isinstance(output, tuple) else output


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_logits_beside_the_loss_cost_nothing_in_backward(mode: str) -> None:
    torch.manual_seed(0)
    x, labels = torch.randn(16, 32), torch.randint(0, 1000, (16,))
    profiles = {}
    for with_logits in (True, False):
        model = _Head(with_logits)
        device = "meta" if mode == "estimate" else "cpu"
        args = (x.to(device), labels.to(device))
        spec = "h100" if mode == "estimate" else None
        profiles[with_logits] = profile_model(model.to(device), args, profile=mode, spec=spec, loss=_loss)
    both, alone = profiles[True].blocks[-1], profiles[False].blocks[-1]
    assert both.activation_bytes == alone.activation_bytes
    assert both.transient_bytes == alone.transient_bytes  # no ones-like seed for the logits, no logits held
    if mode == "estimate":
        assert both.bwd_us == pytest.approx(alone.bwd_us)


def test_outputs_the_loss_reads_keep_their_gradient() -> None:
    """The loss reads the logits (computed outside the model): they are live, their gradient is priced."""
    model = _Head(with_logits=True)
    labels = torch.randint(0, 1000, (16,))

    def outside(output: Any, samples: int) -> torch.Tensor:
        return F.cross_entropy(output[0], labels[:samples].to(output[0].device))

    x = torch.randn(16, 32, device="meta")
    read = profile_model(model.to("meta"), (x, labels.to("meta")), profile="estimate", spec="h100", loss=outside)
    unread = profile_model(model, (x, labels.to("meta")), profile="estimate", spec="h100", loss=_loss)
    assert read.blocks[-1].transient_bytes > unread.blocks[-1].transient_bytes
