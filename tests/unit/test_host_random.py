"""Random numbers a forward draws with Python's ``random`` or ``numpy.random`` are not frozen into the
captured graph ([Note: host random numbers] in lightning_autopart/capture/host_random.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.errors import CaptureError


class LayerDrop(nn.Module):
    """A layer skipped with probability 1/2, decided with Python's ``random`` (as LayerDrop often is)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if random.random() < 0.5 else x + self.layer(x)


class NumpyMask(nn.Module):
    """Positions zeroed by a mask drawn with NumPy (as SpecAugment's time masking is)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(*x.shape) < 0.5)
        return x.masked_fill(~keep, 0.0)


@pytest.mark.parametrize("drawn", [LayerDrop, NumpyMask])
def test_a_forward_drawing_host_random_numbers_is_not_exported(drawn: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), drawn(), nn.Linear(4, 2))
    random.seed(1)
    np.random.seed(1)
    before = random.getstate(), np.random.get_state()[1].copy()
    captured = capture(model, torch.randn(3, 4))
    assert captured.method == "modules"  # its blocks run the forward's Python at every step
    assert any("freeze" in note and "random" in note for note in captured.notes), captured.notes
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()  # left as found
    # The module that draws is a block of its own, so every run of it draws again.
    block = next(b for b in captured.blocks if b.modules == ("1",))
    x = torch.randn(64, 4)
    outs = {tuple(block.program(x)[0].flatten().tolist()) for _ in range(8)}
    assert len(outs) > 1


def test_a_model_without_host_random_numbers_is_exported() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))  # torch draws: an operation
    assert capture(model, torch.randn(3, 4)).method == "export"


def test_host_random_numbers_between_submodules_are_refused_with_the_fix() -> None:
    class Glue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            return self.b(x * 2 if random.random() < 0.5 else x)

    with pytest.raises(CaptureError, match=r"random.*freeze.*torch\.rand"):
        capture(Glue(), torch.randn(3, 4))


class SkipsAtRandom(nn.Module):
    """Draws in its own forward, between its submodules: whether ``b`` runs is decided outside any block."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        return x if random.random() < 0.5 else self.b(x)


def test_a_parent_drawing_between_its_blocks_becomes_one_block() -> None:
    """Module hooks freeze the path a parent's forward took at capture: a draw there makes the parent one
    block, whose forward (and its draw) runs at every step."""
    model = nn.Sequential(nn.Linear(4, 4), SkipsAtRandom(), nn.Linear(4, 2))
    captured = capture(model, torch.randn(3, 4), method="modules")
    assert [b.modules for b in captured.blocks] == [("0",), ("1",), ("2",)]
    assert any("'1' is one block" in note and "random" in note for note in captured.notes), captured.notes
