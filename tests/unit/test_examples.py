"""Tests of the example models and their synthetic data sets."""

from __future__ import annotations

import functools
import math
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from examples.data import SyntheticImages, SyntheticRegression, SyntheticTokens
from examples.gpt import GPT
from examples.image_classifier import CIFAR10DataModule, ImageClassifier
from examples.mlp import UnevenMLP
from examples.resnet import RANNC_MODELS, ResNet
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
    model = ["--hidden", "32", "--layers", "2", "--batch-size", "8"]
    main([*model, "--max-steps", "3", "--devices", "1", "--strategy", "auto"])
    out = capsys.readouterr().out
    assert "#Parameters=2112" in out
    assert "samples/s" in out


def test_tutorial_takes_the_seed_positional_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    # The RaNNC tutorial's command line: batch_size hidden layers.
    main(["8", "32", "2", "--max-steps", "3", "--devices", "1", "--strategy", "auto"])
    out = capsys.readouterr().out
    assert "#Parameters=2112" in out  # 2 layers of 32 x 32 + 32
    assert "final train_loss=" in out
    assert "Finished on rank0" in out


def test_resnet_from_name_builds_rannc_models() -> None:
    assert len(RANNC_MODELS) == 9
    with torch.device("meta"):
        model = ResNet.from_name("resnet152x8", num_classes=10)
    h = model.hparams
    assert (h["depth"], h["width_factor"], h["num_classes"]) == (152, 8, 10)
    with pytest.raises(ValueError, match=r"name='resnet18x2'"):
        ResNet.from_name("resnet18x2")


def test_image_classifier_is_torchvision_resnet18() -> None:
    model = ImageClassifier()
    assert _num_params(model) == 11_181_642  # torchvision's resnet18(num_classes=10)
    assert [name for name, _ in model.named_children()] == [
        "stem",
        *(f"layer{i}" for i in range(1, 5)),
        "head",
    ]
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_cifar10_datamodule_synthetic_batches() -> None:
    data = CIFAR10DataModule(batch_size=4, num_samples=10)
    data.setup("fit")
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)
    assert len(data.train_dataloader()) == 2  # drop_last: every batch the planned size
    assert len(data.val_set) == 16


def test_cifar10_datamodule_without_torchvision_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed
    with pytest.raises(ImportError, match=r"data_dir='data'.*pip install torchvision.*leave data_dir unset"):
        CIFAR10DataModule(data_dir="data").prepare_data()


def test_cifar10_datamodule_reads_the_real_data_set_with_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, bool, bool]] = []

    class FakeCIFAR10(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
        def __init__(self, root: str, train: bool, transform: Callable[..., Any], download: bool) -> None:
            calls.append((root, train, download))
            self.transform = transform

        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            return self.transform(torch.ones(3, 32, 32)), index % 10

    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(CIFAR10=FakeCIFAR10)  # type: ignore[attr-defined]
    fake.transforms = types.SimpleNamespace(  # type: ignore[attr-defined]
        Compose=lambda steps: lambda x: functools.reduce(lambda v, f: f(v), steps, x),
        ToTensor=lambda: lambda x: x,
        Normalize=lambda mean, std: (
            lambda x: (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
        ),
    )
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    data = CIFAR10DataModule(data_dir="cifar", batch_size=4)
    data.prepare_data()
    data.setup("fit")
    images, labels = next(iter(data.train_dataloader()))
    # prepare_data downloads both splits; setup reads them.
    assert calls == [("cifar", train, download) for download in (True, False) for train in (True, False)]
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)
    torch.testing.assert_close(images[0, 0, 0, 0], torch.tensor((1 - 0.4914) / 0.2470))


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_hf_causal_lm_builds_from_a_small_config_and_trains(model_type: str) -> None:
    pytest.importorskip("transformers")
    from examples.hf_causal_lm import CausalLM, CausalLMDataModule

    model = CausalLM(model_type, vocab_size=64, seq_len=16, hidden_size=32, num_layers=2, num_heads=2)
    data = CausalLMDataModule(vocab_size=64, seq_len=16, batch_size=2, num_samples=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer attached
        loss = model.training_step(batch, 0)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # About the loss of a uniform guess over the vocabulary, at the start.
    assert 0.5 * math.log(64) < float(loss.detach()) < 2 * math.log(64)
    loss.backward()
    assert model.model.config.use_cache is False


def test_hf_causal_lm_loads_pretrained_weights_from_a_directory(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from examples.hf_causal_lm import CausalLM

    saved = CausalLM("gpt2", vocab_size=64, seq_len=16, hidden_size=32, num_layers=1, num_heads=2)
    saved.model.save_pretrained(tmp_path)
    loaded = CausalLM(pretrained=str(tmp_path), vocab_size=64)
    expected = saved.model.state_dict()
    for name, value in loaded.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], msg=name)
    with pytest.raises(ValueError, match=r"vocab_size=65 exceeds .* 64 tokens; lower data.vocab_size"):
        CausalLM(pretrained=str(tmp_path), vocab_size=65)
