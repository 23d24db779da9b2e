"""Stage modules: chaining equals the model, original FQNs, shared parameters, tied groups."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_autopart.capture import capture
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.errors import ConfigError
from lightning_autopart.runtime.stages import build_stage_module, stage_inputs, stage_outputs, tied_groups
from tests.models import example, make
from tests.pipeline_plans import make_plan

CASES = [
    ("mlp", "export"),
    ("residual", "export"),
    ("gpt", "export"),
    ("two_inputs", "export"),
    ("huge_child", "modules"),
    ("data_dependent", "modules"),
    ("param_free", "modules"),
]


def _captured(name: str, method: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], CapturedModel]:
    model = make(name)
    x = example(name)
    args = x if isinstance(x, tuple) else (x,)
    return model, args, capture(model, x, method=method)


def _bounds(n: int, parts: int) -> list[int]:
    return [k * n // parts for k in range(parts + 1)]


@pytest.mark.parametrize(("name", "method"), CASES)
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_stages_chain_to_model_output(name: str, method: str, parts: int) -> None:
    model, args, captured = _captured(name, method)
    bounds = _bounds(captured.num_blocks, min(parts, captured.num_blocks))
    values: tuple[torch.Tensor, ...] = args
    for start, end in itertools.pairwise(bounds):
        stage = build_stage_module(captured, start, end)
        assert len(values) == len(stage_inputs(captured, start))
        values = stage(*values)
        assert isinstance(values, tuple)
        assert [tuple(v.shape) for v in values] == [t.shape for t in stage_outputs(captured, end)]
    torch.testing.assert_close(values[0], model(*args), rtol=0, atol=0)


@pytest.mark.parametrize(("name", "method"), CASES)
def test_stage_owns_its_blocks_parameters_under_original_names(name: str, method: str) -> None:
    model, _, captured = _captured(name, method)
    params = dict(model.named_parameters())
    bounds = _bounds(captured.num_blocks, min(3, captured.num_blocks))
    held: set[str] = set()
    for start, end in itertools.pairwise(bounds):
        stage = build_stage_module(captured, start, end)
        names = {n for n, _ in stage.named_parameters()}
        assert names == {p for b in captured.blocks[start:end] for p in b.params}
        for n, p in stage.named_parameters():
            assert p is params[n]  # shared, not copied
        held |= names
    assert held == set(params)


def test_gradients_flow_through_stages_into_the_users_parameters() -> None:
    model, args, captured = _captured("residual", "export")
    first, second = build_stage_module(captured, 0, 3), build_stage_module(captured, 3, captured.num_blocks)
    second(*first(*args))[0].sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(*args).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_non_float_tensors_cross_cuts() -> None:
    _, args, captured = _captured("gpt", "export")
    outputs = stage_outputs(captured, 4)
    assert "bool" in {t.dtype for t in outputs}
    values = build_stage_module(captured, 0, 4)(*args)
    assert torch.bool in {v.dtype for v in values}


def test_tied_parameter_appears_in_both_stages_and_in_tied_groups() -> None:
    model, _, captured = _captured("gpt", "export")
    n = captured.num_blocks
    first, last = build_stage_module(captured, 0, n // 2), build_stage_module(captured, n // 2, n)
    tied = model.get_parameter("tok.weight")
    assert any(p is tied for p in first.parameters())
    assert any(p is tied for p in last.parameters())
    assert tied_groups(make_plan(n, 2), captured) == [("tok.weight", (0, 1))]
    assert tied_groups(make_plan(n, 1, 2), captured) == []


def test_modules_stage_keeps_programs_unregistered() -> None:
    _, _, captured = _captured("huge_child", "modules")
    stage = build_stage_module(captured, 0, captured.num_blocks)
    names = [n for n, _ in stage.named_parameters(remove_duplicate=False)]
    assert len(names) == len(set(names))
    assert set(stage.state_dict()) == set(captured.module.state_dict())


@pytest.mark.parametrize(("start", "end"), [(0, 0), (2, 1), (-1, 2), (0, 99)])
def test_bad_ranges_raise(start: int, end: int) -> None:
    _, _, captured = _captured("mlp", "export")
    with pytest.raises(ConfigError, match="start < end"):
        build_stage_module(captured, start, end)
