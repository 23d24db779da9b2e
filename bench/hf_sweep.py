"""Estimate mode on Hugging Face architectures beyond the test tier: planned from meta, and checked against a
measured CPU run of the same capture.

Usage: ``python bench/hf_sweep.py [NAME ...]`` (default: every architecture below and the 95 of
``bench/hf_more.py``; about 8 minutes on two cores). One process on the CPU,
configs only (random weights, nothing downloaded), every dropout off. Per architecture it prints whether a
model built on ``meta`` is planned in estimate mode (2 x H100, batch 16, 2 stages, AdamW). Then, for one
capture of a model built on the CPU, it prints whether estimate mode and measure mode count the same forward
and backward FLOPs, saved bytes and backward transient block by block (as tests/unit/test_estimate_agrees.py
does for the tier's models), with the first differing blocks; and whether one backward through the exported
graph gives every parameter eager's gradient (tests/unit/test_hf_gradients.py's check).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hf_more import MORE
from lightning_autopart import Cluster, plan_model
from lightning_autopart.capture import capture
from tests.hf_architectures import ARCHITECTURES, SMALL, Architecture, build, differences, inputs
from tests.unit.test_hf_gradients import check_gradients

__all__: list[str] = []

_TOKENS = {"input_ids": (4, 12)}
_PADDED = {"input_ids": (4, 12), "attention_mask": (4, 12)}
_IMAGES = {"pixel_values": (4, 3, 32, 32)}
_GQA = {**SMALL, "num_key_value_heads": 2}
_VISION = {
    "image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
}  # fmt: skip

SWEEP: dict[str, Architecture] = {
    "albert": Architecture("AlbertConfig", "AlbertForMaskedLM", {**SMALL, "embedding_size": 16}, _PADDED),
    "deberta_v2": Architecture("DebertaV2Config", "DebertaV2ForMaskedLM", SMALL, _PADDED),
    "electra": Architecture("ElectraConfig", "ElectraForMaskedLM", {**SMALL, "embedding_size": 16}, _PADDED),
    "xlm_roberta": Architecture("XLMRobertaConfig", "XLMRobertaForMaskedLM", {
        **SMALL, "max_position_embeddings": 40,
    }, _PADDED),
    "gemma2": Architecture("Gemma2Config", "Gemma2ForCausalLM", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 6,
    }, _TOKENS),
    "qwen2_moe": Architecture("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **_GQA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    }, _TOKENS),
    "phi3": Architecture("Phi3Config", "Phi3ForCausalLM", {**_GQA, "pad_token_id": 0}, _TOKENS),
    "starcoder2": Architecture("Starcoder2Config", "Starcoder2ForCausalLM", _GQA, _TOKENS),
    "stablelm": Architecture("StableLmConfig", "StableLmForCausalLM", _GQA, _TOKENS),
    "olmo": Architecture("OlmoConfig", "OlmoForCausalLM", _GQA, _TOKENS),
    "cohere": Architecture("CohereConfig", "CohereForCausalLM", _GQA, _TOKENS),
    "gpt_bigcode": Architecture("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {
        "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 32,
    }, _TOKENS),
    "mt5": Architecture("MT5Config", "MT5ForConditionalGeneration", {
        "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 64,
        "decoder_start_token_id": 0,
    }, {"input_ids": (4, 12), "decoder_input_ids": (4, 6)}),
    "pegasus": Architecture("PegasusConfig", "PegasusForConditionalGeneration", {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 64,
        "max_position_embeddings": 32,
    }, {"input_ids": (4, 12), "decoder_input_ids": (4, 12)}),
    "dinov2": Architecture("Dinov2Config", "Dinov2Model", {**_VISION, "mlp_ratio": 2}, _IMAGES),
    "deit": Architecture("DeiTConfig", "DeiTForImageClassification", {
        **_VISION, "intermediate_size": 64,
    }, _IMAGES),
    "mobilevit": Architecture("MobileViTConfig", "MobileViTForImageClassification", {
        "image_size": 64, "hidden_sizes": [16, 24, 32], "neck_hidden_sizes": [8, 8, 16, 16, 24, 24, 48],
    }, {"pixel_values": (4, 3, 64, 64)}),
    "regnet": Architecture("RegNetConfig", "RegNetForImageClassification", {
        "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1], "groups_width": 8,
    }, {"pixel_values": (4, 3, 64, 64)}),
    "mamba": Architecture("MambaConfig", "MambaForCausalLM", {
        "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 64, "state_size": 8,
    }, _TOKENS),
    "wav2vec2": Architecture("Wav2Vec2Config", "Wav2Vec2ForCTC", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4, "vocab_size": 32, "do_stable_layer_norm": True,
    }, {"input_values": (4, 400)}),
    # thirty-first session: newer decoders, mixtures of experts, a hybrid with Mamba layers, encoders, vision
    "gemma3": Architecture("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_GQA, "head_dim": 8, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
    }, _TOKENS),
    "qwen3_moe": Architecture("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_GQA, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    }, _TOKENS),
    "modernbert": Architecture("ModernBertConfig", "ModernBertForMaskedLM", {
        **SMALL, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2,
    }, _PADDED),
    "olmo2": Architecture("Olmo2Config", "Olmo2ForCausalLM", _GQA, _TOKENS),
    "gpt_oss": Architecture("GptOssConfig", "GptOssForCausalLM", {
        **_GQA, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
    }, _TOKENS),
    "deepseek_v3": Architecture("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **SMALL, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    }, _TOKENS),
    "granite": Architecture("GraniteConfig", "GraniteForCausalLM", _GQA, _TOKENS),
    "smollm3": Architecture("SmolLM3Config", "SmolLM3ForCausalLM", {**_GQA, "pad_token_id": 0}, _TOKENS),
    "glm4": Architecture("Glm4Config", "Glm4ForCausalLM", {**_GQA, "head_dim": 8, "pad_token_id": 0}, _TOKENS),
    "jamba": Architecture("JambaConfig", "JambaForCausalLM", {
        **_GQA, "num_experts": 2, "num_experts_per_tok": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
        "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 4,
    }, _TOKENS),
    "siglip_vision": Architecture("SiglipVisionConfig", "SiglipVisionModel", {
        **_VISION, "num_attention_heads": 4, "intermediate_size": 64,
    }, _IMAGES),
    "vitmae": Architecture("ViTMAEConfig", "ViTMAEForPreTraining", {
        **_VISION, "num_attention_heads": 4, "intermediate_size": 64, "decoder_hidden_size": 32,
        "decoder_num_hidden_layers": 1, "decoder_num_attention_heads": 4, "decoder_intermediate_size": 64,
    }, _IMAGES),
    "mpnet": Architecture("MPNetConfig", "MPNetForMaskedLM", {**SMALL, "max_position_embeddings": 40}, _PADDED),
    "funnel": Architecture("FunnelConfig", "FunnelForMaskedLM", {
        "d_model": 32, "n_head": 4, "d_head": 8, "d_inner": 64, "block_sizes": [1, 1], "vocab_size": 64,
    }, _PADDED),
    "levit": Architecture("LevitConfig", "LevitForImageClassification", {
        "image_size": 64, "hidden_sizes": [32, 48, 64], "num_attention_heads": [2, 3, 4], "depths": [1, 1, 1],
        "key_dim": [8, 8, 8],
    }, {"pixel_values": (4, 3, 64, 64)}),
    "mpt": Architecture("MptConfig", "MptForCausalLM", {
        "d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "max_seq_len": 32, "expansion_ratio": 2,
    }, _TOKENS),
    "codegen": Architecture("CodeGenConfig", "CodeGenForCausalLM", {
        "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 32, "rotary_dim": 4,
    }, _TOKENS),
    "hubert": Architecture("HubertConfig", "HubertForCTC", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4, "vocab_size": 32,
    }, {"input_values": (4, 400)}),
}  # fmt: skip
SWEEP.update(MORE)


def _check(arch: Architecture) -> str:
    try:
        model = build(arch, "meta", dropout=False)
        cluster = Cluster.from_spec("h100", 2)
        plan = plan_model(model, inputs(arch, "meta"), cluster, 16, optimizer="adamw", num_stages=2)
        said = f"planned from meta ({sum(len(s.blocks) for s in plan.stages)} blocks)"
    except Exception as error:  # a sweep reports every failure and goes on
        said = f"NOT planned from meta: {type(error).__name__}: {str(error)[:300]}"
    try:
        captured = capture(build(arch, "cpu", dropout=False), inputs(arch, "cpu"))
        differ, _ = differences(captured)
        first = {field: rows[:2] for field, rows in differ.items()}
        said += f"; DIFFER: {first}" if differ else "; estimate agrees with measure"
    except Exception as error:
        said += f"; NOT profiled on the CPU: {type(error).__name__}: {str(error)[:300]}"
    try:
        check_gradients(arch, checkpointing=False)
        said += "; captured gradients equal eager ones"
    except Exception as error:  # an AssertionError names the parameter whose gradient differs
        said += f"; GRADIENTS: {type(error).__name__}: {str(error)[:300]}"
    return said


def sweep_report(check: Callable[[str], tuple[str, str]], names: list[str]) -> dict[str, int]:
    """``check`` each architecture named (default: the tier's and this sweep's), one line each, then the count
    of each status; an architecture that raises is reported as "error" and the sweep goes on."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counts: dict[str, int] = {}
    for name in names or [*ARCHITECTURES, *(n for n in SWEEP if n not in ARCHITECTURES)]:
        try:
            status, detail = check(name)
        except Exception as error:  # reported, the sweep goes on
            status, detail = "error", f"{type(error).__name__}: {str(error)[:160]}"
        counts[status] = counts.get(status, 0) + 1
        print(f"{name:18s} {status:8s} {detail}", flush=True)
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return counts


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")
    for name in names or list(SWEEP):
        print(f"{name}: {_check(SWEEP[name])}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
