"""CUDA: an optimizer's state and step temporaries as ``torch.cuda.max_memory_allocated`` sees them, against the
spec ``describe_optimizer`` measures on CPU stand-ins ([Note: measured optimizers]). The user's optimizer is built
as users build it (no ``foreach``): on CUDA torch picks foreach by itself, which the stand-in assumes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_autopart.profile.optimizer_probe import describe_optimizer
from lightning_autopart.profile.optimizers import optimizer_state_factor, optimizer_transient_factor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

optim = torch.optim
CASES: dict[str, Callable[[Any], optim.Optimizer]] = {
    "adamw": lambda p: optim.AdamW(p, lr=1e-4),
    "adamw fused": lambda p: optim.AdamW(p, lr=1e-4, fused=True),
    "adam amsgrad": lambda p: optim.Adam(p, lr=1e-4, amsgrad=True),
    "sgd momentum decay": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adagrad": lambda p: optim.Adagrad(p, lr=0.1),
    "nadam": lambda p: optim.NAdam(p, lr=1e-4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_spec_gives_what_cuda_allocates(case: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    optimizer = CASES[case](params)
    spec = str(describe_optimizer(optimizer, gpu=True))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # the state appears
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    state = before - 2 * total  # parameters and gradients
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - before
    assert optimizer_state_factor(spec) * total == pytest.approx(state, abs=0.01 * total + 4096), spec
    assert optimizer_transient_factor(spec) * total == pytest.approx(transient, abs=0.02 * total + (1 << 16)), spec
