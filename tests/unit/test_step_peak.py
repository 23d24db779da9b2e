"""A whole training step's predicted peak against the peak plain Lightning reaches, on models nobody here wrote.

Estimate mode prices a GPU's step: parameters, gradients, optimizer state, the activations backward needs, the
loss's temporaries, backward's transient and the optimizer step's temporaries. The same step on the CPU
allocates the same tensors when the optimizer runs as on a GPU (foreach or fused, asked for explicitly: the
CPU's default loops), dropout is off (the CPU's attention then runs the kernel a GPU runs, see
test_estimate_agrees.py) and the precision is not autocast's (the CPU's autocast keeps other ops in float32).
So the peak of the tensor bytes of a plain Lightning step (``tests.census.PeakTracker`` seeded with the
model's parameters, buffers and gradients, the optimizer's state and the batch: what
``torch.cuda.max_memory_allocated`` sees, on any device, and nothing other tests left alive) checks the memory
model end to end. Goal: within 10%
(issue 9's for estimate mode). BLOOM's GeLU and RecurrentGemma's clipped square root are autograd Functions,
kept whole in the capture ([Note: Functions kept whole]): exported as their operations, BLOOM's stages saved
1.22x what its plain step holds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_autopart.cluster import Cluster
from lightning_autopart.lightning.first_batch import optimizer_spec
from lightning_autopart.lightning.hooks import batch_size_of, find_forward
from lightning_autopart.lightning.step_loss import step_loss
from lightning_autopart.partition import partition
from lightning_autopart.planner import meta_inputs, profile_model
from tests.step_peak import StepPeak

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB, IMAGE = 8, 64, 1000, 32
optim = torch.optim


class Samples(Dataset[dict[str, torch.Tensor]]):
    """Token or image samples with the labels each head takes, drawn per index."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 4 * BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        if self.kind == "image":
            return {"pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g), "labels": torch.tensor(i % 3)}
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        if self.kind == "causal":
            return {"input_ids": ids, "labels": ids.clone()}
        if self.kind == "seq2seq":
            return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (SEQ // 2,), generator=g)}
        return {"input_ids": ids, "attention_mask": (torch.arange(SEQ) < SEQ - i % 8).long(), "labels": torch.tensor(i % 3)}


class HFStep(L.LightningModule):
    """A Hugging Face model trained as its users train it: the labels go in, ``.loss`` comes out."""

    def __init__(self, build: Callable[[], Any], make_optimizer: Callable[[Any], optim.Optimizer]) -> None:
        super().__init__()
        self.model = build()
        self.make_optimizer = make_optimizer

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> optim.Optimizer:
        return self.make_optimizer(self.parameters())


def _llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    ))  # fmt: skip


