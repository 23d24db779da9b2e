"""A forward that runs other operations in evaluation mode is found at capture, and its pipelined evaluation
steps are refused; attention's dropout follows the mode ([Note: Python branches on the mode] in
capture/modes.py, [Note: modes] in capture/portable.py)."""

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
from tests.eager import run_captured


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
    captured = capture(swin, hf.inputs("swin", "cpu"), check_eval=True)
    assert captured.eval_branches and all("drop_path" in b for b in captured.eval_branches)
    torch.manual_seed(0)
    roberta = hf.build("roberta", "cpu", dropout=True)  # attention dropout 0.1 through sdpa
    inputs = hf.inputs("roberta", "cpu")
    captured = capture(roberta, inputs, check_eval=True)
    assert captured.eval_branches == ()
    roberta.eval()
    got = run_captured(captured, *inputs.values())
    torch.testing.assert_close(got["logits"], roberta(**inputs).logits)  # was dropped at random


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


def test_a_pipelined_validation_of_such_a_model_is_refused_with_the_fix() -> None:
    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    options: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False}
    options |= {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    L.Trainer(strategy=AutoPartitionStrategy(num_stages=1, profile="estimate"), **options).fit(Lit(), data)
    trainer = L.Trainer(strategy=AutoPartitionStrategy(num_stages=1, profile="estimate"), **options)
    with pytest.raises(ConfigError, match=r"validation_step .* 'net\.1\.drop_path'.*drop_path_rate=0\.0"):
        trainer.fit(Lit(), data, data)



def test_under_module_hooks_blocks_called_otherwise_in_evaluation_are_found() -> None:
    """Module hooks freeze the glue between blocks: ``Picks`` feeds ``b`` another tensor in evaluation."""
    model = nn.Sequential(nn.Linear(8, 8), Picks(), nn.Linear(8, 2))
    captured = capture(model, torch.randn(4, 8), method="modules", check_eval=True)
    assert captured.eval_branches == ("Sequential",)
    assert any("calls its blocks otherwise" in note for note in captured.notes), captured.notes
    assert model.training and model[1].training  # modes put back
    plain = capture(_model(Residual(0.0)), torch.randn(4, 8), method="modules", check_eval=True)
    assert plain.eval_branches == ()  # dropout and batch norm run in their blocks, as written
