"""Nothing the profiler makes outlives ``profile()``: copies, their parameters, inputs, outputs and gradients.

Live tensor bytes are counted by a gc census that collects nothing (tests/census.py), with the collector
switched off around the call: a copy kept alive by a reference cycle holds real memory (on a GPU too) until
the collector happens to run, so it must show here as a leak.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import fx, nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.errors import ProfileError
from lightning_autopart.profile import profile
from lightning_autopart.profile.records import ModelProfile
from tests.census import live_tensor_bytes
from tests.unit.test_profile import Wrap, chain

WIDTH, DEPTH, BATCH = 512, 4, 64
#: Bytes a call may leave behind: far below one 512 x 512 weight (1 MiB).
TOLERANCE = 64 << 10


@contextmanager
def no_collector() -> Iterator[None]:
    """The garbage collector off for the duration (and back to its previous state after)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def leaked_bytes(run: Callable[[], Any]) -> int:
    """Live tensor bytes after ``run()`` minus before, with no garbage collection in between."""
    with no_collector():
        before = live_tensor_bytes()
        result = run()
        after = live_tensor_bytes()
    del result
    return after - before


class Net(nn.Module):
    """``DEPTH`` Linear(WIDTH, WIDTH) layers with ReLU in the root forward (as tests/models.py's Net)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Traceable(nn.Module):
    """A one-argument block program fx can trace: runs ``inner`` and returns its output as a one-tuple."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.inner(x),)


def fx_chain() -> CapturedModel:
    """A hand-built capture whose block programs are ``fx.GraphModule``s, as a torch.export capture's are.

    Independent of the capture code: every GraphModule and its graph refer to each other, the cycle that
    kept the profiler's copies alive.
    """
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH)))
    captured = chain(model, torch.randn(BATCH, WIDTH))
    for block in captured.blocks:
        assert isinstance(block.program, Wrap)
        program = fx.symbolic_trace(Traceable(block.program.inner))
        assert isinstance(program, fx.GraphModule) and program.graph.owning_module is program
        block.program = program
    return captured


def export_capture() -> CapturedModel:
    """The real thing: ``capture`` by torch.export."""
    captured = capture(Net(), (torch.randn(BATCH, WIDTH),), method="export")
    assert captured.method == "export"
    return captured


def module_chain() -> CapturedModel:
    """A "modules" capture (plain ``nn.Module`` programs) of a plain MLP."""
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    return chain(model, torch.randn(BATCH, WIDTH))


class SelfReferent(nn.Module):
    """A user's layer in a reference cycle with itself (it keeps a bound method of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.act = self.activation  # self -> bound method -> self

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def cyclic_chain() -> CapturedModel:
    """A "modules" capture whose programs are in reference cycles of the user's own making."""
    return chain(nn.Sequential(*(SelfReferent() for _ in range(DEPTH))), torch.randn(BATCH, WIDTH))


CAPTURES = {"fx": fx_chain, "export": export_capture, "modules": module_chain, "cyclic": cyclic_chain}


def run_profile(captured: CapturedModel, mode: str) -> ModelProfile:
    return profile(captured, mode, device="cpu", spec="a100", warmup=1, repeats=2)


@pytest.mark.parametrize("mode", ["measure", "estimate"])
@pytest.mark.parametrize("kind", list(CAPTURES))
def test_profile_leaves_no_tensor_alive(kind: str, mode: str) -> None:
    captured = CAPTURES[kind]()
    weights = sum(p.numel() * p.element_size() for p in captured.module.parameters())
    assert weights >= DEPTH * WIDTH * WIDTH * 4  # a leaked copy would show as megabytes
    leaked = leaked_bytes(lambda: run_profile(captured, mode))
    assert abs(leaked) <= TOLERANCE, f"{leaked / 2**20:.2f} MiB alive after profile({kind}, {mode!r})"


def test_the_copies_die_with_the_call() -> None:
    """Every copied block program is freed by reference counting as soon as the call returns."""
    captured = fx_chain()
    copies: list[weakref.ref[nn.Module]] = []
    originals = {id(b.program) for b in captured.blocks}

    from lightning_autopart.profile import runner as runner_module

    real_copy = runner_module.copy_program

    def watched_copy(program: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
        clone = real_copy(program, device, dtype)
        copies.append(weakref.ref(clone))
        return clone

    with no_collector(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "copy_program", watched_copy)
        run_profile(captured, "measure")
        run_profile(captured, "estimate")
        assert len(copies) >= 2 * DEPTH
        assert all(ref() is None for ref in copies)
    # The captured programs themselves are untouched and still run.
    assert {id(b.program) for b in captured.blocks} == originals
    x = torch.randn(BATCH, WIDTH)
    for block in captured.blocks:
        assert (
            isinstance(block.program, fx.GraphModule) and block.program.graph.owning_module is block.program
        )
        assert sum(1 for _ in block.program.parameters()) == 2
        (x,) = block.program(x)


class FailsInBackward(nn.Module):
    """A Linear whose backward raises: the failure comes after every copy, input and output was made."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(self.fail)
        return y

    @staticmethod
    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


def test_a_failed_block_leaves_nothing_in_the_kept_error() -> None:
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH - 1)]
    captured = chain(nn.Sequential(*layers, FailsInBackward()), torch.randn(BATCH, WIDTH))
    kept: list[BaseException] = []

    def failing() -> None:
        try:
            run_profile(captured, "measure")
        except ProfileError as error:
            kept.append(error)  # a caller keeps the error (the strategy sends it to every rank)

    leaked = leaked_bytes(failing)
    assert kept and "boom in backward" in str(kept[0])
    assert abs(leaked) <= TOLERANCE, f"{leaked / 2**20:.2f} MiB alive in the kept error"
