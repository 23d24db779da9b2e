"""Grouped key/value heads run as eager code runs them, ``enable_gqa=True`` on the unrepeated keys and values,
once the capture folded the mask that made them repeated ([Note: grouped heads])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.grouped_heads import fold_repeated_heads
from lightning_autopart.profile.saved import SavedTensorMeter
from tests.unit.test_causal_masks import _attention_calls, _masked, _run

transformers = pytest.importorskip("transformers")

_REPEAT = {torch.ops.aten.expand.default}


def _llama(kv_heads: int, *, meta: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=16, attn_implementation="sdpa",
    )  # fmt: skip
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)
    return transformers.LlamaForCausalLM(config)


def _repeats(captured: object) -> int:
    blocks = captured.blocks  # type: ignore[attr-defined]
    return sum(n.target in _REPEAT for b in blocks for n in b.program.graph.nodes)


@pytest.mark.parametrize("meta", [False, True])
def test_hf_grouped_heads_are_not_repeated(meta: bool) -> None:
    model = _llama(2, meta=meta)
    ids = torch.randint(0, 64, (2, 16), device="meta" if meta else None)
    captured = capture(model, {"input_ids": ids, "labels": ids, "use_cache": False})
    calls = _attention_calls(captured)
    assert len(calls) == 2 and all(n.kwargs.get("enable_gqa") is True and not _masked(n) for n in calls)
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in calls)  # two key heads, as the layer made them
    assert _repeats(captured) == 0


def test_captured_grouped_attention_equals_eager_with_its_gradients_and_saved_bytes() -> None:
    model = _llama(2)
    ids = torch.randint(0, 64, (2, 16))
    captured = capture(model, {"input_ids": ids, "labels": ids, "use_cache": False})
    meter = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers()])
    with meter.hooks():
        out = captured.output.rebuild(_run(captured, [ids, ids]))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    model.zero_grad()
    eager_meter = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers()])
    with eager_meter.hooks():
        reference = model(input_ids=ids, labels=ids, use_cache=False)
    reference.loss.backward()
    torch.testing.assert_close(out.loss, reference.loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    assert meter.nbytes == eager_meter.nbytes  # no repeated keys and values kept for backward


def test_full_heads_and_padded_batches_keep_their_attention() -> None:
    """Four key heads for four query heads repeat nothing; a padding mask (an input) stays, and with it the
    repeat, as eagerly."""
    ids = torch.randint(0, 64, (2, 16))
    plain = capture(_llama(4), {"input_ids": ids, "labels": ids, "use_cache": False})
    assert not any(n.kwargs.get("enable_gqa") for n in _attention_calls(plain))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, :3] = 0
    inputs = {"input_ids": ids, "attention_mask": padding, "labels": ids, "use_cache": False}
    padded = capture(_llama(2), inputs)
    calls = _attention_calls(padded)
    assert calls and all(_masked(n) and not n.kwargs.get("enable_gqa") for n in calls)


def _graph(groups: int, *, query_heads: int) -> tuple[fx.Graph, fx.Node]:
    """An unmasked attention over keys and values whose 2 heads were each repeated ``groups`` times."""

    class Repeat(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            b, kv, t, d = k.shape
            k = k[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)
            v = v[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)
            return F.scaled_dot_product_attention(q[:, : kv * groups], k, v)

    q, kv = torch.randn(1, query_heads, 5, 8), torch.randn(1, 2, 5, 8)
    graph = torch.export.export(Repeat(), (q, kv, kv.clone())).run_decompositions({}).graph
    (node,) = [n for n in graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    return graph, node


def test_the_rewrite_needs_every_query_head_grouped() -> None:
    graph, node = _graph(2, query_heads=4)
    assert fold_repeated_heads(node) and node.kwargs["enable_gqa"] is True
    assert not any(n.target in _REPEAT for n in graph.nodes)
    graph, node = _graph(1, query_heads=2)  # nothing grouped
    assert not fold_repeated_heads(node)


_ATTENTION = torch.ops.aten


@pytest.mark.parametrize(
    ("op", "q_at", "extra"),
    [
        (_ATTENTION._scaled_dot_product_flash_attention, 0, ()),
        (_ATTENTION._scaled_dot_product_efficient_attention, 0, (None, True)),
        (_ATTENTION._scaled_dot_product_cudnn_attention, 0, (None, True)),
        (_ATTENTION._scaled_dot_product_flash_attention_backward, 1, ()),
        (_ATTENTION._scaled_dot_product_efficient_attention_backward, 1, (None,)),
    ],
)
def test_a_gpus_grouped_attention_counts_as_repeated_heads(
    op: object, q_at: int, extra: tuple[object, ...]
) -> None:
    """torch 2.11's FLOP formulas refused grouped key/value heads: measure mode failed on an H200 at a grouped
    Llama's first layer. They count as the heads repeated, as torch 2.13 counts them."""
    from lightning_autopart.profile.opcount import flop_formula

    q = torch.empty(2, 8, 16, 32, device="meta")
    grouped, repeated = torch.empty(2, 2, 16, 32, device="meta"), torch.empty(2, 8, 16, 32, device="meta")
    before = (q,) * q_at

    def count(kv: torch.Tensor) -> float:
        return float(flop_formula(op)(*before, q, kv, kv, *extra, *(q,) * q_at, out_val=None))

    assert count(grouped) == count(repeated) > 0
