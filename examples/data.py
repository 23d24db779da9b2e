"""Synthetic, learnable data sets generated on the fly (nothing is downloaded)."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["SyntheticImages", "SyntheticRegression", "SyntheticTokens"]


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one ``stream`` of a data set (-1: shared tables, i >= 0: sample i)."""
    if seed < 0:
        raise ValueError(f"seed must be non-negative (seed={seed})")
    return torch.Generator().manual_seed((seed << 32) | (stream + 1))


def _check_index(index: int, n: int) -> None:
    if not 0 <= index < n:
        raise IndexError(f"index out of range (index={index}, n={n})")


class SyntheticRegression(Dataset[tuple[Tensor, Tensor]]):
    """Gaussian inputs ``x`` with targets ``y = (x @ U) @ V`` from a fixed random low-rank teacher.

    Each sample is generated from its own seeded generator, so the data set takes no memory beyond the
    teacher and every rank sees the same sample for the same index.

    Args:
        n: Number of samples.
        dim: Input features.
        seed: Seed of the teacher and of the samples.
        out_dim: Target features (defaults to ``dim``).
        rank: Rank of the teacher (capped at ``min(dim, out_dim)``).
        noise: Standard deviation of the Gaussian noise added to the targets.
    """

    def __init__(
        self, n: int, dim: int, seed: int = 0, out_dim: int | None = None, rank: int = 16, noise: float = 0.0
    ) -> None:
        self.n = n
        self.dim = dim
        self.out_dim = dim if out_dim is None else out_dim
        self.seed = seed
        self.noise = noise
        r = min(rank, dim, self.out_dim)
        g = _generator(seed, -1)
        # Scaled so that the targets have unit variance per feature.
        self.u = torch.randn(dim, r, generator=g) / math.sqrt(dim)
        self.v = torch.randn(r, self.out_dim, generator=g) / math.sqrt(r)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        _check_index(index, self.n)
        g = _generator(self.seed, index)
        x = torch.randn(self.dim, generator=g)
        y = (x @ self.u) @ self.v
        if self.noise > 0:
            y = y + self.noise * torch.randn(self.out_dim, generator=g)
        return x, y


class SyntheticTokens(Dataset[tuple[Tensor, Tensor]]):
    """Token sequences that count upwards, ``next = (token + 1) % vocab``, with a fraction of tokens replaced.

    A sample is ``(inputs, targets)``, both ``int64`` of length ``seq_len``, where ``targets`` is ``inputs``
    shifted by one position (next-token prediction).

    Args:
        n: Number of sequences.
        seq_len: Tokens per sequence.
        vocab: Vocabulary size.
        seed: Seed of the samples.
        noise: Probability that a token is replaced by a uniformly random one.
    """

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0, noise: float = 0.1) -> None:
        self.n = n
        self.seq_len = seq_len
        self.vocab = vocab
        self.seed = seed
        self.noise = noise

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        _check_index(index, self.n)
        g = _generator(self.seed, index)
        start = torch.randint(0, self.vocab, (1,), generator=g)
        tokens = (start + torch.arange(self.seq_len + 1)) % self.vocab
        replace = torch.rand(self.seq_len + 1, generator=g) < self.noise
        random_tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
        tokens = torch.where(replace, random_tokens, tokens)
        return tokens[:-1], tokens[1:]


class SyntheticImages(Dataset[tuple[Tensor, Tensor]]):
    """Noisy images whose class is given by a fixed random separable template ``a[c] * b[h] * d[w]``.

    A sample is ``(image, label)`` with ``image`` of shape ``(channels, size, size)`` and ``label`` a scalar
    ``int64``. Only the per-class template factors are stored, so huge images and many classes are cheap.

    Args:
        n: Number of images.
        channels: Image channels.
        size: Image height and width.
        classes: Number of classes.
        seed: Seed of the templates and of the samples.
        noise: Standard deviation of the Gaussian noise added to the unit-variance template.
    """

    def __init__(
        self, n: int, channels: int = 3, size: int = 32, classes: int = 10, seed: int = 0, noise: float = 1.0
    ) -> None:
        self.n = n
        self.channels = channels
        self.size = size
        self.classes = classes
        self.seed = seed
        self.noise = noise
        g = _generator(seed, -1)
        self.channel_factors = torch.randn(classes, channels, generator=g)
        self.row_factors = torch.randn(classes, size, generator=g)
        self.column_factors = torch.randn(classes, size, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        _check_index(index, self.n)
        g = _generator(self.seed, index)
        label = torch.randint(0, self.classes, (), generator=g)
        template = (
            self.channel_factors[label][:, None, None]
            * self.row_factors[label][None, :, None]
            * self.column_factors[label][None, None, :]
        )
        image = template + self.noise * torch.randn(self.channels, self.size, self.size, generator=g)
        return image, label
