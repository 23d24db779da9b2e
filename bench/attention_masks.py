"""What attention masks cost in a captured graph and in estimate mode, on Hugging Face models at real widths.

Usage: ``python bench/attention_masks.py [--skip-measure]``. One process on the CPU, nothing downloaded
(configs only, random weights). Prints, per case, the mask each captured attention call carries (none, causal,
or a tensor) and one layer's estimate (meta tensors, H100 spec) beside a measured CPU run of the same capture
where that is affordable: saved bytes, backward's transient peak and forward FLOPs.

- ``roberta-base-padded``: RoBERTa-base shapes (2 layers), batch 8 x 256 tokens, the last 56 padded, attention
  dropout off (the CPU's fused kernel takes none); the mask is the user's and stays.
- ``vit-base``: ViT-Base shapes (2 layers), batch 8 of 224 x 224 images; no mask eagerly.
- ``llama-7b-meta``: Llama-2-7B shapes with 8 key/value heads (2 layers), built on meta, batch 1 x 2048 tokens,
  bf16-mixed, estimate only: the way ``autopart plan --profile estimate`` sees a model too big for the host.

Run it on two commits (``PYTHONPATH=<worktree> python bench/attention_masks.py``) to compare them.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch
import transformers

from lightning_autopart.capture import capture
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.profile import profile

__all__: list[str] = []

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _cases() -> dict[str, tuple[str, Any, dict[str, torch.Tensor], str | None]]:
    """Per case: its device, a builder of the model, its inputs and its precision."""
    g = torch.Generator().manual_seed(0)
    padding = torch.ones(8, 256, dtype=torch.long)
    padding[:, 200:] = 0
    roberta = transformers.RobertaConfig(num_hidden_layers=2, attention_probs_dropout_prob=0.0)
    vit = transformers.ViTConfig(num_hidden_layers=2, attention_probs_dropout_prob=0.0)
    llama = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    return {
        "roberta-base-padded": ("cpu", lambda: transformers.RobertaForMaskedLM(roberta), {
            "input_ids": torch.randint(5, 1000, (8, 256), generator=g), "attention_mask": padding,
        }, None),
        "vit-base": ("cpu", lambda: transformers.ViTForImageClassification(vit), {
            "pixel_values": torch.randn(8, 3, 224, 224, generator=g),
        }, None),
        "llama-7b-meta": ("meta", lambda: transformers.LlamaForCausalLM(llama), {
            "input_ids": torch.zeros(1, 2048, dtype=torch.long, device="meta"), "use_cache": False,
        }, "bf16-mixed"),
    }  # fmt: skip


def _masks(captured: CapturedModel) -> list[str]:
    """What each attention call of the capture is given: "causal", "none", or the mask's shape and dtype."""
    kinds = []
    for block in captured.blocks:
        for node in block.program.graph.nodes if block.program is not None else ():
            if node.op == "call_function" and node.target is _SDPA:
                mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
                if node.kwargs.get("is_causal"):
                    kinds.append("causal")
                elif mask is None:
                    kinds.append("none")
                else:
                    value = mask.meta.get("val")
                    kinds.append(f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}")
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-measure", action="store_true", help="estimate mode only")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    for name, (device, make, inputs, dtype) in _cases().items():
        with torch.device(device):
            model = make()
        captured = capture(model, inputs)
        print(f"{name}: attention masks {_masks(captured)}")
        modes = ["estimate"] if device == "meta" or args.skip_measure else ["estimate", "measure"]
        for mode in modes:
            extra = {"spec": "h100"} if mode == "estimate" else {"device": "cpu", "warmup": 0, "repeats": 1}
            prof = profile(captured, mode, dtype=dtype, **extra)
            layer = next(b for b in prof.blocks if b.name.endswith("layer.0") or b.name.endswith("layers.0"))
            print(
                f"  {mode:8} {layer.name}: saved {layer.activation_bytes / 1e6:.2f} MB, transient "
                f"{layer.transient_bytes / 1e6:.2f} MB, forward {layer.fwd_flops / 1e9:.2f} GFLOP"
                + (f", {layer.fwd_us:.0f} + {layer.bwd_us:.0f} us on an H100" if mode == "estimate" else "")
            )


if __name__ == "__main__":
    main()
