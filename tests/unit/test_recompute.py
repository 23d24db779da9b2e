"""Recomputed stages: only the inputs are kept, and gradients, dropout masks and buffers are those of the plain stage."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_autopart.capture import capture
from lightning_autopart.runtime.recompute import Recompute, running_statistics
from lightning_autopart.runtime.stages import build_stage_module
from tests.distributed.recompute_cases import NormDrop


class Shift(nn.Module):
    """Adds a buffer it then moves: its output reads the value its own forward writes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("shift", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x) + self.shift)
        self.shift.add_(0.5)
        return y


class Shifts(nn.Module):
    """Two :class:`Shift` layers and a Linear."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(Shift(width), Shift(width), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _stage(model: nn.Module, example: torch.Tensor, method: str) -> nn.Module:
    captured = capture(model, example, method=method)
    return build_stage_module(captured, 0, captured.num_blocks)


def saved_bytes(model: nn.Module, run: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while ``run`` runs, parameters excluded (as the profiler
    counts activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()  # kept alive while counting: its saved tensors keep their storages (no reused addresses)
    del out
    return sum(seen.values())


@pytest.mark.parametrize("method", ["export", "modules"])
def test_checkpointed_stage_keeps_only_its_input(method: str) -> None:
    model = NormDrop()
    stage = _stage(model, torch.randn(32, 16), method)
    x = torch.randn(32, 16, requires_grad=True)
    plain = saved_bytes(model, lambda: stage(x))
    kept = saved_bytes(model, lambda: Recompute(stage)(x))
    input_bytes = x.untyped_storage().nbytes()
    assert kept == input_bytes  # 2 KiB: the stage input, nothing else
    # 4 blocks x (linear, batch norm, relu, dropout mask, linear) at width 128
    assert plain > 20 * input_bytes


def _train(
    stage: Callable[..., tuple[torch.Tensor, ...]], model: nn.Module, micro: list[tuple[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """GPipe-like: every micro-batch's forward, then the backwards in reverse; the gradients and buffers after."""
    model.zero_grad()
    torch.manual_seed(7)
    losses = [stage(*m)[0].square().mean() for m in micro]
    for loss in reversed(losses):
        loss.backward()
    state = {f"grad:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state |= {f"buffer:{n}": b.clone() for n, b in model.named_buffers()}
    state["loss"] = torch.stack([loss.detach() for loss in losses])
    state["rng"] = torch.rand(3, device=micro[0][0].device)  # the generator goes on as without recompute
    return state


@pytest.mark.parametrize("method", ["export", "modules"])
@pytest.mark.parametrize("name", ["normdrop", "shifts"])
def test_recompute_equals_plain_stage(method: str, name: str) -> None:
    factory: Callable[[], nn.Module] = NormDrop if name == "normdrop" else Shifts
    width = 16 if name == "normdrop" else 8
    micro = [(torch.randn(4, width),) for _ in range(3)]
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = factory()
        stage = _stage(model, micro[0][0], method)
        results.append(_train(Recompute(stage) if wrap else stage, model, micro))
    plain, recomputed = results
    assert plain.keys() == recomputed.keys()
    for key in plain:
        torch.testing.assert_close(recomputed[key], plain[key], rtol=0, atol=0, msg=key)


def test_a_naive_recompute_would_read_moved_buffers() -> None:
    """The control of the test above: ``checkpoint`` alone updates buffers twice and recomputes with later values."""
    micro = [(torch.randn(4, 8),) for _ in range(2)]
    results = []
    for naive in (False, True):
        torch.manual_seed(0)
        model = Shifts()
        stage = _stage(model, micro[0][0], "export")
        run = (lambda *x, stage=stage: checkpoint(stage, *x, use_reentrant=False)) if naive else stage
        results.append(_train(run, model, micro))
    plain, naive_run = results
    assert not torch.equal(naive_run["buffer:layers.0.shift"], plain["buffer:layers.0.shift"])
    assert not torch.equal(naive_run["grad:layers.0.fc.weight"], plain["grad:layers.0.fc.weight"])


def test_without_gradients_nothing_is_kept_or_recomputed() -> None:
    model = NormDrop()
    stage = _stage(model, torch.randn(4, 16), "export")
    calls = []
    stage.register_forward_pre_hook(lambda *_: calls.append(1))
    wrapped = Recompute(stage)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert saved_bytes(model, lambda: wrapped(x)) == 0
    assert len(calls) == 1
    wrapped(x.requires_grad_())[0].sum().backward()
    assert len(calls) == 3  # with gradients: the forward and its recompute


@pytest.mark.parametrize("method", ["export", "modules"])
def test_running_statistics_are_found_in_either_capture(method: str) -> None:
    model = NormDrop()
    stage = _stage(model, torch.randn(4, 16), method)
    found = {id(t) for t in running_statistics(stage)}
    expected = {id(t) for n, t in model.named_buffers() if n.endswith(("running_mean", "running_var"))}
    assert found == expected and len(found) == 8
