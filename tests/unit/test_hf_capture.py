"""Hugging Face transformers models captured in one process: torch.export, whole layers as blocks, the ModelOutput
rebuilt from the carried tensors, the key/value cache dropped with a warning, programs that run anywhere.

The models and inputs are those of the distributed tier (tests/hf_cases.py), at a micro-batch of 2 samples, called
with the keyword arguments their LightningModule's training_step passes.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import transformers

from lightning_autopart.capture import capture
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.profile import profile
from lightning_autopart.runtime.stages import build_stage_module
from tests.hf_cases import LAYERS, MODELS, build, cache_field, config, dataset

#: The ModelOutput class each model's forward returns.
OUTPUTS = {
    "gpt2": transformers.modeling_outputs.CausalLMOutputWithCrossAttentions,
    "llama": transformers.modeling_outputs.CausalLMOutputWithPast,
    "mistral": transformers.modeling_outputs.CausalLMOutputWithPast,
    "mixtral": transformers.modeling_outputs.MoeCausalLMOutputWithPast,
    "bert": transformers.modeling_outputs.SequenceClassifierOutput,
    "t5": transformers.modeling_outputs.Seq2SeqLMOutput,
    "vit": transformers.modeling_outputs.ImageClassifierOutput,
}

#: The cache object each model returns with its default ``use_cache`` (None: it returns none).
CACHES = {
    "gpt2": "DynamicCache",
    "llama": "DynamicCache",
    "mistral": "DynamicCache",
    "mixtral": "DynamicCache",
    "t5": "EncoderDecoderCache",
    "bert": None,
    "vit": None,
}


@dataclass
class Captured:
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    captured: CapturedModel
    warnings: list[warnings.WarningMessage]

    def flat(self, inputs: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The model's tensor inputs in captured order (its keyword arguments, by name)."""
        given = self.inputs if inputs is None else inputs
        return [given[t.name] for t in self.captured.inputs]


def _inputs(name: str, n: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    return dict(dataset(name, n, seed).columns)


@pytest.fixture(autouse=True)
def _autograd_on() -> Iterator[None]:
    """Every test starts with autograd on, as in a fresh process: an error inside a captured ``torch.no_grad``
    region (a higher-order op that does not restore the mode when its body raises) would leave it off."""
    torch.set_grad_enabled(True)
    yield
    torch.set_grad_enabled(True)


@pytest.fixture(scope="module")
def hf() -> dict[str, Captured]:
    """Every model captured once (about a second each), with the warnings the capture gave."""
    found = {}
    for name in MODELS:
        model, inputs = build(name), _inputs(name)
        # Autograd on, as when the strategy captures: export records a torch.no_grad region in forward (Llama's
        # rotary embedding) only then.
        with warnings.catch_warnings(record=True) as caught, torch.enable_grad():
            warnings.simplefilter("always")
            captured = capture(model, inputs)
        found[name] = Captured(model, inputs, captured, caught)
    return found


def _run(captured: CapturedModel, inputs: list[Any], bounds: list[int], device: str | None = None) -> Any:
    """Chain the stages ``bounds`` delimits; with ``device`` each stage runs on a copy moved there."""
    values = tuple(inputs)
    for start, end in itertools.pairwise(bounds):
        stage = build_stage_module(captured, start, end)
        if device is not None:
            stage = copy.deepcopy(stage).to(device)
        values = stage(*values)
    return values


@pytest.mark.parametrize("name", MODELS)
def test_config_has_no_dropout(name: str) -> None:
    """Every dropout probability of the tier's configs is 0.0, so pipelined and plain runs can agree exactly."""
    rates = {
        key: value
        for key, value in config(name).to_dict().items()
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float)
    }
    assert rates and all(value == 0.0 for value in rates.values()), rates


@pytest.mark.parametrize("name", MODELS)
def test_captured_with_torch_export(hf: dict[str, Captured], name: str) -> None:
    captured = hf[name].captured
    assert captured.method == "export"
    assert captured.batch_size == 2
    assert [t.name for t in captured.inputs] == list(hf[name].inputs)


@pytest.mark.parametrize("name", MODELS)
def test_blocks_are_whole_layers(hf: dict[str, Captured], name: str) -> None:
    """Every encoder/decoder layer is exactly one block: no boundary falls inside a layer, no layer is cut in
    runs, and the layer's parameters are used by its block alone."""
    model, captured = hf[name].model, hf[name].captured
    modules = dict(model.named_modules())
    containers = [fqn for fqn in LAYERS[name] if fqn in modules]
    assert containers, f"none of {LAYERS[name]} in {type(model).__name__}"
    layers = [f"{fqn}.{child}" for fqn in containers for child, _ in modules[fqn].named_children()]
    assert len(layers) == 2 * len(containers)
    names = [b.name for b in captured.blocks]
    for layer in layers:
        inside = [
            b for b in captured.blocks if any(m == layer or m.startswith(layer + ".") for m in b.modules)
        ]
        assert [b.modules for b in inside] == [(layer,)], f"{layer} spans blocks {[b.name for b in inside]}"
        assert names.count(layer) == 1 and f"{layer}#2" not in names
        own = {f"{layer}.{n}" for n, _ in modules[layer].named_parameters()}
        users = [b.name for b in captured.blocks if own & set(b.params)]
        assert users == [layer], f"parameters of {layer} used by {users}"


def test_t5_encoder_and_decoder_give_many_blocks(hf: dict[str, Captured]) -> None:
    captured = hf["t5"].captured
    assert captured.num_blocks > 5
    names = [b.name for b in captured.blocks]
    assert names.index("encoder.block.1") < names.index("decoder.block.0") < names.index("lm_head")
    # encoder_last_hidden_state is a model output: it crosses every cut after the encoder.
    assert len(captured.cuts[-1]) >= 3


