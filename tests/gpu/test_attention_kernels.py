"""Captured attention runs the kernel eager code runs on a GPU. A causal mask torch.export materialised
becomes ``is_causal=True`` and an all-true one is dropped ([Note: causal masks]), so the stages of the GPT
example, of a ViT and of a Llama with grouped key/value heads ([Note: grouped heads]) run flash attention:
under ``sdpa_kernel(FLASH_ATTENTION)`` a call that still carried a mask, or repeated heads, would find no
kernel or copy the keys. ``check_flash`` takes the device, so it can be tried on the CPU (where flash also
takes masks)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from examples.gpt import GPT
from lightning_autopart.capture import capture
from lightning_autopart.runtime.stages import build_stage_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _models() -> dict[str, tuple[torch.nn.Module, dict[str, Any]]]:
    torch.manual_seed(0)
    cases: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {
        "gpt": (GPT.from_preset("tiny"), {"tokens": torch.randint(0, 256, (2, 32))}),
    }
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    cases["vit"] = (transformers.ViTModel(config), {"pixel_values": torch.randn(2, 3, 32, 32)})
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    # grouped key/value heads: flash reads them unrepeated ([Note: grouped heads])
    cases["llama-gqa"] = (transformers.LlamaModel(llama), {"input_ids": torch.randint(0, 64, (2, 32))})
    return cases


def check_flash(device: torch.device, name: str) -> None:
    """The captured model, cut in two stages, runs in bf16 with flash attention alone and matches eager."""
    model, inputs = _models()[name]
    captured = capture(model, inputs)
    bounds = [0, captured.num_blocks // 2, captured.num_blocks]
    stages = [build_stage_module(captured, a, b).to(device) for a, b in itertools.pairwise(bounds)]
    model.to(device)
    values: tuple[Any, ...] = tuple(t.to(device) for t in inputs.values())
    bf16 = torch.autocast(device.type, dtype=torch.bfloat16)
    with torch.no_grad(), bf16, sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for stage in stages:
            values = stage(*values)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        eager = model(**inputs_on(inputs, device))
    expected = eager if isinstance(eager, torch.Tensor) else eager[0]
    out = captured.output.rebuild(values)
    got = out if isinstance(out, torch.Tensor) else out[0]
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def inputs_on(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device) for key, value in inputs.items()}


@pytest.mark.parametrize("name", ["gpt", "vit", "llama-gqa"])
def test_captured_attention_runs_flash(name: str) -> None:
    check_flash(torch.device("cuda"), name)
