"""Recomputed stages on CUDA: the CUDA generator replays dropout's masks, and the forward leaves only its output
allocated. ``check_*`` functions take the device, so they can be tried on the CPU."""

from __future__ import annotations

import pytest
import torch

from lightning_autopart.runtime.recompute import Recompute
from tests.distributed.recompute_cases import NormDrop
from tests.unit.test_recompute import _stage, _train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def check_recompute_equals_plain(device: torch.device) -> None:
    """Gradients, losses, running statistics and the generator afterwards equal the plain stage's, bit for bit."""
    micro = [(torch.randn(8, 16, device=device),) for _ in range(3)]
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = NormDrop().to(device)
        stage = _stage(model, micro[0][0], "export")
        results.append(_train(Recompute(stage) if wrap else stage, model, micro))
    plain, recomputed = results
    assert plain.keys() == recomputed.keys()
    for key in plain:
        torch.testing.assert_close(recomputed[key], plain[key], rtol=0, atol=0, msg=key)


def test_recompute_equals_plain_on_cuda() -> None:
    check_recompute_equals_plain(torch.device("cuda"))


def test_checkpointed_forward_leaves_only_its_output_allocated() -> None:
    device = torch.device("cuda")
    model = NormDrop().to(device)
    x = torch.randn(256, 16, device=device, requires_grad=True)
    stage = _stage(model, x.detach(), "export")
    grown = {}
    for name, run in (("plain", stage), ("recompute", Recompute(stage))):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = run(x)
        grown[name] = torch.cuda.memory_allocated() - before
        output_bytes = out[0].untyped_storage().nbytes()
        del out
    assert grown["recompute"] <= 2 * output_bytes  # the output (allocator rounding aside), nothing saved
    assert grown["plain"] > 10 * grown["recompute"]
