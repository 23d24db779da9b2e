"""Capture of models whose submodules, parameters or buffers are named by Python keywords ("global", "class") or
by names that are not identifiers ("0-a", "my key"): fx wrote ``self.heads.global`` ([Note: keyword names])."""

from __future__ import annotations

import itertools
from typing import Any

import lightning as L
import pytest
import torch
import torch.fx.graph as fx_graph
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_autopart.capture import capture, keywords
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.errors import CaptureError
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.runtime.stages import build_stage_module

_KEYS = ("global", "local", "lambda", "in", "def", "0-a", "my key")


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("class", torch.full((8,), 0.5))  # a buffer named by a keyword

    def forward(self, x: Tensor) -> Tensor:
        return x * getattr(self, "class")


class _Keyed(nn.Module):
    """Heads in a ModuleDict keyed by keywords and odd names, root attributes named so, a glue ``torch.stack``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = nn.ModuleDict({k: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Layer()) for k in _KEYS})
        self.add_module("class", nn.Linear(8, 8))
        setattr(self, "none key", nn.Linear(8, 8))  # a name that is no identifier
        self.register_parameter("if", nn.Parameter(torch.ones(8)))

    def forward(self, x: Tensor) -> Tensor:
        h = getattr(self, "class")(x) * getattr(self, "if")
        h = torch.stack([self.heads[k](h) for k in _KEYS]).sum(0)
        return getattr(self, "none key")(h)


def _chain(captured: CapturedModel, x: Tensor) -> Tensor:
    """The model's output through every block program, chained by the values' names."""
    env: dict[str, Any] = {captured.inputs[0].name: x}
    for block in captured.blocks:
        outs = block.program(*(env[t.name] for t in block.inputs))
        env.update(zip([t.name for t in block.outputs], outs, strict=True))
    return env[captured.cuts[-1][0].name]


@pytest.mark.parametrize("check_eval", [False, True])
def test_keyword_names_are_exported_with_the_users_names(check_eval: bool) -> None:
    model, x = _Keyed(), torch.randn(3, 8)
    captured = capture(model, x, method="export", check_eval=check_eval)
    assert captured.method == "export" and captured.num_blocks >= len(_KEYS)
    assert {b.name.split(".")[1] for b in captured.blocks if b.name.startswith("heads.")} == set(_KEYS)
    held = {n for b in captured.blocks for n in b.params}
    assert held == {n for n, _ in model.named_parameters()}
    assert {"class.weight", "if", "heads.global.0.weight", "heads.my key.0.bias"} <= held
    assert {n for b in captured.blocks for n in b.buffers} == {f"heads.{k}.2.class" for k in _KEYS}
    with torch.no_grad():
        torch.testing.assert_close(_chain(captured, x), model(x))


def test_gradients_reach_the_users_parameters() -> None:
    model, x = _Keyed(), torch.randn(3, 8)
    captured = capture(model, x, method="export")
    model(x).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    _chain(captured, x).square().mean().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], msg=name)


def test_stages_keep_the_users_names() -> None:
    model, x = _Keyed(), torch.randn(3, 8)
    captured = capture(model, x)
    assert captured.method == "export"
    whole = build_stage_module(captured, 0, captured.num_blocks)
    assert set(whole.state_dict()) == set(model.state_dict())
    assert {n for n, _ in whole.named_parameters()} == {n for n, _ in model.named_parameters()}
    half = captured.num_blocks // 2
    values: tuple[Tensor, ...] = (x,)
    with torch.no_grad():
        for start, end in itertools.pairwise([0, half, captured.num_blocks]):
            values = build_stage_module(captured, start, end)(*values)
        torch.testing.assert_close(captured.output.rebuild(values), model(x))


def test_exported_program_module_runs() -> None:
    model, x = _Keyed(), torch.randn(3, 8)
    capture(model, x)  # makes fx write keyword names with getattr
    program = torch.export.export(model, (x,), strict=False).module()
    with torch.no_grad():
        torch.testing.assert_close(program(x), model(x))


def test_other_names_are_written_as_torch_writes_them() -> None:
    assert keywords.keyword_safe_codegen()
    assert keywords.keyword_safe_codegen()  # installed once
    written = fx_graph._format_target
    original = getattr(written, "__wrapped__", written)
    assert not getattr(original, "_autopart_keywords", False)
    assert written("self", "heads.global.w") == 'getattr(self.heads, "global").w'
    for target in ("a.b", "layers.0.weight", "heads.my key.bias", "x.0-a"):
        assert written("self", target) == original("self", target)


def test_keyword_names_are_found() -> None:
    names = keywords.keyword_names(_Keyed())
    assert ("", "class") in names and ("", "if") in names and ("heads", "global") in names
    assert ("heads.global.2", "class") in names and ("", "none key") not in names
    assert keywords.keyword_names(nn.Sequential(nn.Linear(2, 2))) == []


def test_a_torch_whose_code_does_not_compile_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keywords, "_compiles", lambda: False)
    message = r"module 'heads' of _Heads holds 'global' \(and 1 more\), a Python keyword, .*rename the key"
    with pytest.raises(CaptureError, match=message):
        capture(_Heads(), torch.randn(3, 8))
    assert capture(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), torch.randn(3, 8)).num_blocks == 2


class _Heads(nn.Module):
    """The report's model: Gemma-like heads keyed "global" and "local"."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = nn.ModuleDict(
            {"global": nn.Linear(8, 8), "local": nn.Linear(8, 8), "for": nn.Linear(8, 8)}
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.heads["global"](x) + self.heads["local"](x) * self.heads["for"](x)


class _Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Keyed()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x) + x  # glue in the root: only an export captures it

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _train(strategy: Any) -> _Lit:
    """Two SGD steps of :class:`_Lit` on one CPU process, on the batches the strategy's sampler draws."""
    g = torch.Generator().manual_seed(1)
    data: Dataset[Any] = TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
    if strategy == "auto":  # the strategy's DistributedSampler(shuffle=True, seed=0) order
        data = Subset(data, torch.randperm(8, generator=torch.Generator().manual_seed(0)).tolist())
    lit = _Lit()
    L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(lit, DataLoader(data, batch_size=4))
    return lit


@pytest.mark.usefixtures("master_port")
def test_the_strategy_trains_it_as_lightning_does() -> None:
    trained = _train(AutoPartitionStrategy(num_stages=1, profile="estimate"))
    torch.distributed.destroy_process_group()
    reference = _train("auto")
    got, want = dict(trained.named_parameters()), dict(reference.named_parameters())
    assert got.keys() == want.keys() and "model.heads.global.0.weight" in got
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert "model.heads.global.2.class" in trained.state_dict()
