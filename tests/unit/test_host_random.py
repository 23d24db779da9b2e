"""Random numbers a forward draws with Python's ``random`` or ``numpy.random`` are not frozen into the
captured graph ([Note: host random numbers] in lightning_autopart/capture/host_random.py)."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from torch import manual_seed as seed_by_name
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.errors import CaptureError

#: A generator kept in a global variable, which a forward draws from by name.
GLOBAL_RNG = random.Random(0)


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


class KeptGenerator(nn.Module):
    """Skips its layer when a generator it keeps says so: ``self.rng`` is drawn from at every call."""

    def __init__(self, make: str) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        rng: object = {
            "random.Random": random.Random(0),
            "numpy Generator": np.random.default_rng(0),
            "numpy RandomState": np.random.RandomState(0),
        }[make.split(" in ")[0]]
        if make.endswith(" in an object"):
            rng = types.SimpleNamespace(rng=rng)
        self.rng = [rng] if make.endswith(" in a list") else rng

    def draw(self) -> float:
        rng = self.rng[0] if isinstance(self.rng, list) else getattr(self.rng, "rng", self.rng)
        return float(rng.random() if hasattr(rng, "random") else rng.rand())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.draw() < 0.5 else x + self.layer(x)


@pytest.mark.parametrize(
    "make",
    [
        "random.Random",
        "numpy Generator",
        "numpy RandomState",
        "random.Random in a list",
        "numpy Generator in an object",
    ],
)
def test_a_generator_the_model_keeps_is_not_frozen_and_is_left_as_found(make: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), KeptGenerator(make), nn.Linear(4, 2))
    twin = KeptGenerator(make)  # the same stream, drawn here
    draws = [twin.draw() for _ in range(8)]
    assert {d < 0.5 for d in draws} == {True, False}
    captured = capture(model, torch.randn(3, 4))
    assert captured.method == "modules"  # torch.export would have frozen the capture's draw
    assert any("the generator 1.rng" in note and "freeze" in note for note in captured.notes), captured.notes
    # The module is a block, which draws at every call, from where the stream was before the capture.
    block = next(b for b in captured.blocks if b.modules == ("1",))
    x = torch.randn(2, 4)
    skipped = [torch.equal(block.program(x)[0], x) for _ in range(8)]
    assert skipped == [d < 0.5 for d in draws]


@pytest.mark.parametrize("make", ["numpy", "python"])
def test_a_generator_made_without_a_seed_in_the_forward_is_not_frozen(make: str) -> None:
    class Fresh(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u = np.random.default_rng().random() if make == "numpy" else random.Random().random()
            return x * u

    captured = capture(nn.Sequential(nn.Linear(4, 4), Fresh(), nn.Linear(4, 2)), torch.randn(3, 4))
    assert captured.method == "modules"
    assert any("without a seed" in note for note in captured.notes), captured.notes


def test_a_generator_made_with_a_seed_in_the_forward_is_exported() -> None:
    """Seeded afresh at every call, it draws the same numbers every step: the graph's constant is right."""

    class Seeded(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(np.random.default_rng(7).random()) * random.Random(3).random()

    model = nn.Sequential(nn.Linear(4, 4), Seeded(), nn.Linear(4, 2))
    assert capture(model, torch.randn(3, 4)).method == "export"


class Reseeds(nn.Module):
    """Drops the same positions at every call: it reseeds torch before its dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        return nn.functional.dropout(self.layer(x), 0.5)


def test_a_forward_reseeding_torch_is_not_exported_and_repeats_its_mask() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), Reseeds(), nn.Linear(4, 2))
    example = torch.randn(3, 4)
    state = torch.get_rng_state()
    functions = (torch.manual_seed, torch.random.manual_seed, random.Random.seed)
    captured = capture(model, example)
    assert captured.method == "modules"  # a graph would draw a new mask at every step
    said = "reseeds torch's random generator (torch.manual_seed)"
    assert any(said in note for note in captured.notes), captured.notes
    assert torch.equal(torch.get_rng_state(), state)  # capture leaves torch's generator as it found it
    assert (torch.manual_seed, torch.random.manual_seed, random.Random.seed) == functions  # recorders removed
    block = next(b for b in captured.blocks if b.modules == ("1",))
    x = torch.randn(16, 4)
    first, second = block.program(x)[0], block.program(x)[0]
    torch.testing.assert_close(first, second)  # as eagerly: one mask
    torch.testing.assert_close(first, model[1](x))


def test_a_reseed_between_submodules_is_refused_with_the_fix() -> None:
    class Glue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            torch.manual_seed(0)
            return self.b(x)

    said = r"reseeded \(torch\.manual_seed\).*Glue\.forward.*inside a submodule"
    with pytest.raises(CaptureError, match=said):
        capture(Glue(), torch.randn(3, 4))


def _coin() -> float:
    return GLOBAL_RNG.random()


class GlobalDraw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if GLOBAL_RNG.random() < 0.5 else x + self.layer(x)


class HelperDraw(GlobalDraw):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the generator's name is in _coin only
        return x if _coin() < 0.5 else x + self.layer(x)


@pytest.mark.parametrize("helper", [False, True], ids=["in forward", "in a helper"])
def test_a_generator_in_a_global_variable_the_forward_names_is_not_frozen(helper: bool) -> None:
    state = GLOBAL_RNG.getstate()
    model = nn.Sequential(nn.Linear(4, 4), HelperDraw() if helper else GlobalDraw(), nn.Linear(4, 2))
    captured = capture(model, torch.randn(3, 4))
    assert captured.method == "modules"
    said = "GLOBAL_RNG (a global of tests.unit.test_host_random)"
    assert any(said in note and "freeze" in note for note in captured.notes), captured.notes
    assert GLOBAL_RNG.getstate() == state  # left as found


@pytest.mark.parametrize("how", ["imported by name", "generator method"])
def test_a_reseed_capture_cannot_record_is_seen(how: str) -> None:
    """``from torch import manual_seed`` binds the function before capture could record calls to it, and a
    generator's own ``manual_seed`` is a method of a C type: torch's initial seed tells."""

    class ReseedsOtherwise(Reseeds):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seed_by_name(0) if how == "imported by name" else torch.default_generator.manual_seed(0)
            return nn.functional.dropout(self.layer(x), 0.5)

    torch.manual_seed(1)
    captured = capture(nn.Sequential(nn.Linear(4, 4), ReseedsOtherwise(), nn.Linear(4, 2)), torch.randn(3, 4))
    assert captured.method == "modules"
    assert any("reseeds torch's random generator" in note for note in captured.notes), captured.notes
