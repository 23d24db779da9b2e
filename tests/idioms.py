"""Models written the way real model code is: tensors made in forward, structured outputs, shared modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ClippedSqrt",
    "Factory",
    "FrozenNorm",
    "GradientTricks",
    "KVCache",
    "KeptFunctions",
    "ModeBranch",
    "Positional",
    "Reverse",
    "Structured",
    "StructuredOut",
    "WideResidual",
]


class Factory(nn.Module):
    """Creates tensors in forward as transformers do: positions, a causal mask, zeros/full/ones, noise, dropout."""

    def __init__(self, vocab: int = 20, dim: int = 8, seq: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        positions = torch.arange(t, device=idx.device).unsqueeze(0).expand(b, t)
        x = self.tok(idx) + self.pos(positions)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        scores = (x @ x.transpose(1, 2)).masked_fill(mask, float("-inf"))
        x = self.mix(scores.softmax(-1) @ x)
        bias = torch.zeros(x.shape[-1], device=x.device) + torch.full((1,), 0.5, device=x.device)
        noise = torch.randn(x.shape, device=x.device) * 0.0  # randn-style noise (scaled away: deterministic)
        x = F.dropout(x + bias + noise + x.new_ones(()), p=0.1, training=self.training)
        return self.out(x)


class KVCache:
    """A stand-in for a key/value cache object (not a tensor, not a pytree node)."""

    def __init__(self, keys: list[torch.Tensor]) -> None:
        self.keys = keys


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


@dataclass
class StructuredOut:
    """A dataclass output (registered as a pytree node, as transformers registers ``ModelOutput``)."""

    loss: torch.Tensor
    logits: torch.Tensor
    extra: dict[str, Any]


torch.utils._pytree.register_dataclass(StructuredOut)


class Structured(nn.Module):
    """Computes its loss from labels passed in, returns a dataclass holding a dict, a named tuple, a constant
    and a cache object that the loss does not need."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> StructuredOut:
        h = self.body(x)
        logits = self.head(h)
        loss = F.cross_entropy(logits, labels)
        extra = {"pair": Pair(h, logits), "steps": 3, "cache": KVCache([h]), "again": logits}
        return StructuredOut(loss=loss, logits=logits, extra=extra)


class ResBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class WideResidual(nn.Module):
    """One heavy residual block (not a repeated layer) between a small stem and head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.block = ResBlock(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


class _PositionalLayer(nn.Module):
    def __init__(self, dim: int, seq: int) -> None:
        super().__init__()
        self.pos = nn.Embedding(seq, dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x + self.pos(positions))) * keep.unsqueeze(-1)


class Positional(nn.Module):
    """int64 position ids and a bool padding mask, made once in forward, cross every cut to every layer."""

    def __init__(self, vocab: int = 50, dim: int = 16, seq: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_PositionalLayer(dim, seq) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        positions = torch.arange(t, device=idx.device).unsqueeze(0).expand(b, t).contiguous()
        keep = idx % 7 != 0
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, positions, keep)
        return self.head(x)


class Reverse(torch.autograd.Function):
    """A gradient reversal layer (domain adaptation): identity forward, negated gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class _Reverse(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Reverse.apply(x)


class ClippedSqrt(torch.autograd.Function):
    """A square root whose gradient is clipped (RecurrentGemma's ``SqrtBoundDerivative``): not the derivative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sqrt()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / (4.0 * x).clamp(min=0.25).sqrt()


class KeptFunctions(nn.Module):
    """Custom autograd Functions called from a forward among other operations, as Hugging Face models call
    them: the capture exports the model and keeps each Function whole, with its own backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ClippedSqrt.apply(self.a(x).square() + 0.01) * 0.5
        h = self.b(Reverse.apply(h) + x)
        return self.c(torch.tanh(h))


class _HookedLinear(nn.Linear):
    """Scales its output's gradient with a tensor hook registered in its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if y.requires_grad:
            y.register_hook(lambda g: g * 0.25)
        return y


class GradientTricks(nn.Module):
    """Code that changes gradients outside any operation, all of which torch.export would drop: a custom
    autograd Function, a tensor hook registered in a forward, and a module backward hook. The forward calls
    submodules only, so module hooks can cut between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act_a, self.act_b = nn.Linear(16, 16), nn.ReLU(), nn.ReLU()
        self.reverse = _Reverse()
        self.b = _HookedLinear(16, 16)
        self.c = nn.Linear(16, 16)
        self.c.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 3.0,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.act_b(self.b(self.reverse(self.act_a(self.a(x))))))


class _FrozenBlock(nn.Module):
    """Freezes its batch norm in its forward (``self.norm.eval()`` at every call), as fine-tuning code keeps
    pretrained statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(16, 16), nn.BatchNorm1d(16)
        with torch.no_grad():  # pretrained statistics, far from a batch's own
            self.norm.running_mean.uniform_(-1.0, 1.0)
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.norm.eval()
        return torch.relu(self.norm(self.linear(x)))


class FrozenNorm(nn.Module):
    """A batch norm frozen in a forward: torch.export would lose the ``eval()`` call, and the stages (which
    read modes when they run) would normalize each micro-batch by its own statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.block, self.b = nn.Linear(16, 16), _FrozenBlock(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.block(self.a(x)))


class _Halve(nn.Module):
    """Scales in training only, by a Python branch on the mode (as a drop-path does, without its draws)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if self.training else x


class ModeBranch(nn.Module):
    """A forward that runs other operations in evaluation mode: pipelined validation must run the stages'
    evaluation-mode programs, or its metrics differ from one process's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.halve, self.b = nn.Linear(16, 16), _Halve(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.halve(self.a(x))))
