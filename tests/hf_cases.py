"""Hugging Face ``transformers`` models from tiny configs, wrapped in LightningModules the way HF users write them.

Shared by the one-process capture checks (tests/unit/test_hf_capture.py), the launched script
(tests/distributed/_hf_script.py) and its in-process reference (tests/distributed/test_hf_pipeline.py). Every
model is built from a config with random weights (seed 0), hidden size 32, 2 layers, a vocabulary of 100 and
sequences of 8; every dropout probability is 0.0, so pipelined and plain training can be compared exactly.
``use_cache`` keeps each model's default. Importing this module imports ``transformers``: guard it with
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from tests.distributed.strategy_cases import LOCAL_BATCH, STEPS, global_order

__all__ = [
    "LAYERS",
    "LOCAL_BATCH",
    "MODELS",
    "STEPS",
    "DictDataset",
    "HFModule",
    "build",
    "cache_field",
    "config",
    "dataset",
    "fit",
    "make_lit",
]

VOCAB, SEQ, TARGET_SEQ, IMAGE, CLASSES = 100, 8, 6, 8, 3

#: The models of the tier.
MODELS = ("gpt2", "llama", "mistral", "mixtral", "bert", "t5", "vit")


def cache_field() -> str:
    """The ModelOutput field that holds a decoder's cache: ``past_key_values``, ``cache`` from transformers
    5.24 on (autopart drops and reports it under whichever name the model returns)."""
    import transformers

    fields = transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
    return "cache" if "cache" in fields else "past_key_values"


#: Per model, the module lists holding its encoder/decoder layers (the units a stage boundary may not split).
LAYERS: dict[str, tuple[str, ...]] = {
    "gpt2": ("transformer.h",),
    "llama": ("model.layers",),
    "mistral": ("model.layers",),
    "mixtral": ("model.layers",),
    "bert": ("bert.encoder.layer",),
    "t5": ("encoder.block", "decoder.block"),
    "vit": ("vit.layers", "vit.encoder.layer"),  # transformers 5 / 4 spell it differently
    "gemma3": ("model.layers",),
    "recurrent_gemma": ("model.layers",),
    "vitmae": ("vit.layers", "vit.encoder.layer", "decoder.decoder_layers"),
}


#: The tiny decoder of the Llama-like models (Mistral, Mixtral).
_DECODER: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def config(name: str) -> transformers.PretrainedConfig:
    """The tiny config of model ``name``: hidden 32, 2 layers, every dropout probability 0.0."""
    if name == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=16,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
        )
    if name == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            attention_dropout=0.0,
            bos_token_id=1,
            eos_token_id=2,
        )
    if name == "mistral":  # a sliding window shorter than the sequences: the mask is not plain causal
        return transformers.MistralConfig(**_DECODER, sliding_window=SEQ // 2)
    if name == "mixtral":  # a mixture of experts: each token's top 2 of 4 experts, routed by its values
        return transformers.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    if name == "recurrent_gemma":  # an autograd Function clips a square root's gradient: kept whole
        return transformers.RecurrentGemmaConfig(
            **{k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}, num_key_value_heads=1,
            head_dim=8, lru_width=32, attention_window_size=SEQ, block_types=["recurrent", "attention"],
        )
    if name == "gemma3":  # rotary tables computed in a loop over set(layer_types): see test_hf_pipeline
        return transformers.Gemma3TextConfig(
            **_DECODER, head_dim=8, sliding_window=SEQ // 2, layer_types=["sliding_attention", "full_attention"]
        )
    if name == "vitmae":  # its loss reads the images again: pixel_values pass through every stage
        return transformers.ViTMAEConfig(
            image_size=2 * IMAGE, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, decoder_hidden_size=32, decoder_num_hidden_layers=1,
            decoder_num_attention_heads=2, decoder_intermediate_size=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    if name == "bert":
        return transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout=0.0,
            num_labels=CLASSES,
        )
    if name == "t5":
        return transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            classifier_dropout=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    if name == "vit":
        return transformers.ViTConfig(
            image_size=IMAGE,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=CLASSES,
        )
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


def build(name: str) -> nn.Module:
    """Model ``name`` with random weights from its tiny config (seed 0)."""
    classes = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "recurrent_gemma": transformers.RecurrentGemmaForCausalLM,
        "bert": transformers.BertForSequenceClassification,
        "t5": transformers.T5ForConditionalGeneration,
        "vit": transformers.ViTForImageClassification,
        "vitmae": transformers.ViTMAEForPreTraining,
    }
    torch.manual_seed(0)
    model: nn.Module = classes[name](config(name))
    return model


class HFModule(L.LightningModule):
    """A Hugging Face model as ``self.model``; the steps of the subclasses are written as HF users write them."""

    def __init__(self, name: str, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer = optimizer
        self.model = build(name)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adamw":
            # eps=1e-6, not 1e-8: a key projection's bias gets a gradient that is zero in exact arithmetic (the
            # softmax ignores a shift shared by all keys), so its gradient is rounding noise (1e-13..1e-10) that
            # Adam with a tiny eps would turn into full-size steps, different in any two correct runs.
            return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CausalLM(HFModule):
    """GPT-2, Llama, Mistral or Mixtral: the labels go into the model, which shifts them and computes the loss
    in its forward."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        self.log("train_loss", out.loss)
        return out.loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        self.log("val_loss", out.loss, sync_dist=True)


