r"""A GPT-2-style decoder-only transformer with pre-LayerNorm blocks and a tied head, as a LightningModule.

Trains on generated token sequences (:class:`TokenDataModule`) with LightningCLI, from the repository root::

    python -m examples.gpt                                    # examples/configs/gpt.yaml: 2 stages on 2 CPU processes
    python -m examples.gpt fit --config examples/configs/gpt.yaml --model.n_layers 8 --trainer.max_steps 100
    torchrun --nproc_per_node=8 -m examples.gpt --trainer.strategy.num_stages null \
        --model.d_model 1600 --model.n_layers 48 --model.n_heads 25 --data.vocab_size 50257 --data.seq_len 1024

The last one is GPT-2 XL (1.56B parameters) on 8 GPUs, the planner choosing the stages. The config names the
strategy by class path (``lightning_autopart.AutoPartitionStrategy`` with ``init_args``), which needs no import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

import lightning_autopart  # noqa: F401  (registers strategy="autopart", for configs that use the name)
from examples.common import SyntheticDataModule, cli_main
from examples.data import SyntheticTokens

__all__ = ["GPT", "PRESETS", "Block", "CausalSelfAttention", "TokenDataModule", "main"]

#: Named configurations for ``GPT.from_preset``. ``"xl"`` is GPT-2 XL: its 50257 x 1600 embedding (and
#: tied output head) make the first and last stages much heavier than a single block.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layers": 2, "n_heads": 4},
    "small": {"vocab_size": 50257, "seq_len": 1024, "d_model": 768, "n_layers": 12, "n_heads": 12},
    "xl": {"vocab_size": 50257, "seq_len": 1024, "d_model": 1600, "n_layers": 48, "n_heads": 25},
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position attends to itself and earlier positions only."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model must be divisible by n_heads (d_model={d_model}, n_heads={n_heads})")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        # (batch, seq_len, d_model) -> (batch, n_heads, seq_len, head_dim)
        q, k, v = (t.view(batch, seq_len, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        causal_mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)
        return self.proj(y.transpose(1, 2).reshape(batch, seq_len, d_model))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` with a 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(SyntheticDataModule):
    """Token and learned position embeddings, ``n_layers`` :class:`Block` s, a final LayerNorm and a head.

    With ``tie_weights`` the output head's weight *is* the token embedding's ``Parameter``, so the first
    and the last layer share one tensor. The ``"xl"`` preset (GPT-2 XL shape) has 1,557,611,200 parameters
    tied and 1,638,022,400 untied.

    Args:
        vocab_size: Number of distinct tokens.
        seq_len: Tokens per training sequence (and size of the position embedding).
        d_model: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block; must divide ``d_model``.
        tie_weights: Share the token embedding with the output head.
        lr: Learning rate.
        batch_size: Sequences per batch of the training and validation loaders.
        momentum: SGD momentum (ignored by Adam).
        optimizer: ``"sgd"`` or ``"adam"``.
        num_samples: Sequences in the synthetic training set.
    """

    def __init__(
        self,
        vocab_size: int = 50257,
        seq_len: int = 128,
        d_model: int = 512,
        n_layers: int = 8,
        n_heads: int = 8,
        tie_weights: bool = True,
        lr: float = 0.01,
        batch_size: int = 8,
        momentum: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        num_samples: int = 1024,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights()
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.example_input_array = torch.randint(0, vocab_size, (2, seq_len))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPT:
        """Build the named configuration of :data:`PRESETS`, with ``overrides`` applied on top."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset (name={name!r}); use one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Next-token cross-entropy, averaged over every position of every sequence."""
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def _dataset(self) -> SyntheticTokens:
        """Training sequences followed by four batches of held-out validation sequences."""
        n = self.hparams["num_samples"] + 4 * self.hparams["batch_size"]
        return SyntheticTokens(n, self.hparams["seq_len"], self.hparams["vocab_size"], seed=0)


class TokenDataModule(L.LightningDataModule):
    """``num_samples`` generated training sequences (:class:`SyntheticTokens`), then 4 batches of validation ones.

    Args:
        vocab_size: Number of distinct tokens (the model's vocabulary takes it).
        seq_len: Tokens per sequence (the model's context takes it).
        batch_size: Sequences per batch of one pipeline replica.
        num_samples: Training sequences.
        noise: Probability that a token is replaced by a random one (the rest count upwards).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 32,
        batch_size: int = 8,
        num_samples: int = 1024,
        noise: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        data = SyntheticTokens(
            h["num_samples"] + 4 * h["batch_size"], h["seq_len"], h["vocab_size"], noise=h["noise"]
        )
        self.train_set = Subset(data, range(h["num_samples"]))
        self.val_set = Subset(data, range(h["num_samples"], len(data)))

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(self.train_set, batch_size=self.hparams["batch_size"], shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(self.val_set, batch_size=self.hparams["batch_size"])


#: The data's sizes that the model takes (LightningCLI links them: give them under ``data:`` only).
LINKS = [(f"data.{name}", f"model.{name}") for name in ("vocab_size", "seq_len", "batch_size", "num_samples")]


def main(args: Sequence[str] | None = None) -> None:
    """Train :class:`GPT` on :class:`TokenDataModule` with LightningCLI (``configs/gpt.yaml`` as defaults)."""
    cli_main(GPT, TokenDataModule, config="gpt.yaml", links=LINKS, args=args)


if __name__ == "__main__":
    main()
