"""Tiny configs of many Hugging Face architectures, each with the inputs it takes: decoders, encoders,
encoder-decoders, convolutional and windowed vision models, speech. Shared by the estimate-mode planning
checks (tests/unit/test_hf_architectures.py) and the check that estimate mode agrees with a measured CPU run
(tests/unit/test_estimate_agrees.py). Importing this module imports ``transformers``: guard it with
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import transformers
from torch import nn

from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.profile import profile
from lightning_autopart.profile.records import BlockProfile, ModelProfile

__all__ = ["ARCHITECTURES", "FIELDS", "SMALL", "Architecture", "build", "differences", "inputs"]


class Architecture(NamedTuple):
    """One architecture: its config class, model class, tiny settings and input shapes (a batch of 4)."""

    config: str
    model: str
    settings: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]


#: Tiny settings of the decoders that spell them the Llama way.
SMALL: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 64,
    "max_position_embeddings": 32,
}
_TOKENS = {"input_ids": (4, 12)}
_PADDED = {"input_ids": (4, 12), "attention_mask": (4, 12)}

ARCHITECTURES: dict[str, Architecture] = {
    "qwen2": Architecture("Qwen2Config", "Qwen2ForCausalLM", {**SMALL, "num_key_value_heads": 2}, _TOKENS),
    "qwen3": Architecture("Qwen3Config", "Qwen3ForCausalLM", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8,
    }, _TOKENS),
    "gemma": Architecture("GemmaConfig", "GemmaForCausalLM", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8,
    }, _TOKENS),
    "phi": Architecture("PhiConfig", "PhiForCausalLM", SMALL, _TOKENS),
    "gpt_neox": Architecture("GPTNeoXConfig", "GPTNeoXForCausalLM", SMALL, _TOKENS),
    "opt": Architecture("OPTConfig", "OPTForCausalLM", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64, "vocab_size": 64,
        "max_position_embeddings": 32, "word_embed_proj_dim": 32,
    }, _TOKENS),
    "falcon": Architecture("FalconConfig", "FalconForCausalLM", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64,
    }, _TOKENS),
    "bloom": Architecture("BloomConfig", "BloomForCausalLM", {
        "hidden_size": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64,
    }, _TOKENS),
    # autograd Functions kept whole ([Note: Functions kept whole]): a clipped square root's gradient, and a
    # mixture of experts whose router's multiplier has its own backward
    "recurrent_gemma": Architecture("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", {
        **SMALL, "num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 8, "lru_width": 32,
        "attention_window_size": 16, "block_types": ["recurrent", "attention", "recurrent"],
    }, _TOKENS),
    "phimoe": Architecture("PhimoeConfig", "PhimoeForCausalLM", {
        **SMALL, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
    }, _TOKENS),
    # a weight clamped through .data in training ([Note: .data in the forward]), per-layer embeddings, AltUp
    "gemma3n": Architecture("Gemma3nTextConfig", "Gemma3nForCausalLM", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": [64, 64],
        "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8, "laurel_rank": 4,
        "altup_num_inputs": 2, "num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 6, "activation_sparsity_pattern": [0.0, 0.0],
        "pad_token_id": 63,  # above the tiers' ids: a pad at position 0 stays zero, and AltUp's norm of it is NaN
    }, _TOKENS),
    "gptj": Architecture("GPTJConfig", "GPTJForCausalLM", {
        "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 32, "rotary_dim": 4,
    }, _TOKENS),
    "roberta": Architecture("RobertaConfig", "RobertaForMaskedLM", {
        **SMALL, "max_position_embeddings": 40,
    }, _PADDED),
    "distilbert": Architecture("DistilBertConfig", "DistilBertForSequenceClassification", {
        "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "vocab_size": 64,
        "max_position_embeddings": 32,
    }, _PADDED),
    "bart": Architecture("BartConfig", "BartForConditionalGeneration", {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 64,
        "max_position_embeddings": 32,
    }, {"input_ids": (4, 12), "decoder_input_ids": (4, 12)}),
    "convnext": Architecture("ConvNextConfig", "ConvNextForImageClassification", {
        "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 2, 1], "num_labels": 3,
    }, {"pixel_values": (4, 3, 64, 64)}),
    "resnet": Architecture("ResNetConfig", "ResNetForImageClassification", {
        "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1], "num_labels": 3,
    }, {"pixel_values": (4, 3, 64, 64)}),
    "swin": Architecture("SwinConfig", "SwinForImageClassification", {
        "image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2],
        "window_size": 4, "num_labels": 3,
    }, {"pixel_values": (4, 3, 32, 32)}),
    "segformer": Architecture("SegformerConfig", "SegformerForSemanticSegmentation", {
        "depths": [1, 1], "hidden_sizes": [16, 32], "num_attention_heads": [1, 2], "sr_ratios": [2, 1],
        "num_encoder_blocks": 2, "decoder_hidden_size": 32, "num_labels": 3, "patch_sizes": [7, 3],
        "strides": [4, 2],
    }, {"pixel_values": (4, 3, 64, 64)}),
    "beit": Architecture("BeitConfig", "BeitForImageClassification", {
        "image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64, "num_labels": 3,
        "use_relative_position_bias": True,
    }, {"pixel_values": (4, 3, 32, 32)}),
    "clip_vision": Architecture("CLIPVisionConfig", "CLIPVisionModel", {
        "image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64,
    }, {"pixel_values": (4, 3, 32, 32)}),
    "whisper": Architecture("WhisperConfig", "WhisperForConditionalGeneration", {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 100,
        "num_mel_bins": 16, "max_source_positions": 16, "max_target_positions": 16, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
    }, {"input_features": (4, 16, 32), "decoder_input_ids": (4, 8)}),
    "gpt2_double_heads": Architecture("GPT2Config", "GPT2DoubleHeadsModel", {
        "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64, "n_positions": 16,
    }, _TOKENS),
}  # fmt: skip


def build(arch: str | Architecture, device: str = "meta", *, dropout: bool = True) -> nn.Module:
    """Architecture ``arch`` (a name of :data:`ARCHITECTURES`, or a row) from its tiny config, built on
    ``device`` (random weights, seed 0 off meta). ``dropout=False`` sets every dropout, drop-path and
    layer-drop probability to 0.0: the forward is then deterministic in training mode."""
    row = ARCHITECTURES[arch] if isinstance(arch, str) else arch
    config = getattr(transformers, row.config)(**row.settings)
    if not dropout:
        for key, value in vars(config).items():
            if isinstance(value, float) and ("drop" in key or "pdrop" in key):
                setattr(config, key, 0.0)
    torch.manual_seed(0)
    with torch.device(device):
        model: nn.Module = getattr(transformers, row.model)(config)
    return model


def inputs(arch: str | Architecture, device: str = "meta") -> dict[str, torch.Tensor]:
    """The inputs of architecture ``arch`` (a name or a row) on ``device``: token ids (below 50), float
    features, and attention masks that pad the last 4 positions of the first sample (on meta: shapes and
    dtypes only)."""
    row = ARCHITECTURES[arch] if isinstance(arch, str) else arch
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    for key, shape in row.shapes.items():
        if key.endswith("_ids"):
            value = torch.randint(0, 50, shape, generator=g)
        elif key == "attention_mask":
            value = torch.ones(shape, dtype=torch.long)
            value[0, -4:] = 0
        else:
            value = torch.randn(shape, generator=g)
        out[key] = value.to(device)
    return out


#: What :func:`differences` compares, block by block.
FIELDS = ("fwd_flops", "bwd_flops", "activation_bytes", "transient_bytes")


def differences(captured: CapturedModel) -> tuple[dict[str, list[tuple[str, float, float]]], ModelProfile]:
    """Estimate mode (H100 spec) against measure mode on the CPU for one capture: per field of :data:`FIELDS`,
    the blocks that differ as (block, estimate, measure); and the estimate."""
    estimated = profile(captured, "estimate", spec="h100")
    measured = profile(captured, "measure", device="cpu", warmup=0, repeats=1)
    differ: dict[str, list[tuple[str, float, float]]] = {}
    for i, (e, m) in enumerate(zip(estimated.blocks, measured.blocks, strict=True)):
        ours = _fields(e, estimated.meta["per_block"][i])
        theirs = _fields(m, measured.meta["per_block"][i])
        for field in FIELDS:
            if ours[field] != theirs[field]:
                differ.setdefault(field, []).append((e.name, ours[field], theirs[field]))
    return differ, estimated


def _fields(block: BlockProfile, per_block: dict[str, float]) -> dict[str, float]:
    return {f: per_block[f] if f == "bwd_flops" else getattr(block, f) for f in FIELDS}