def test_tied_embeddings_are_tied_across_blocks(hf: dict[str, Captured]) -> None:
    """GPT-2's head reuses the token embedding; T5's encoder, decoder and head share one embedding."""
    gpt2 = hf["gpt2"].captured
    blocks = [gpt2.blocks[k].name for k in gpt2.tied["transformer.wte.weight"]]
    assert blocks == ["transformer.wte", "lm_head"]
    t5 = hf["t5"].captured
    (shared,) = [fqn for fqn, ks in t5.tied.items() if {t5.blocks[k].name for k in ks} >= {"lm_head"}]
    assert {t5.blocks[k].name for k in t5.tied[shared]} == {
        "encoder.embed_tokens",
        "decoder.embed_tokens",
        "lm_head",
    }


@pytest.mark.parametrize("name", MODELS)
def test_output_rebuilds_to_the_model_output(hf: dict[str, Captured], name: str) -> None:
    """Two stages chained give the tensors the last stage carries; rebuilt, they are the forward's ModelOutput."""
    case = hf[name]
    captured, model = case.captured, case.model
    half = captured.num_blocks // 2
    tensors = _run(captured, case.flat(), [0, half, captured.num_blocks])
    assert len(tensors) == len(captured.cuts[-1])
    out = captured.output.rebuild(tensors)
    assert type(out) is OUTPUTS[name]
    reference = model(**case.inputs)
    assert type(reference) is OUTPUTS[name]
    assert out.loss.dim() == 0
    torch.testing.assert_close(out.loss, reference.loss)
    torch.testing.assert_close(out.logits, reference.logits)
    field = cache_field()
    assert list(out.keys()) == [k for k in reference if k != field]
    if CACHES[name] is not None:
        assert getattr(out, field) is None and type(getattr(reference, field)).__name__ == CACHES[name]


@pytest.mark.parametrize("name", MODELS)
def test_the_cache_is_reported_dropped(hf: dict[str, Captured], name: str) -> None:
    """use_cache=True (the default of the decoders) returns a cache object: not carried, and a UserWarning says so."""
    case = hf[name]
    cache = CACHES[name]
    messages = [str(w.message) for w in case.warnings if issubclass(w.category, UserWarning)]
    reported = [m for m in messages if cache_field() in m and "use_cache=False" in m]
    if cache is None:
        assert case.captured.output.dropped == () and reported == []
        return
    assert case.captured.output.dropped == (f"['{cache_field()}'] ({cache})",)
    assert len(reported) == 1 and f"({cache})" in reported[0]


def test_the_cache_warning_is_a_user_warning() -> None:
    model, inputs = build("gpt2"), _inputs("gpt2")
    with pytest.warns(
        UserWarning, match=rf"GPT2LMHeadModel\.forward returns \['{cache_field()}'\] \(DynamicCache\)"
    ):
        capture(model, inputs)


def test_padding_mask_is_an_input_not_a_constant(hf: dict[str, Captured]) -> None:
    """BERT captured on one padding pattern gives the eager logits on others (full rows included)."""
    case = hf["bert"]
    assert (case.inputs["attention_mask"] == 0).any()
    stage = build_stage_module(case.captured, 0, case.captured.num_blocks)
    for seed in (2, 3, 4):
        other = _inputs("bert", seed=seed)
        if seed == 4:
            other["attention_mask"] = torch.ones_like(other["attention_mask"])
        out = case.captured.output.rebuild(stage(*case.flat(other)))
        reference = case.model(**other)
        torch.testing.assert_close(out.logits, reference.logits)
        torch.testing.assert_close(out.loss, reference.loss)


@pytest.mark.parametrize("name", MODELS)
def test_stages_run_on_meta(hf: dict[str, Captured], name: str) -> None:
    """Captured on the CPU, every block runs on meta, the stand-in for another device (as estimate profiling and a
    GPU stage run them): tensors created in forward follow the stage's device."""
    case = hf[name]
    captured = case.captured
    meta = [t.to("meta") for t in case.flat()]
    tensors = _run(captured, meta, list(range(captured.num_blocks + 1)), "meta")
    assert all(t.is_meta for t in tensors)
    assert all(p.device.type == "cpu" for p in case.model.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_estimate_profile(hf: dict[str, Captured], name: str) -> None:
    """profile="estimate" (what the distributed tier plans with) prices every block."""
    result = profile(hf[name].captured, mode="estimate", spec="a100-40gb")
    assert result.num_blocks == hf[name].captured.num_blocks


def test_a_sliding_window_model_built_on_meta_is_captured_and_priced() -> None:
    """Mistral (sliding-window attention) built on meta, as ``autopart plan --profile estimate`` builds a
    model too big for the host: its cache makes CPU counters with ``torch.tensor``, which must not decide the
    device of the rotary block (see [Note: portable programs]); capture and estimate mode go through."""
    cfg = transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, sliding_window=8,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.MistralForCausalLM(cfg)
    ids = torch.zeros(2, 12, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped cache's warning (tested above)
        captured = capture(model, {"input_ids": ids, "labels": ids})
    assert captured.num_blocks >= 4  # the embedding, both layers, the head
    (loss, logits) = _run(captured, [ids, ids], list(range(captured.num_blocks + 1)))
    assert loss.is_meta and tuple(logits.shape) == (2, 12, 64)
    priced = profile(captured, mode="estimate", spec="h100")
    assert all(b.fwd_us > 0 for b in priced.blocks)
