"""Planning, in estimate mode, the model code of many Hugging Face architectures built on meta (decoders,
encoders, encoder-decoders, convolutional and windowed vision models, speech): the way
``autopart plan --profile estimate`` plans a model too big for the host. Each is a tiny config of the real
class; the plan must capture whole layers and price every block. The tier that also trains them against
one-process training is tests/distributed/test_hf_pipeline.py (GPT-2, Llama, Mistral, Mixtral, BERT, T5,
ViT).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers

from lightning_autopart import Cluster, plan_model
from lightning_autopart.capture import capture
from lightning_autopart.profile import profile

#: Tiny settings of the decoders that spell them the Llama way.
_SMALL: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 64,
    "max_position_embeddings": 32,
}

#: Per architecture: its config class, model class and tiny settings.
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_SMALL, "num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_SMALL, "num_key_value_heads": 2, "head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_SMALL, "num_key_value_heads": 2, "head_dim": 8}),
    "phi": ("PhiConfig", "PhiForCausalLM", _SMALL),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _SMALL),
    "opt": ("OPTConfig", "OPTForCausalLM", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64, "vocab_size": 64,
        "max_position_embeddings": 32, "word_embed_proj_dim": 32,
    }),
    "falcon": ("FalconConfig", "FalconForCausalLM", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64,
    }),
    "bloom": ("BloomConfig", "BloomForCausalLM", {
        "hidden_size": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64,
    }),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {
        "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 32, "rotary_dim": 4,
    }),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", {**_SMALL, "max_position_embeddings": 40}),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification", {
        "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "vocab_size": 64,
        "max_position_embeddings": 32,
    }),
    "bart": ("BartConfig", "BartForConditionalGeneration", {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 64,
        "max_position_embeddings": 32,
    }),
}  # fmt: skip

#: Models of images and sound, and GPT-2 with two heads, each with the inputs it takes (a batch of 4).
OTHER_INPUTS: dict[str, tuple[str, str, dict[str, Any], dict[str, tuple[int, ...]]]] = {
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", {
        "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 2, 1], "num_labels": 3,
    }, {"pixel_values": (4, 3, 64, 64)}),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", {
        "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1], "num_labels": 3,
    }, {"pixel_values": (4, 3, 64, 64)}),
    "swin": ("SwinConfig", "SwinForImageClassification", {
        "image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2],
        "window_size": 4, "num_labels": 3,
    }, {"pixel_values": (4, 3, 32, 32)}),
    "segformer": ("SegformerConfig", "SegformerForSemanticSegmentation", {
        "depths": [1, 1], "hidden_sizes": [16, 32], "num_attention_heads": [1, 2], "sr_ratios": [2, 1],
        "num_encoder_blocks": 2, "decoder_hidden_size": 32, "num_labels": 3, "patch_sizes": [7, 3],
        "strides": [4, 2],
    }, {"pixel_values": (4, 3, 64, 64)}),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", {
        "image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64,
    }, {"pixel_values": (4, 3, 32, 32)}),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 100,
        "num_mel_bins": 16, "max_source_positions": 16, "max_target_positions": 16, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
    }, {"input_features": (4, 16, 32), "decoder_input_ids": (4, 8)}),
    "gpt2_double_heads": ("GPT2Config", "GPT2DoubleHeadsModel", {
        "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64, "n_positions": 16,
    }, {"input_ids": (4, 12)}),
}  # fmt: skip


def _inputs(name: str) -> dict[str, torch.Tensor]:
    """Meta inputs of architecture ``name``: token ids, or the shapes :data:`OTHER_INPUTS` gives."""
    shapes = OTHER_INPUTS[name][3] if name in OTHER_INPUTS else {"input_ids": (4, 12)}
    if name == "bart":
        shapes = {"input_ids": (4, 12), "decoder_input_ids": (4, 12)}
    ids = ("input_ids", "decoder_input_ids")
    return {
        key: torch.zeros(shape, dtype=torch.long if key in ids else torch.float32, device="meta")
        for key, shape in shapes.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", [*ARCHITECTURES, *OTHER_INPUTS])
def test_built_on_meta_it_is_planned_in_estimate_mode(name: str) -> None:
    config_class, model_class, settings = (ARCHITECTURES.get(name) or OTHER_INPUTS[name])[:3]
    config = getattr(transformers, config_class)(**settings)
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    inputs = _inputs(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dropped cache is reported (tested in test_hf_capture.py)
        plan = plan_model(model, inputs, Cluster.from_spec("h100", 2), 16, optimizer="adamw", num_stages=2)
    blocks = [b for stage in plan.stages for b in stage.blocks]
    assert plan.num_stages == 2 and len(blocks) >= 4, blocks
    assert all(s.fwd_us > 0 and s.bwd_us > 0 for s in plan.stages)
    assert plan.prediction.step_us > 0


def test_a_mixtures_experts_are_priced() -> None:
    """Mixtral's experts run in a custom op (transformers' grouped-product fallback) that a dispatch mode sees
    as one opaque call: a layer's FLOPs must still be its attention, its router and each token's top 2 of 4
    experts (they were its attention and router alone)."""
    hidden, inner, experts, top, heads, kv_heads = 32, 64, 4, 2, 4, 2
    routing = {"num_local_experts": experts, "num_experts_per_tok": top}
    config = transformers.MixtralConfig(**_SMALL, num_key_value_heads=kv_heads, **routing)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    batch, seq = 4, 12
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, {"input_ids": ids})
    prof = profile(captured, mode="estimate", spec="h100")
    (layer,) = [b for b in prof.blocks if b.name == "model.layers.0"]
    tokens, head_dim = batch * seq, hidden // heads
    projections = 2 * tokens * hidden * (hidden + 2 * kv_heads * head_dim + hidden)  # q, k, v, o
    attention = 2 * 2 * batch * heads * seq * seq * head_dim  # q @ k^T and p @ v
    router = 2 * tokens * hidden * experts
    chosen = 2 * tokens * top * 3 * hidden * inner  # gate, up and down projections of each chosen expert
    assert layer.fwd_flops == projections + attention + router + chosen