def _wide_llama() -> Any:
    """A Llama whose parameters, at one sample of 64 tokens, outweigh its activations: the optimizer decides."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ,
    ))  # fmt: skip


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    ))  # fmt: skip


def _bert() -> Any:
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    ))  # fmt: skip


def _t5() -> Any:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    ))  # fmt: skip


def _vit() -> Any:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=IMAGE, patch_size=4, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    ))  # fmt: skip


def _bloom() -> Any:
    return transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=128, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
    ))  # fmt: skip


def _recurrent_gemma() -> Any:
    return transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, lru_width=128, attention_window_size=SEQ,
        block_types=["recurrent", "attention", "recurrent"],
    ))  # fmt: skip


#: name: (model, data kind, optimizer as a GPU runs it, precision, batch size)
CASES: dict[str, tuple[Callable[[], Any], str, Callable[[Any], optim.Optimizer], str, int]] = {
    "llama, adamw": (_llama, "causal", lambda p: optim.AdamW(p, lr=1e-4, foreach=True), "32-true", BATCH),
    "llama, fused adamw, bf16-true": (
        _llama, "causal", lambda p: optim.AdamW(p, lr=1e-4, fused=True), "bf16-true", BATCH,
    ),
    "gpt2, adam amsgrad": (
        _gpt2, "causal", lambda p: optim.Adam(p, lr=1e-4, amsgrad=True, foreach=True), "32-true", BATCH,
    ),
    "bert, sgd momentum and decay": (
        _bert, "padded", lambda p: optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4, foreach=True), "32-true",
        BATCH,
    ),
    "t5, rmsprop": (_t5, "seq2seq", lambda p: optim.RMSprop(p, lr=1e-4, foreach=True), "32-true", BATCH),
    "vit, nadam": (_vit, "image", lambda p: optim.NAdam(p, lr=1e-4, foreach=True), "32-true", BATCH),
    "wide llama, fused adamw": (_wide_llama, "causal", lambda p: optim.AdamW(p, lr=1e-4, fused=True), "32-true", 1),
    "bloom, adamw": (_bloom, "causal", lambda p: optim.AdamW(p, lr=1e-4, foreach=True), "32-true", BATCH),
    "recurrent gemma, adamw": (
        _recurrent_gemma, "causal", lambda p: optim.AdamW(p, lr=1e-4, foreach=True), "32-true", BATCH,
    ),
    "wide llama, sgd momentum and decay": (
        _wide_llama, "causal", lambda p: optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4, foreach=True),
        "32-true", 1,
    ),
    "wide llama, adagrad": (_wide_llama, "causal", lambda p: optim.Adagrad(p, lr=1e-4, foreach=True), "32-true", 1),
}  # fmt: skip


def predicted_peak(make: Callable[[], L.LightningModule], batch: Any, precision: str, spec: str = "h100") -> int:
    """Estimate mode's peak for one device of ``spec`` (an H100's by default: its kernels and autocast lists),
    the module built on meta and planned as the strategy plans it: its ``training_step`` and loss found, its own
    optimizer measured as a GPU steps it."""
    torch.manual_seed(0)
    with torch.device("meta"):
        lm = make()
    step = optimizer_spec([lm.configure_optimizers()], gpu=True)
    batch = meta_inputs(batch)
    call = find_forward(lm, lambda: lm.training_step(batch, 0))
    root = lm.get_submodule(call.name) if call.name else lm
    size = batch_size_of(batch)
    prof = profile_model(
        root, (call.args, call.kwargs), profile="estimate", spec=spec, optimizer=step, up_to=size,
        loss=step_loss(lm, call.name, batch, size), dtype=precision,
    )  # fmt: skip
    cluster = Cluster.from_spec(spec, devices=1)
    plan = partition(prof, cluster, size, num_stages=1, micro_batches=1, checkpointing=False)
    return plan.prediction.peak_memory_bytes


def measured_peak(make: Callable[[], L.LightningModule], loader: DataLoader[Any], precision: str) -> int:
    """The peak tensor bytes of plain Lightning's training batches 2 and 3 on the CPU."""
    torch.manual_seed(0)
    lm = make()
    probe = StepPeak(2, 4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, precision=precision, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    trainer.fit(lm, loader)
    return max(probe.peaks)


def _predicted(case: str) -> int:
    build, kind, make_optimizer, precision, samples = CASES[case]
    batch = next(iter(DataLoader(Samples(kind), batch_size=samples)))
    return predicted_peak(lambda: HFStep(build, make_optimizer), batch, precision)


def _measured(case: str) -> int:
    build, kind, make_optimizer, precision, samples = CASES[case]
    loader = DataLoader(Samples(kind), batch_size=samples)
    return measured_peak(lambda: HFStep(build, make_optimizer), loader, precision)


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_mode_predicts_the_peak_of_a_plain_step(case: str) -> None:
    predicted, measured = _predicted(case), _measured(case)
    assert predicted == pytest.approx(measured, rel=0.10), f"predicted {predicted:,} B, measured {measured:,} B"


def test_a_true_precision_is_planned_on_the_model_as_lightning_converts_it() -> None:
    """``autopart plan --precision bf16-true`` of a model built in float32: captured as a bfloat16 copy, whose
    RMSNorm and rotary tables cast back to bfloat16 as in training, so a layer saves what a converted one saves;
    the user's model stays float32."""
    with torch.device("meta"):
        torch.manual_seed(0)
        model = _llama()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    as_given = profile_model(model, ((), {"input_ids": ids}), spec="h100", dtype="bf16-true")
    converted = profile_model(copy.deepcopy(model).to(torch.bfloat16), ((), {"input_ids": ids}), spec="h100", dtype="bf16-true")
    layers = [i for i, b in enumerate(converted.blocks) if b.name.startswith("model.layers.")]
    assert layers and all(
        as_given.blocks[i].activation_bytes == converted.blocks[i].activation_bytes for i in layers
    )
    assert torch.get_default_dtype() == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_autocast_weight_copies_are_gone_by_the_optimizer_step() -> None:
    """In bf16-mixed, a step whose optimizer is its peak (a wide Llama at one sample, AdamW) holds no weight
    copies then: autocast's casts die with the backward's graph ([Note: weight casts] in partition/cost.py).
    Counted as state, they put the prediction at 1.09 of plain Lightning's peak; it is now within 3 %."""
    def make() -> HFStep:
        return HFStep(_wide_llama, lambda p: optim.AdamW(p, lr=1e-4, foreach=True))

    predicted = predicted_peak(make, next(iter(DataLoader(Samples("causal"), batch_size=1))), "bf16-mixed")
    measured = measured_peak(make, DataLoader(Samples("causal"), batch_size=1), "bf16-mixed")
    assert predicted == pytest.approx(measured, rel=0.03), f"predicted {predicted:,} B, measured {measured:,} B"


class _Recurrent(L.LightningModule):
    """A cell applied at each of 8 steps (a hand-written recurrent network), trained in bf16-mixed."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cell = nn.Linear(512, 512), nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for _ in range(8):
            x = torch.tanh(self.cell(x))
        return x

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).float().square().mean()

    def configure_optimizers(self) -> optim.Optimizer:
        return optim.SGD(self.parameters(), lr=1e-3)


def test_a_weight_applied_at_every_step_keeps_a_copy_per_step() -> None:
    """Lightning's autocast runs with its cache off: a cell applied 8 times leaves 8 bfloat16 copies of its
    weight for the backward. Priced as one cached copy, the step read 0.684 of plain Lightning's peak."""
    data = TensorDataset(torch.randn(32, 512))
    predicted = predicted_peak(_Recurrent, next(iter(DataLoader(data, batch_size=4))), "bf16-mixed")
    measured = measured_peak(_Recurrent, DataLoader(data, batch_size=4), "bf16-mixed")
    assert predicted == pytest.approx(measured, rel=0.03), f"predicted {predicted:,} B, measured {measured:,} B"


class _Upsampled(nn.Module):
    """A trunk, a wide branch on it whose result the model returns to a classifier that never reads it, and the
    classifier (CANINE's upsampled characters beside its pooled classification)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.up = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.LayerNorm(1024))
        self.classifier = nn.Linear(64, 4)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.trunk(x)
        return self.up(pooled), pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _sequence, pooled = self.encode(x)  # the sequence lives until the forward returns
        return self.classifier(pooled)


class _Classified(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Upsampled()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).square().mean()

    def configure_optimizers(self) -> optim.Optimizer:
        return optim.AdamW(self.parameters(), lr=1e-3, foreach=True)


def test_a_value_the_model_never_uses_costs_its_forward_only() -> None:
    """A branch whose result nothing reads (its last block has no output) gets no gradient and no optimizer
    state, and its saves go before backward; the forward holds them until it returns ([Note: a dead part's
    saves] in partition/cost.py). Priced as trained, the step read 2.54 of plain Lightning's peak; without the
    saves the forward holds, 0.76."""
    data = TensorDataset(torch.randn(1024, 64))
    predicted = predicted_peak(_Classified, next(iter(DataLoader(data, batch_size=256))), "32-true", "cpu")
    measured = measured_peak(_Classified, DataLoader(data, batch_size=256), "32-true")
    assert predicted == pytest.approx(measured, rel=0.05), f"predicted {predicted:,} B, measured {measured:,} B"
