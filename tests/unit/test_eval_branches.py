"""A forward that runs other operations in evaluation mode is found at capture, and its stages run programs
cut from the evaluation-mode graph in evaluation steps, or those steps are refused where none can be cut;
attention's dropout follows the mode ([Note: Python branches on the mode] in capture/modes.py, [Note: modes]
in capture/portable.py)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart.capture import capture
from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.runtime.stages import build_stage_module
from tests.eager import run_captured, run_stages
from tests.idioms import ModeBranch


class DropPath(nn.Module):
    """Stochastic depth as Swin, BEiT and timm write it: a Python branch on the mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = torch.rand(x.shape[0], 1) >= self.p
        return x * keep / (1 - self.p)


class Residual(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.layer, self.drop_path = nn.Linear(8, 8), DropPath(p)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop_path(self.layer(x))


class Picks(nn.Module):
    """Feeds its layer another tensor in evaluation mode: no operation differs, only the wiring."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        return self.b(y if self.training else x)


class Attention(nn.Module):
    """Self-attention through scaled_dot_product_attention, its dropout written as Hugging Face writes it, or
    kept in evaluation too (``always``)."""

    def __init__(self, always: bool = False) -> None:
        super().__init__()
        self.qkv, self.always = nn.Linear(8, 24), always

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 1, 4, 6).chunk(3, dim=-1)  # 4 tokens of width 2
        p = 0.5 if self.training or self.always else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p).flatten(1)


def _model(middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), middle, nn.Linear(8, 2))


def test_dropout_and_batch_norm_follow_the_mode_and_are_no_branch() -> None:
    assert capture(_model(nn.Linear(8, 8)), torch.randn(4, 8), check_eval=True).eval_branches == ()


@pytest.mark.parametrize(("middle", "found"), [(Residual(0.2), "3.drop_path"), (Picks(), "3.b")])
def test_a_python_branch_on_the_mode_is_found(middle: nn.Module, found: str) -> None:
    captured = capture(_model(middle), torch.randn(4, 8), check_eval=True)
    assert found in captured.eval_branches, captured.eval_branches
    assert any("evaluation mode" in note and repr(found) in note for note in captured.notes), captured.notes
    assert capture(_model(middle), torch.randn(4, 8)).eval_branches == ()


def test_attention_dropout_written_with_the_mode_follows_it() -> None:
    model = _model(Attention())
    x = torch.randn(4, 8)
    captured = capture(model, x, check_eval=True)
    assert captured.eval_branches == ()
    model.eval()
    torch.testing.assert_close(run_captured(captured, x), model(x))  # no attention dropout in evaluation
    model.train()
    first, second = run_captured(captured, x), run_captured(captured, x)
    assert not torch.equal(first, second)  # dropout in training


def test_attention_dropout_kept_in_evaluation_is_a_branch() -> None:
    assert capture(_model(Attention(always=True)), torch.randn(4, 8), check_eval=True).eval_branches == ("3",)


def test_hugging_face_drop_path_is_found_and_attention_dropout_follows_the_mode() -> None:
    hf = pytest.importorskip("tests.hf_architectures")
    swin = hf.build("swin", "cpu", dropout=True)  # drop_path_rate 0.1, Swin's default
    inputs = hf.inputs("swin", "cpu")
    captured = capture(swin, inputs, check_eval=True)
    assert captured.eval_branches and all("drop_path" in b for b in captured.eval_branches)
    assert captured.evaluates
    swin.eval()
    got = run_stages(captured, 2, *inputs.values())
    torch.testing.assert_close(got["logits"], swin(**inputs).logits, rtol=0, atol=0)  # no path dropped
    torch.manual_seed(0)
    roberta = hf.build("roberta", "cpu", dropout=True)  # attention dropout 0.1 through sdpa
    inputs = hf.inputs("roberta", "cpu")
    captured = capture(roberta, inputs, check_eval=True)
    assert captured.eval_branches == ()
    roberta.eval()
    got = run_captured(captured, *inputs.values())
    torch.testing.assert_close(got["logits"], roberta(**inputs).logits)  # was dropped at random


@pytest.mark.parametrize("name", ["qwen2", "bart"])
def test_hugging_face_checkpointing_keeps_a_cache_in_evaluation_only_and_is_followed(name: str) -> None:
    """With ``gradient_checkpointing_enable()``, Hugging Face turns the cache off in training only: the two
    graphs differ (the cache's updates), and evaluation runs its own programs, equal to eager evaluation."""
    hf = pytest.importorskip("tests.hf_architectures")
    torch.manual_seed(0)
    model, inputs = hf.build(name, "cpu", dropout=True), hf.inputs(name, "cpu")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    captured = capture(model, inputs, check_eval=True)
    assert captured.eval_branches and captured.evaluates
    model.eval()
    with torch.no_grad():
        got, want = run_stages(captured, 3, *inputs.values()), model(**inputs)
    torch.testing.assert_close(got["logits"], want.logits, rtol=0, atol=0)


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), Residual(0.5), nn.Linear(8, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_stages_run_the_evaluation_program_in_evaluation_mode() -> None:
    model, x = _model(Residual(0.5)), torch.randn(4, 8)
    captured = capture(model, x, check_eval=True)
    assert captured.evaluates
    assert all(b.eval_program is not None for b in captured.blocks)
    assert any("evaluation steps run programs cut from" in note for note in captured.notes), captured.notes
    stages = [build_stage_module(captured, 0, 4), build_stage_module(captured, 4, 6)]
    model.eval()
    torch.testing.assert_close(stages[1](*stages[0](x))[0], model(x), rtol=0, atol=0)
    model.train()  # training: paths dropped at random; gradients reach the first layer through both stages
    torch.manual_seed(1)
    out = stages[1](*stages[0](x))[0]
    out.sum().backward()
    assert model[0].weight.grad is not None and model[3].layer.weight.grad is not None
    model[3].drop_path.eval()  # the branching module's own mode picks the program; dropout still drops
    torch.manual_seed(2)
    got = stages[1](*stages[0](x))[0]
    torch.manual_seed(2)
    torch.testing.assert_close(got, model(x), rtol=0, atol=0)


def test_a_block_with_no_operation_in_evaluation_passes_its_input_on() -> None:
    """``ModeBranch``'s ``halve`` is a block of its own, with no operation in evaluation mode."""
    model, x = ModeBranch(), torch.randn(4, 16)
    captured = capture(model, x, check_eval=True)
    assert [b.name for b in captured.blocks] == ["a", "halve", "b"] and captured.eval_branches == ("halve",)
    assert captured.evaluates
    for training in (False, True):
        model.train(training)
        torch.testing.assert_close(run_stages(captured, 3, x), model(x), rtol=0, atol=0)


def test_the_evaluation_program_follows_the_stage_tensors_after_a_move() -> None:
    """The runtime moves a stage's tensors (``.data``) and materialises meta ones (swapped in place) after
    building it; a state dict may be loaded with ``assign``: evaluation reads the tensors the stage holds
    now."""
    model, x = _model(Residual(0.5)), torch.randn(4, 8)
    captured = capture(model, x, check_eval=True)
    stage = build_stage_module(captured, 0, captured.num_blocks)
    model.eval()
    stage(x)
    model[4].weight.data = torch.randn(2, 8)  # as move_in_place does
    torch.testing.assert_close(stage(x)[0], model(x), rtol=0, atol=0)
    model[4].weight = stage.get_submodule("4").weight = nn.Parameter(torch.randn(2, 8))  # a new tensor
    torch.testing.assert_close(stage(x)[0], model(x), rtol=0, atol=0)


def test_modules_that_branch_in_mixed_modes_are_refused() -> None:
    model, x = _model(nn.Sequential(Residual(0.5), Residual(0.5))), torch.randn(4, 8)
    captured = capture(model, x, check_eval=True)
    assert captured.eval_branches == ("3.0.drop_path", "3.1.drop_path")
    stage = build_stage_module(captured, 0, captured.num_blocks)
    model.eval()
    model[3][1].drop_path.train()  # one program per mode, not one per mix
    with pytest.raises(ConfigError, match=r"mixed modes \(training: '3\.1\.drop_path'; evaluating: '3\.0"):
        stage(x)


def test_a_branch_that_changes_what_crosses_a_cut_keeps_one_program_and_is_refused() -> None:
    """A later block reads the model's input in evaluation only: no program can stand in for its training one;
    a branch that rewires values a block already reads is followed."""

    class Rewired(nn.Module):
        def __init__(self, read_input: bool) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
            self.read_input = read_input

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            y = self.b(h)
            return self.c(y if self.training else y + (x if self.read_input else h))

    model, x = Rewired(read_input=True), torch.randn(4, 8)
    captured = capture(model, x, check_eval=True)
    assert captured.eval_branches and not captured.evaluates
    assert any("exchange other values" in n and "refused" in n for n in captured.notes), captured.notes
    model = Rewired(read_input=False)
    captured = capture(model, x, check_eval=True)
    assert captured.evaluates
    model.eval()
    torch.testing.assert_close(run_stages(captured, 3, x), model(x), rtol=0, atol=0)


class LitRewired(Lit):
    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        return y if self.training else y + x.mean(-1, keepdim=True)


def _trainer(**more: Any) -> L.Trainer:
    options: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False}
    options |= {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    strategy = AutoPartitionStrategy(num_stages=1, profile="estimate")
    return L.Trainer(strategy=strategy, **{"num_sanity_val_steps": 0, **options, **more})


def test_pipelined_validation_follows_the_evaluation_mode() -> None:
    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    torch.manual_seed(0)
    model = Lit()
    trainer = _trainer()
    trainer.fit(model, data, data)
    model.eval()
    with torch.no_grad():
        expected = torch.stack([F.mse_loss(model(x), y) for x, y in data]).mean()
    torch.testing.assert_close(trainer.callback_metrics["val_loss"], expected)  # no path dropped at random


def test_a_pipelined_validation_the_stages_cannot_follow_is_refused_with_the_fix() -> None:
    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    _trainer().fit(LitRewired(), data)
    with pytest.raises(ConfigError, match=r"validation_step .*drop_path_rate=0\.0"):
        _trainer(num_sanity_val_steps=2).fit(LitRewired(), data, data)


def test_under_module_hooks_blocks_called_otherwise_in_evaluation_are_found() -> None:
    """Module hooks freeze the glue between blocks: ``Picks`` feeds ``b`` another tensor in evaluation."""
    model = nn.Sequential(nn.Linear(8, 8), Picks(), nn.Linear(8, 2))
    captured = capture(model, torch.randn(4, 8), method="modules", check_eval=True)
    assert captured.eval_branches == ("Sequential",)
    assert any("calls its blocks otherwise" in note for note in captured.notes), captured.notes
    assert model.training and model[1].training  # modes put back
    plain = capture(_model(Residual(0.0)), torch.randn(4, 8), method="modules", check_eval=True)
    assert plain.eval_branches == ()  # dropout and batch norm run in their blocks, as written