class CausalLMLogits(HFModule):
    """A causal LM called without labels: the step reads ``.logits`` of the ModelOutput and computes the loss."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(input_ids=batch["input_ids"])
        logits = out.logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss


class SequenceClassifier(HFModule):
    """BERT on padded token sequences (an attention mask with zeros) and integer class labels."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        self.log("train_loss", out.loss)
        return out.loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        self.log("val_loss", out.loss, sync_dist=True)


class Seq2SeqLM(HFModule):
    """T5: the encoder reads ``input_ids``; the decoder input is built from ``labels`` inside the forward."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        self.log("train_loss", out.loss)
        return out.loss


class ImageClassifier(HFModule):
    """ViT on small images."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(pixel_values=batch["pixel_values"], labels=batch["labels"])
        self.log("train_loss", out.loss)
        return out.loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.model(pixel_values=batch["pixel_values"], labels=batch["labels"])
        self.log("val_loss", out.loss, sync_dist=True)


class MaskedImages(HFModule):
    """ViT-MAE: a random quarter of the patches in, every patch's pixels predicted; its loss reads the images."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(pixel_values=batch["pixel_values"])
        self.log("train_loss", out.loss)
        return out.loss


#: The LightningModule class of each (model, step) pair a case may name.
_LITS: dict[tuple[str, str], type[HFModule]] = {
    ("gpt2", "labels"): CausalLM,
    ("llama", "labels"): CausalLM,
    ("llama", "logits"): CausalLMLogits,
    ("mistral", "labels"): CausalLM,
    ("mixtral", "labels"): CausalLM,
    ("gemma3", "labels"): CausalLM,
    ("recurrent_gemma", "labels"): CausalLM,
    ("bert", "labels"): SequenceClassifier,
    ("t5", "labels"): Seq2SeqLM,
    ("vit", "labels"): ImageClassifier,
    ("vitmae", "labels"): MaskedImages,
}


def make_lit(case: dict[str, Any]) -> HFModule:
    """The LightningModule of a case: ``model``, ``step`` ("labels" or "logits"), ``optimizer``."""
    cls = _LITS[(case["model"], case.get("step", "labels"))]
    return cls(case["model"], optimizer=case.get("optimizer", "sgd"))


class DictDataset(Dataset[dict[str, Tensor]]):
    """Columns of equal length; item ``i`` is ``{name: column[i]}`` (the default collate stacks them)."""

    def __init__(self, **columns: Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {name: column[i] for name, column in self.columns.items()}


def dataset(name: str, n: int, seed: int = 1) -> DictDataset:
    """``n`` deterministic samples for model ``name``, as the dicts HF models take as keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    if name in ("gpt2", "llama", "mistral", "mixtral", "gemma3", "recurrent_gemma"):
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return DictDataset(input_ids=ids, labels=ids.clone())
    if name == "bert":
        # Lengths 4..8: most samples end in padding (id 0, attention mask 0), some fill the sequence.
        lengths = torch.randint(4, SEQ + 1, (n,), generator=g)
        mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (n, SEQ), generator=g) * mask
        return DictDataset(
            input_ids=ids, attention_mask=mask, labels=torch.randint(0, CLASSES, (n,), generator=g)
        )
    if name == "t5":
        return DictDataset(
            input_ids=torch.randint(2, VOCAB, (n, SEQ), generator=g),
            labels=torch.randint(2, VOCAB, (n, TARGET_SEQ), generator=g),
        )
    if name == "vit":
        return DictDataset(
            pixel_values=torch.randn(n, 3, IMAGE, IMAGE, generator=g),
            labels=torch.randint(0, CLASSES, (n,), generator=g),
        )
    if name == "vitmae":
        return DictDataset(pixel_values=torch.randn(n, 3, 2 * IMAGE, 2 * IMAGE, generator=g))
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


class GradNorms(Callback):
    """Lightning's documented gradient norms, logged from a callback: every stage's under autopart."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit(
    case: dict[str, Any], strategy: Any, devices: int, replicas: int, probe: L.Callback | None = None
) -> tuple[HFModule, list[float], dict[str, float]]:
    """Train a case for ``STEPS`` optimizer steps on batches of ``LOCAL_BATCH`` samples per replica.

    With ``strategy="auto"`` (the one-process reference) each batch holds the ``LOCAL_BATCH x replicas`` samples
    the replicas see together (see ``global_order``). ``validate`` adds a validation loader, run once after the
    last step; ``grad_norm`` logs the gradients' norms (:class:`GradNorms`). Returns the model, the logged ``train_loss`` of every batch and the final callback metrics.
    ``probe`` is one more callback (tests/census.py's StepPeak).
    """
    model = make_lit(case)
    n = LOCAL_BATCH * replicas * STEPS
    data: Dataset[Any] = dataset(case["model"], n)
    batch = LOCAL_BATCH
    if strategy == "auto":
        batch = LOCAL_BATCH * replicas
        data = Subset(data, global_order(n, replicas))
    losses = _Losses()
    val = None
    if case.get("validate"):
        val = DataLoader(dataset(case["model"], 2 * LOCAL_BATCH * replicas, seed=2), batch_size=batch)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[losses, *([probe] if probe is not None else []), *([GradNorms()] if case.get("grad_norm") else [])],
    )
    trainer.fit(model, DataLoader(data, batch_size=batch), val)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return model, losses.losses, metrics
