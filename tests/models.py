"""A zoo of tiny models for the tests, each registered with a factory and an example-input maker."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.idioms import (
    Factory,
    FrozenNorm,
    GradientTricks,
    KeptFunctions,
    ModeBranch,
    Positional,
    Structured,
    WideResidual,
)

__all__ = ["ZOO", "ZooModel", "example", "make"]


class Net(nn.Module):
    """A stack of ``depth`` Linear(width, width) layers with ReLU in the root forward."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class ResBlock(nn.Module):
    """Pre-norm residual MLP block: the skip add lives inside the block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """Residual blocks plus a long skip from the stem to the head, added in the root forward."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        skip = h
        for block in self.blocks:
            h = block(h)
        return self.head(h + skip)


class Attention(nn.Module):
    """Multi-head causal self-attention; the mask comes from the caller."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: causal mask built in forward, head weight tied to the token embedding."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 2, depth: int = 3, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.ln_f(x))


class BasicBlock(nn.Module):
    """ResNet basic block with an optional strided 1x1 downsample on the skip."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.down(x))


class ResNet(nn.Module):
    """A tiny ResNet: stem, two basic blocks, pooling, a flatten in forward, classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.stage1 = BasicBlock(8, 8, 1)
        self.stage2 = BasicBlock(8, 16, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stage2(self.stage1(self.stem(x))))
        return self.fc(torch.flatten(x, 1))


class TwoInputs(nn.Module):
    """Two inputs, each with its own encoder, joined in the root forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc_a = nn.Linear(6, 8)
        self.enc_b = nn.Linear(4, 8)
        self.head = nn.Linear(16, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.enc_a(a), self.enc_b(b)], dim=-1))


class WithLoss(nn.Module):
    """forward(x, y) returns a scalar cross-entropy loss computed in the root forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(self.body(x)), y)


class ParamFree(nn.Module):
    """Parameter-free children (ReLU, Flatten) between parameterised ones."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flat(self.act(self.conv(x))))


class Gate(nn.Module):
    """Data-dependent control flow inside a child: torch.export fails, module hooks work."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * 2 if h.sum() > 0 else h - 1


class DataDependent(nn.Module):
    """A root forward that only chains children; one child branches on its data."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.gate = Gate(width)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


class Uncapturable(nn.Module):
    """Glue and data-dependent control flow in the root forward: neither method can capture it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.l1 = nn.Linear(width, width)
        self.l2 = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = h * 2 if h.sum() > 0 else h - 1
        return self.l2(h)


class Body(nn.Module):
    """One child that holds almost all the parameters (a candidate for splitting)."""

    def __init__(self, width: int = 32, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class HugeChild(nn.Module):
    """Small embed and head around one huge ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 32)
        self.body = Body()
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


class CalledTwice(nn.Module):
    """A module called at two distant places: its block absorbs everything in between."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.shared(self.mid(self.shared(x))))


class LitWrapper(L.LightningModule):
    """A LightningModule whose forward calls a wrapped model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ResidualMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry: how to build the model and its example inputs (as ``capture`` takes them)."""

    factory: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Any]


def _randn(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(*shape, generator=g)


ZOO: dict[str, ZooModel] = {
    "mlp": ZooModel(Net, _randn(4, 16)),
    "residual": ZooModel(ResidualMLP, _randn(4, 8)),
    "gpt": ZooModel(GPT, lambda g: torch.randint(0, 50, (2, 8), generator=g)),
    "resnet": ZooModel(ResNet, _randn(2, 3, 8, 8)),
    "two_inputs": ZooModel(
        TwoInputs, lambda g: (torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g))
    ),
    "loss": ZooModel(
        WithLoss, lambda g: (torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g))
    ),
    "param_free": ZooModel(ParamFree, _randn(2, 1, 6, 6)),
    "data_dependent": ZooModel(DataDependent, _randn(3, 8)),
    "uncapturable": ZooModel(Uncapturable, _randn(3, 8)),
    "huge_child": ZooModel(HugeChild, _randn(3, 4)),
    "called_twice": ZooModel(CalledTwice, _randn(3, 8)),
    "lightning": ZooModel(LitWrapper, _randn(4, 8)),
    "factory": ZooModel(Factory, lambda g: torch.randint(0, 20, (4, 6), generator=g)),
    "structured": ZooModel(
        Structured, lambda g: (torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g))
    ),
    "wide_residual": ZooModel(WideResidual, _randn(3, 4)),
    "positional": ZooModel(Positional, lambda g: torch.randint(0, 50, (2, 8), generator=g)),
    "gradient_tricks": ZooModel(GradientTricks, _randn(4, 16)),
    "kept_functions": ZooModel(KeptFunctions, _randn(4, 16)),
    "frozen_norm": ZooModel(FrozenNorm, _randn(4, 16)),
    "mode_branch": ZooModel(ModeBranch, _randn(4, 16)),
}


def make(name: str, seed: int = 0) -> nn.Module:
    """A fresh zoo model, with deterministic weights."""
    torch.manual_seed(seed)
    return ZOO[name].factory()


def example(name: str, seed: int = 0) -> Any:
    """Deterministic example inputs for a zoo model."""
    return ZOO[name].inputs(torch.Generator().manual_seed(seed))
