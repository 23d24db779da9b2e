"""Tests of capture: block choice, programs that replay the model exactly, cuts, tied weights and errors."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_autopart.capture import capture, split_inputs
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.capture.programs import runs
from lightning_autopart.capture.tree import block_modules, collapse, param_weight
from lightning_autopart.errors import CaptureError, ConfigError
from tests.models import GPT, Net, example, make

_GPT_LAYERS = [f"layers.{i}" for i in range(3)]

#: name -> (method, max_blocks, block names)
EXPECTED: dict[str, tuple[str, int, list[str]]] = {
    "mlp": ("export", 64, [f"layers.{i}" for i in range(4)]),
    # Repeated residual blocks are never split into their children (a skip crosses every inner cut).
    "residual": ("export", 8, ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]),
    "gpt": ("export", 8, ["tok", "pos", *_GPT_LAYERS, "ln_f", "head"]),
    "resnet": ("export", 8, ["stem.0", "stem.1", "stem.2", "stage1", "stage2", "pool", "fc"]),
    "two_inputs": ("export", 64, ["enc_a", "enc_b", "head"]),
    "loss": ("export", 64, ["body.0", "body.1", "body.2", "out"]),
    "param_free": ("export", 64, ["conv", "act", "flat", "fc"]),
    "data_dependent": ("modules", 64, ["inp", "gate", "out"]),
    "huge_child": ("export", 64, ["embed", *[f"body.layers.{i}" for i in range(8)], "head"]),
    # A module called twice is one block per call; its weight is tied between them.
    "called_twice": ("export", 64, ["shared", "mid", "shared#2", "last"]),
    "lightning": (
        "export",
        6,
        ["model.stem", "model.blocks.0", "model.blocks.1", "model.blocks.2", "model.head"],
    ),
}


def flat_inputs(example_inputs: Any) -> list[Any]:
    """The model inputs in ``CapturedModel.inputs`` order."""
    args, kwargs = split_inputs(example_inputs)
    return pytree.tree_leaves((args, kwargs))


def call(model: nn.Module, example_inputs: Any) -> list[torch.Tensor]:
    args, kwargs = split_inputs(example_inputs)
    with torch.no_grad():
        return [t for t in pytree.tree_leaves(model(*args, **kwargs)) if isinstance(t, torch.Tensor)]


def replay(captured: CapturedModel, example_inputs: Any) -> list[torch.Tensor]:
    """Chain the block programs on the inputs; return the model outputs (``cuts[-1]``)."""
    env = {info.name: value for info, value in zip(captured.inputs, flat_inputs(example_inputs), strict=True)}
    with torch.no_grad():
        for block in captured.blocks:
            out = block.program(*(env[t.name] for t in block.inputs))
            assert isinstance(out, tuple) and len(out) == len(block.outputs)
            env.update((t.name, value) for t, value in zip(block.outputs, out, strict=True))
    return [env[t.name] for t in captured.cuts[-1]]


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "params": [id(p) for p in model.parameters()],
        "modes": [m.training for m in model.modules()],
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(after[key], value), key
    assert [id(p) for p in model.parameters()] == before["params"]
    assert [m.training for m in model.modules()] == before["modes"]
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.parametrize("name", list(EXPECTED))
def test_zoo_capture(name: str) -> None:
    method, max_blocks, names = EXPECTED[name]
    model, x = make(name), example(name)
    if name == "resnet":
        model.get_submodule(
            "stage1"
        ).eval()  # mixed modes must survive, and BatchNorm statistics must not move
    before = snapshot(model)
    captured = capture(model, x, max_blocks=max_blocks)
    assert_unchanged(model, before)
    assert captured.method == method
    assert [b.name for b in captured.blocks] == names
    assert [b.index for b in captured.blocks] == list(range(len(names)))
    assert len(captured.cuts) == len(names)
    assert captured.batch_size == flat_inputs(x)[0].shape[0]

    expected = call(model, x)
    assert_unchanged(model, before) if name != "resnet" else None
    got = replay(captured, x)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)

    params = {id(p): n for n, p in model.named_parameters()}
    for block in captured.blocks:
        owned = {id(p) for p in block.program.parameters()}
        assert owned <= params.keys(), "block programs must hold the model's own parameters"
        assert {params[i] for i in owned} >= set(block.params)
        for value, info in zip(block.args, block.inputs, strict=True):
            assert tuple(value.shape) == info.shape
        for info in block.inputs:
            assert info.producer < block.index and block.index in info.consumers
        for info in block.outputs:
            assert info.producer == block.index and min(info.consumers) > block.index
    for k, cut in enumerate(captured.cuts[:-1]):
        for info in cut:
            assert info.producer <= k < max(info.consumers)


@pytest.mark.parametrize("name", ["gpt", "data_dependent"])
def test_gradients_flow_into_the_models_own_parameters(name: str) -> None:
    model, x = make(name), example(name)
    captured = capture(model, x, max_blocks=8)
    model(x).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    env: dict[str, Any] = {captured.inputs[0].name: x}
    for block in captured.blocks:
        env.update(
            zip(
                [t.name for t in block.outputs],
                block.program(*(env[t.name] for t in block.inputs)),
                strict=True,
            )
        )
    env[captured.cuts[-1][0].name].square().mean().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and len(got) == len(list(model.parameters()))
    for n, grad in got.items():
        torch.testing.assert_close(grad, expected[n])


@pytest.fixture(scope="module")
def gpt() -> tuple[nn.Module, torch.Tensor, CapturedModel]:
    """The zoo GPT, its example tokens and its capture with max_blocks=8 (shared: capture is read-only)."""
    model, x = make("gpt"), example("gpt")
    return model, x, capture(model, x, max_blocks=8)


def test_split_graph_runs_the_model(gpt: tuple[nn.Module, torch.Tensor, CapturedModel]) -> None:
    model, x, captured = gpt
    assert captured.split_graph is not None
    subs = [n for n, _ in captured.split_graph.named_children()]
    assert subs == [f"submod_{k}" for k in range(captured.num_blocks)]
    for k, block in enumerate(captured.blocks):
        assert captured.split_graph.get_submodule(f"submod_{k}") is block.program
    with torch.no_grad():
        (out,) = captured.split_graph(x)
        assert torch.equal(out, model(x))


def test_gpt_mask_crosses_every_cut_between_layers_and_head_is_tied(
    gpt: tuple[nn.Module, torch.Tensor, CapturedModel],
) -> None:
    model, _, captured = gpt
    names = [b.name for b in captured.blocks]
    last_layer = names.index("layers.2")
    for k, cut in enumerate(captured.cuts):
        masks = [t for t in cut if t.dtype == "bool"]
        if k < last_layer:
            assert [(t.shape, t.nbytes) for t in masks] == [((8, 8), 64)]
        else:
            assert masks == []
    assert captured.tied == {"tok.weight": (0, len(names) - 1)}
    head = captured.blocks[-1]
    assert head.params == ("tok.weight",)
    assert any(p is model.get_parameter("tok.weight") for p in head.program.parameters())
    assert captured.param_shapes["tok.weight"] == (50, 32)
    (logits,) = captured.cuts[-1]
    assert logits.shape == (2, 8, 50) and logits.nbytes == 2 * 8 * 50 * 4


def test_long_skip_is_charged_at_every_cut() -> None:
    captured = capture(make("residual"), example("residual"), max_blocks=4)
    assert [b.name for b in captured.blocks] == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    stem = captured.blocks[0].outputs[0]
    assert stem.nbytes == 4 * 16 * 4
    assert stem.consumers == (1, 4)  # the first block and the head's long-skip add
    assert [t.name for t in captured.cuts[0]] == [stem.name]
    for cut in captured.cuts[1:4]:
        assert [t.producer for t in cut] == [0, cut[1].producer] and cut[0] is stem
    assert sum(t.nbytes for t in captured.cuts[2]) == 2 * 256


def test_loss_model_carries_targets_to_the_last_block() -> None:
    captured = capture(make("loss"), example("loss"))
    y = captured.inputs[1]
    assert (y.dtype, y.shape, y.producer, y.consumers) == ("int64", (6,), -1, (3,))
    assert all(y in cut for cut in captured.cuts[:-1])
    (loss,) = captured.cuts[-1]
    assert (loss.shape, loss.nbytes, loss.consumers) == ((), 4, (4,))


def test_input_forms() -> None:
    model = make("two_inputs")
    a, b = example("two_inputs")
    reference = model(a, b)
    for form in [(a, b), [a, b], {"b": b, "a": a}, ((a,), {"b": b})]:
        captured = capture(model, form)
        assert [blk.name for blk in captured.blocks] == ["enc_a", "enc_b", "head"]
        assert [t.shape for t in captured.inputs] == [(4, 6), (4, 4)]
        assert [t.name for t in captured.cuts[0]] == [
            captured.inputs[1].name,
            captured.blocks[0].outputs[0].name,
        ]
        env = {captured.inputs[0].name: a, captured.inputs[1].name: b}
        for blk in captured.blocks:
            outputs = blk.program(*(env[t.name] for t in blk.inputs))
            env.update(zip([t.name for t in blk.outputs], outputs, strict=True))
        assert torch.equal(env[captured.cuts[-1][0].name], reference)


def test_modules_method_matches_export() -> None:
    model, x = make("param_free"), example("param_free")
    by_export, by_hooks = capture(model, x), capture(model, x, method="modules")
    assert by_hooks.method == "modules" and by_hooks.split_graph is None
    assert [b.name for b in by_hooks.blocks] == [b.name for b in by_export.blocks]
    assert [[t.nbytes for t in cut] for cut in by_hooks.cuts] == [
        [t.nbytes for t in cut] for cut in by_export.cuts
    ]
    assert [b.params for b in by_hooks.blocks] == [b.params for b in by_export.blocks]
    assert all(b.op_count >= 1 for b in by_hooks.blocks)
    assert torch.equal(replay(by_hooks, x)[0], model(x))


def test_auto_falls_back_to_hooks_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_autopart.capture"):
        captured = capture(make("data_dependent"), example("data_dependent"))
    assert captured.method == "modules"
    assert "DataDependent" in caplog.text and "module hooks" in caplog.text
    with pytest.raises(CaptureError, match=r"DataDependent with torch\.export"):
        capture(make("data_dependent"), example("data_dependent"), method="export")


def test_meta_capture_of_a_big_stack_is_fast() -> None:
    start = time.perf_counter()
    with torch.device("meta"):
        model, x = Net(5000, 100), torch.randn(8, 5000)
    captured = capture(model, x)
    assert time.perf_counter() - start < 20
    assert captured.method == "export" and captured.num_blocks == 100
    assert captured.batch_size == 8
    assert all(a.is_meta for b in captured.blocks for a in b.args)
    assert all(p.is_meta for p in model.parameters())
    assert [sum(t.nbytes for t in cut) for cut in captured.cuts] == [8 * 5000 * 4] * 100
    assert sum(s[0] * s[-1] for s in captured.param_shapes.values() if len(s) == 2) == 100 * 5000 * 5000


def test_max_blocks_splits_one_huge_child() -> None:
    model, x = make("huge_child"), example("huge_child")
    assert [b.name for b in capture(model, x, max_blocks=4).blocks] == ["embed", "body", "head"]
    assert capture(model, x, max_blocks=10).num_blocks == 10
    assert block_modules(model, 64, param_weight(model))[1:3] == ["body.layers.0", "body.layers.1"]
    # containers are expanded even past max_blocks
    assert capture(make("mlp"), example("mlp"), max_blocks=2).num_blocks == 4


def test_block_helpers() -> None:
    group, blocks = runs([None, 0, 0, 1, 0, 2, None, 3, None])
    assert blocks == [0, 1, 0, 2, 3]  # block 0 runs twice: two groups
    assert group == [0, 0, 0, 1, 2, 3, 4, 4, 4]
    assert collapse(["a", "b.x", "b.y", "c"], "b") == ["a", "b", "c"]
    single = nn.Linear(3, 3)
    assert block_modules(single, 8, param_weight(single)) == [""]
    captured = capture(single, torch.randn(2, 3))
    assert [(b.name, b.modules, b.params) for b in captured.blocks] == [("Linear", ("",), ("weight", "bias"))]


def test_uncapturable_model_names_the_glue_and_both_failures() -> None:
    with pytest.raises(CaptureError) as info:
        capture(make("uncapturable"), example("uncapturable"))
    message = str(info.value)
    assert "cannot capture Uncapturable: input 0 of block 'l2' is computed in Uncapturable.forward" in message
    assert "torch.export failed with: " in message and "data-dependent" in message
    assert "Move that computation into a submodule" in message


def test_hooks_refuse_glue_and_repeated_calls() -> None:
    with pytest.raises(CaptureError, match=r"input 0 of block 'pos' is computed in GPT\.forward"):
        capture(GPT(), example("gpt"), method="modules")
    with pytest.raises(
        CaptureError,
        match=r"block 'shared' is called more than once in CalledTwice\.forward\. Call each submodule once",
    ):
        capture(make("called_twice"), example("called_twice"), method="modules")


def test_bad_inputs_and_settings() -> None:
    with pytest.raises(
        CaptureError, match=r"Net.forward\(example_inputs\) raised RuntimeError: mat1 and mat2"
    ):
        capture(make("mlp"), torch.randn(4, 7))
    with pytest.raises(CaptureError, match="ReLU: it has no parameters and no submodules"):
        capture(nn.ReLU(), torch.randn(2))
    with pytest.raises(ConfigError, match="unknown capture method 'fx'"):
        capture(make("mlp"), example("mlp"), method="fx")
    with pytest.raises(ConfigError, match="max_blocks"):
        capture(make("mlp"), example("mlp"), max_blocks=0)


def test_meta_data_dependent_forward_suggests_real_inputs() -> None:
    with torch.device("meta"):
        model, x = make("data_dependent"), torch.randn(3, 8)
    with pytest.raises(CaptureError, match=r"DataDependent\.forward.*meta.*--profile measure"):
        capture(model, x)


class _CpuPositions(nn.Module):
    """Adds positions it makes with no device: a CPU tensor whatever device the model is on."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + torch.arange(x.shape[-1])


def test_a_forward_that_mixes_devices_is_told_the_cause_and_the_fix() -> None:
    """A tensor made in forward with no device is on the CPU: on meta, as on a GPU, adding it to the model's
    tensors fails. The message says so and how to make it (not that meta cannot run data-dependent code)."""
    with torch.device("meta"):
        model = _CpuPositions()
    with pytest.raises(CaptureError, match=r"mixes tensors on two devices.*device=x\.device") as raised:
        capture(model, torch.zeros(2, 8, device="meta"))
    assert "data-dependent" not in str(raised.value)
