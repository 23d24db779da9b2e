"""What crosses a cut ([Note: wire format]): a value that needs no gradient costs autograd nothing in the stage
that receives it, yet its carrier still gets the exact zero gradient every torch version sends back."""

from __future__ import annotations

import torch
from torch import nn

from lightning_autopart.capture.graph import TensorInfo
from lightning_autopart.profile.saved import SavedTensorMeter
from lightning_autopart.runtime.wire import WireStage, encode


def _info(name: str, t: torch.Tensor, requires_grad: bool) -> TensorInfo:
    dtype = str(t.dtype).removeprefix("torch.")
    return TensorInfo(name, tuple(t.shape), dtype, t.numel() * t.element_size(), 0, (1,), requires_grad)


class Rotary(nn.Module):
    """A Llama layer's use of its rotary tables: the hidden state times a table that needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = self.proj(hidden)
        return (q * cos + q.flip(-1) * cos, ids + 1)


def test_a_received_value_without_a_gradient_need_is_detached_but_still_touched() -> None:
    hidden, cos, ids = torch.randn(4, 8), torch.randn(1, 8), torch.arange(4)
    infos = [_info("hidden", hidden, True), _info("cos", cos, False), _info("ids", ids, False)]
    stage = WireStage(Rotary(), infos, [_info("out", hidden, True), _info("ids1", ids, False)])
    # torch.distributed.pipelining hands over leaves that require a gradient, float tables included
    carriers = [encode(t).clone().requires_grad_(True) for t in (hidden, cos, ids)]
    meter = SavedTensorMeter(exclude=list(stage.parameters()))
    with meter.hooks():
        out, ids_out = stage(*carriers)
    # Only the table is saved for the products' backward (and the Linear its input): had the table needed a
    # gradient, each product would also have saved the projection it multiplies.
    assert meter.nbytes == hidden.numel() * 4 + cos.numel() * 4
    torch.autograd.backward([out], [torch.ones_like(out)])
    assert carriers[0].grad is not None and carriers[0].grad.abs().sum() > 0
    for carrier in carriers[1:]:  # the carriers of values without a gradient need: an exact zero
        assert carrier.grad is not None and not carrier.grad.any()
    assert torch.equal(ids_out.view(torch.int64), ids + 1)


class TwoLayers(nn.Module):
    """A stage that passes a received mask on untouched (a 4-D attention mask, relayed images)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.second(self.first(hidden) * mask), mask)


def test_the_zero_gradients_come_at_the_end_of_the_backward() -> None:
    """Made at the start of the backward, the zeros of the values without a gradient need were held beside
    every activation of the stage; they come with the input gradients, once its last block is done."""
    hidden, mask = torch.randn(4, 8), torch.ones(4, 8)
    infos = [_info("hidden", hidden, True), _info("mask", mask, False)]
    for outputs in ([_info("out", hidden, True), _info("mask", mask, False)], None):  # a middle and a last stage
        stage = WireStage(TwoLayers(), infos, outputs)
        carriers = [t.clone().requires_grad_(True) for t in (hidden, mask)]
        out = stage(*carriers)[0]
        assert stage.untouched == []  # the last stage's loss has nothing left to touch
        seen: list[torch.Tensor | None] = []
        mask_carrier = carriers[1]
        stage.stage.second.weight.register_post_accumulate_grad_hook(
            lambda _, seen=seen, mask=mask_carrier: seen.append(mask.grad)
        )
        torch.autograd.backward([out], [torch.ones_like(out)])
        assert seen == [None]  # the last block's backward ran before the zeros were made
        assert carriers[1].grad is not None and not carriers[1].grad.any()
        assert carriers[0].grad is not None and carriers[0].grad.abs().sum() > 0
