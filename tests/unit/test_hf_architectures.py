"""Planning, in estimate mode, the model code of many Hugging Face architectures built on meta (decoders,
encoders, encoder-decoders, convolutional and windowed vision models, speech): the way
``autopart plan --profile estimate`` plans a model too big for the host. Each is a tiny config of the real
class (tests/hf_architectures.py); the plan must capture whole layers and price every block. The tier that also trains them against
one-process training is tests/distributed/test_hf_pipeline.py (GPT-2, Llama, Mistral, Mixtral, BERT, T5,
ViT).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers

from lightning_autopart import Cluster, plan_model
from lightning_autopart.capture import capture
from lightning_autopart.profile import profile
from tests.hf_architectures import ARCHITECTURES, SMALL, build, inputs


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_built_on_meta_it_is_planned_in_estimate_mode(name: str) -> None:
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dropped cache is reported (tested in test_hf_capture.py)
        plan = plan_model(model, inputs(name), Cluster.from_spec("h100", 2), 16, optimizer="adamw", num_stages=2)
    blocks = [b for stage in plan.stages for b in stage.blocks]
    assert plan.num_stages == 2 and len(blocks) >= 4, blocks
    assert all(s.fwd_us > 0 and s.bwd_us > 0 for s in plan.stages)
    assert plan.prediction.step_us > 0
    assert "batch_mixing" not in plan.notes, plan.notes["batch_mixing"]  # [Note: values that mix samples]


def test_a_mixtures_experts_are_priced() -> None:
    """Mixtral's experts run in a custom op (transformers' grouped-product fallback) that a dispatch mode sees
    as one opaque call: a layer's FLOPs must still be its attention, its router and each token's top 2 of 4
    experts (they were its attention and router alone)."""
    hidden, inner, experts, top, heads, kv_heads = 32, 64, 4, 2, 4, 2
    routing = {"num_local_experts": experts, "num_experts_per_tok": top}
    config = transformers.MixtralConfig(**SMALL, num_key_value_heads=kv_heads, **routing)
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
