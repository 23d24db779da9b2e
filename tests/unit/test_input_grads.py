"""A profiled block computes the gradients training computes, no more ([Note: inputs without a gradient]): a
float input made from buffers alone (a rotary table) gets none, and the captured graph's backward runs the
kernels eager backward runs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.profile.opcount import OpCounter
from lightning_autopart.profile.precision import parse_precision
from lightning_autopart.profile.runner import Runner
from lightning_autopart.profile.sandbox import needs_input_grad

transformers = pytest.importorskip("transformers")


class _Logits(nn.Module):
    """A causal LM called as users call it, returning its logits."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, max_position_embeddings=32,
        )  # fmt: skip
        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def _llama(kv_heads: int = 4) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Logits(kv_heads), torch.randint(0, 64, (2, 16))


def test_rotary_tables_get_no_gradient() -> None:
    model, ids = _llama()
    cap = capture(model, ((ids,), {}))
    layers = [b for b in cap.blocks if ".layers." in b.name]
    assert len(layers) == 2
    for block in layers:
        flags = needs_input_grad(block)
        floats = [(t.name, f) for t, a, f in zip(block.inputs, block.args, flags, strict=True)
                  if isinstance(a, torch.Tensor) and a.is_floating_point()]  # fmt: skip
        assert [f for _, f in floats].count(True) == 1, floats  # the hidden states alone
        assert [f for _, f in floats].count(False) == 2, floats  # cos and sin
        assert flags == [t.requires_grad for t in block.inputs]


def _backward_ops(counter: OpCounter) -> Counter[str]:
    # ones_like seeds eager backward; the profile's adds into its zeroed gradients are a later micro-batch's
    # and go uncounted ([Note: gradient accumulation]), as eager's first backward keeps the gradients it makes
    return Counter(o.op for o in counter.ops if o.phase == "bwd" and o.op != "aten.ones_like.default")


@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped heads, [Note: grouped heads]
def test_profiled_backward_runs_eager_backwards_kernels(kv_heads: int) -> None:
    """A Llama layer's profiled backward ran 106 kernels where training runs 96: the cos and sin gradients."""
    model, ids = _llama(kv_heads)
    eager = OpCounter(keep_ops=True)
    with eager:
        eager.phase = "fwd"
        out = model(ids)
        eager.phase = "bwd"
        out.backward(torch.ones_like(out))
    model.zero_grad(set_to_none=True)
    cap = capture(model, ((ids,), {}))
    profiled: Counter[str] = Counter()
    for block in cap.blocks:
        runner = Runner(block, torch.device("cpu"), parse_precision(None, model))
        counter = OpCounter(keep_ops=True)
        runner.counted_run(counter)
        runner.release()
        profiled += _backward_ops(counter)
    assert profiled == _backward_ops(eager)
