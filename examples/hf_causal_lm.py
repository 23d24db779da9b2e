r"""A Hugging Face ``transformers`` causal language model (Llama, GPT-2, Qwen2, ...) trained with autopart.

The LightningModule is written as Hugging Face users write one: the batch is a dict of ``input_ids``,
``attention_mask`` and ``labels``, and the step returns ``self.model(**batch).loss`` (the model shifts the labels).
autopart pipelines ``self.model`` unchanged. The model is built from a small config with random weights
(``model_type``), or loaded with its weights by ``from_pretrained`` (``pretrained``: a local directory or a hub
name already in your cache). Needs ``transformers`` (``pip install 'lightning_autopart[hf]'``). From the
repository root::

    python -m examples.hf_causal_lm                                  # a 4-layer Llama, 2 stages on 2 CPU processes
    python -m examples.hf_causal_lm --model.model_type gpt2 --model.num_layers 8
    torchrun --nproc_per_node=8 -m examples.hf_causal_lm --model.pretrained /models/Llama-3.2-1B \
        --trainer.strategy.num_stages null --data.vocab_size 32000 --data.seq_len 1024 --trainer.precision bf16-mixed

Put your own tokenized data in the DataModule's place: any loader of such dicts works. The loss is averaged over
the tokens of each micro-batch; with padding (labels -100) the step's loss weighs micro-batches equally.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_autopart  # noqa: F401  (registers strategy="autopart")
from examples.common import cli_main
from examples.data import SyntheticTokens

__all__ = ["CausalLM", "CausalLMDataModule", "TokenDicts", "main"]


class CausalLM(L.LightningModule):
    """``self.model``: a ``transformers`` causal LM, from a small config or ``from_pretrained``.

    Args:
        model_type: A ``transformers`` model type built from a config with the sizes below ("llama", "gpt2",
            "qwen2", "mistral", ...), with random weights.
        pretrained: A local directory or hub name to load with ``AutoModelForCausalLM.from_pretrained`` (its own
            sizes; ``model_type`` and the sizes are ignored).
        vocab_size: Vocabulary size (from the data).
        seq_len: Longest sequence, the model's ``max_position_embeddings`` (from the data).
        hidden_size: Width of the residual stream.
        num_layers: Decoder layers.
        num_heads: Attention heads; must divide ``hidden_size``.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        model_type: str = "llama",
        pretrained: str | None = None,
        vocab_size: int = 256,
        seq_len: int = 64,
        hidden_size: int = 64,
        num_layers: int = 4,
        num_heads: int = 4,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if pretrained is not None:
            self.model = AutoModelForCausalLM.from_pretrained(pretrained)
            if vocab_size > self.model.config.vocab_size:
                raise ValueError(
                    f"the data's vocab_size={vocab_size} exceeds {pretrained}'s {self.model.config.vocab_size} "
                    "tokens; lower data.vocab_size"
                )
        else:
            config = AutoConfig.for_model(
                model_type,
                vocab_size=vocab_size,
                max_position_embeddings=seq_len,
                hidden_size=hidden_size,
                intermediate_size=4 * hidden_size,
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                bos_token_id=vocab_size - 1,
                eos_token_id=vocab_size - 1,
            )
            self.model = AutoModelForCausalLM.from_config(config)
        self.model.config.use_cache = False  # training: no key/value cache in the outputs

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return torch.optim.AdamW(self.parameters(), lr=h["lr"], weight_decay=h["weight_decay"])


class TokenDicts(Dataset[dict[str, Tensor]]):
    """:class:`SyntheticTokens` as the dicts a causal LM takes: ``input_ids``, ``attention_mask``, ``labels``."""

    def __init__(self, tokens: SyntheticTokens) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        ids, _ = self.tokens[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class CausalLMDataModule(L.LightningDataModule):
    """``num_samples`` generated training sequences as :class:`TokenDicts`, then 4 batches of validation ones.

    Args:
        vocab_size: Number of distinct tokens.
        seq_len: Tokens per sequence.
        batch_size: Sequences per batch of one pipeline replica.
        num_samples: Training sequences.
    """

    def __init__(
        self, vocab_size: int = 256, seq_len: int = 64, batch_size: int = 8, num_samples: int = 1024
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        self.train_set = TokenDicts(SyntheticTokens(h["num_samples"], h["seq_len"], h["vocab_size"], seed=0))
        self.val_set = TokenDicts(SyntheticTokens(4 * h["batch_size"], h["seq_len"], h["vocab_size"], seed=1))

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(self.train_set, batch_size=self.hparams["batch_size"], shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(self.val_set, batch_size=self.hparams["batch_size"])


#: The data's sizes that the model takes (LightningCLI links them: give them under ``data:`` only).
LINKS = [("data.vocab_size", "model.vocab_size"), ("data.seq_len", "model.seq_len")]


def main(args: Sequence[str] | None = None) -> None:
    """Train :class:`CausalLM` on :class:`CausalLMDataModule` (``configs/hf_causal_lm.yaml`` as defaults)."""
    cli_main(CausalLM, CausalLMDataModule, config="hf_causal_lm.yaml", links=LINKS, args=args)


if __name__ == "__main__":
    main()
