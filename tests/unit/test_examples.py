"""Tests of the example models and their synthetic data sets."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import lightning as L
import pytest
import torch
from torch import nn

from examples.data import SyntheticImages, SyntheticRegression, SyntheticTokens
from examples.gpt import GPT
from examples.mlp import UnevenMLP
from examples.resnet import ResNet
from examples.tutorial import Net, main

# name -> (factory of a small configuration, expected output shape for its example_input_array)
SMALL: dict[str, tuple[Callable[[], L.LightningModule], tuple[int, ...]]] = {
    "net": (lambda: Net(hidden=16, layers=3, batch_size=4, num_samples=16), (2, 16)),
    "resnet26": (
        lambda: ResNet(depth=26, width_factor=1, num_classes=10, image_size=32, batch_size=4, num_samples=8),
        (2, 10),
    ),
    "resnet50": (
        lambda: ResNet(depth=50, width_factor=1, num_classes=10, image_size=32, batch_size=4, num_samples=8),
        (2, 10),
    ),
    "gpt": (lambda: GPT.from_preset("tiny", batch_size=4, num_samples=8), (2, 32, 256)),
    "gpt_untied": (
        lambda: GPT.from_preset("tiny", tie_weights=False, batch_size=4, num_samples=8),
        (2, 32, 256),
    ),
    "mlp": (lambda: UnevenMLP(widths=[8, 64, 4, 32, 6], batch_size=4, num_samples=16), (2, 6)),
}

# name -> factory of a large configuration (built on the meta device only)
LARGE: dict[str, Callable[[], L.LightningModule]] = {
    "net_5000x100": lambda: Net(5000, 100),
    "resnet152x8": lambda: ResNet(152, 8),
    "gpt_xl": lambda: GPT.from_preset("xl"),
    "mlp_default": lambda: UnevenMLP(),
}


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_shape(name: str) -> None:
    factory, shape = SMALL[name]
    model = factory()
    with torch.no_grad():
        out = model(model.example_input_array)
    assert out.shape == shape
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_training_step_returns_finite_scalar_with_gradients(name: str) -> None:
    model = SMALL[name][0]()
    batch = next(iter(model.train_dataloader()))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer attached
        loss = model.training_step(batch, 0)
    assert isinstance(loss, torch.Tensor)
    assert loss.ndim == 0
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_fast_dev_run_with_a_real_trainer(name: str) -> None:
    model = SMALL[name][0]()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        fast_dev_run=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    assert trainer.global_step == 1
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert torch.isfinite(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("name", sorted(LARGE))
def test_large_configuration_builds_on_meta(name: str) -> None:
    with torch.device("meta"):
        model = LARGE[name]()
    assert all(p.is_meta for p in model.parameters())
    assert model.example_input_array is not None
    assert isinstance(model.example_input_array, torch.Tensor)
    assert model.example_input_array.is_meta
    assert model.example_input_array.shape[0] == 2  # a small batch, not a full one


def test_net_5000x100_has_the_tutorial_parameter_count() -> None:
    with torch.device("meta"):
        model = Net(5000, 100)
    assert _num_params(model) == 2_500_500_000


def test_resnet152x8_is_about_3_7_billion_parameters() -> None:
    with torch.device("meta"):
        model = ResNet(152, 8)
    assert 3.5e9 <= _num_params(model) <= 3.9e9
    assert _num_params(model) == 3_728_582_120


def test_resnet50_matches_the_standard_parameter_count() -> None:
    with torch.device("meta"):
        model = ResNet(50, 1)
    assert _num_params(model) == 25_557_032  # torchvision's resnet50


def test_resnet_top_level_is_a_chain_of_stages() -> None:
    with torch.device("meta"):
        model = ResNet(152, 1)
    names = [name for name, _ in model.named_children()]
    assert names == ["stem", "layer1", "layer2", "layer3", "layer4", "head"]
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 8, 36, 3]


def test_resnet_rejects_an_unknown_depth() -> None:
    with pytest.raises(ValueError, match="depth=34"):
        ResNet(depth=34)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_tied_head_shares_the_embedding_parameter(tie: bool) -> None:
    with torch.device("meta"):
        model = GPT.from_preset("xl", tie_weights=tie)
    assert (model.head.weight is model.tok_emb.weight) == tie
    assert _num_params(model) == (1_557_611_200 if tie else 1_638_022_400)


def test_gpt_is_causal() -> None:
    model = GPT.from_preset("tiny").eval()
    tokens = model.example_input_array
    assert isinstance(tokens, torch.Tensor)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :-1], model(changed)[:, :-1])


def test_uneven_mlp_layers_differ_strongly_in_cost() -> None:
    with torch.device("meta"):
        model = UnevenMLP()
    sizes = [_num_params(m) for m in model.layers if isinstance(m, nn.Linear)]
    assert max(sizes) / min(sizes) > 1000


def test_synthetic_data_is_deterministic_per_index() -> None:
    for data in (
        SyntheticRegression(4, 8, seed=3),
        SyntheticTokens(4, 16, 50, seed=3),
        SyntheticImages(4, seed=3),
    ):
        for a, b in zip(data[2], data[2], strict=True):
            torch.testing.assert_close(a, b)
        assert not torch.equal(data[0][0], data[1][0])
        with pytest.raises(IndexError):
            data[4]


def test_synthetic_regression_targets_come_from_a_linear_teacher() -> None:
    data = SyntheticRegression(3, 8, out_dim=5)
    (x0, y0), (x1, y1) = data[0], data[1]
    assert y0.shape == (5,)
    # A linear teacher: the target of a sum is the sum of the targets.
    torch.testing.assert_close(((x0 + x1) @ data.u) @ data.v, y0 + y1)


def test_synthetic_tokens_mostly_count_upwards() -> None:
    tokens, targets = SyntheticTokens(1, 1000, vocab=97, noise=0.1)[0]
    assert tokens.shape == targets.shape == (1000,)
    torch.testing.assert_close(tokens[1:], targets[:-1])
    follows = (targets == (tokens + 1) % 97).float().mean().item()
    assert 0.7 < follows < 0.9  # about (1 - noise) ** 2


def test_synthetic_images_shapes_and_labels() -> None:
    image, label = SyntheticImages(2, channels=3, size=16, classes=7)[1]
    assert image.shape == (3, 16, 16)
    assert label.dtype == torch.int64
    assert 0 <= int(label) < 7


def test_tutorial_main_trains_and_reports_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--hidden", "32", "--layers", "2", "--batch-size", "8", "--max-steps", "3", "--devices", "1", "--strategy", "auto"])
    out = capsys.readouterr().out
    assert "#Parameters=2112" in out
    assert "samples/s" in out
