"""Causal masks materialised by torch.export run as ``is_causal=True`` attention, as eager code runs them
([Note: causal masks] in lightning_autopart/capture/causal.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.causal import fold_causal_masks
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.runtime.stages import build_stage_module

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _attention_calls(captured: CapturedModel) -> list[fx.Node]:
    return [
        n
        for b in captured.blocks
        for n in b.program.graph.nodes  # type: ignore[union-attr]
        if n.op == "call_function" and n.target is _SDPA
    ]


def _masked(node: fx.Node) -> bool:
    return len(node.args) > 3 or node.kwargs.get("attn_mask") is not None


def _run(captured: CapturedModel, inputs: list[Any]) -> Any:
    values = tuple(inputs)
    half = captured.num_blocks // 2
    for start, end in itertools.pairwise([0, half, captured.num_blocks]):
        values = build_stage_module(captured, start, end)(*values)
    return values


class Attention(nn.Module):
    """Two attention layers whose mask is a buffer (causal, a window, or all true), a mask built from aranges
    (causal, or a window), or a padding mask (an input)."""

    def __init__(self, kind: str, size: int = 6) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(nn.Linear(8, 24) for _ in range(2))
        pattern = torch.ones(size, size, dtype=torch.bool)
        if not kind.startswith("full"):
            pattern = pattern.tril()
        if kind == "window":  # causal, but only the last 2 positions: not what is_causal computes
            pattern &= torch.ones(size, size, dtype=torch.bool).triu(-1)
        if kind.endswith("additive"):
            self.register_buffer("mask", torch.zeros(size, size).masked_fill(~pattern, float("-inf")))
        else:
            self.register_buffer("mask", pattern)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[1]
        if self.kind.startswith("arange"):
            pos = torch.arange(n, device=x.device)
            allowed = pos[None, :] <= pos[:, None]
            if self.kind == "arange_window":
                allowed &= pos[None, :] >= pos[:, None] - 1
            mask: torch.Tensor = allowed[None, None].expand(x.shape[0], 1, n, n)
        else:
            mask = self.mask[:n, :n]
        if padding is not None:
            mask = mask & padding[:, None, None, :].bool()
        for layer in self.layers:
            q, k, v = layer(x).unflatten(-1, (2, 12)).transpose(1, 2).chunk(3, dim=-1)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(-2)[..., :8]
        return x


@pytest.mark.parametrize("kind", ["buffer", "arange", "additive"])
def test_a_constant_causal_mask_becomes_is_causal(kind: str) -> None:
    torch.manual_seed(0)
    model, x = Attention(kind), torch.randn(2, 6, 8)
    captured = capture(model, (x,))
    calls = _attention_calls(captured)
    assert len(calls) == 2
    assert all(n.kwargs.get("is_causal") is True and not _masked(n) for n in calls)
    # The mask's own operations are gone: no block computes or carries it.
    assert not any(
        n.target in (torch.ops.aten.le.Tensor, torch.ops.aten.tril.default)
        for b in captured.blocks
        for n in b.program.graph.nodes  # type: ignore[union-attr]
    )
    (out,) = _run(captured, [x])
    torch.testing.assert_close(out, model(x))


def test_a_non_causal_or_input_dependent_mask_is_kept() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    window = Attention("window")
    assert all(_masked(n) for n in _attention_calls(capture(window, (x,))))
    padded = Attention("buffer")
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[0, 4:] = 0
    captured = capture(padded, (x, padding))
    assert all(_masked(n) for n in _attention_calls(captured))
    (out,) = _run(captured, [x, padding])
    torch.testing.assert_close(out, padded(x, padding))


@pytest.mark.parametrize("kind", ["arange", "arange_window"])
def test_a_mask_built_on_meta_from_aranges_is_computed_on_the_cpu(kind: str) -> None:
    """A model built on meta (``init_module(empty_init=True)``, estimate mode) computes its mask on meta,
    where values are unknown; a mask made by the graph's own factories is computed again on the CPU and folded
    when causal, so the stages run (and estimate mode prices) the kernel eager code runs."""
    with torch.device("meta"):
        model = Attention(kind)
    calls = _attention_calls(capture(model, (torch.randn(2, 6, 8, device="meta"),)))
    assert len(calls) == 2
    if kind == "arange":
        assert all(n.kwargs.get("is_causal") is True and not _masked(n) for n in calls)
    else:  # not causal: computed, and kept
        assert all(_masked(n) and not n.kwargs.get("is_causal") for n in calls)


def test_a_mask_read_from_a_meta_buffer_is_left_alone() -> None:
    """A buffer's values are unknown on meta: nothing is folded, so nothing can be folded wrongly."""
    with torch.device("meta"):
        model = Attention("buffer")
    captured = capture(model, (torch.randn(2, 6, 8, device="meta"),))
    assert all(_masked(n) for n in _attention_calls(captured))


class LearnedBias(nn.Module):
    """Attention whose additive mask is a learned bias that starts at zero (as BEiT's relative-position tables
    do)."""

    def __init__(self, size: int = 6) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.bias = nn.Parameter(torch.zeros(2, size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (2, 12)).transpose(1, 2).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias * 1.0)
        return out.transpose(1, 2).flatten(-2)


def test_a_learned_bias_is_never_folded() -> None:
    """At capture the bias is all zeros, which reads as a mask that masks nothing; dropped, it would never
    train."""
    model = nn.Sequential(nn.Linear(8, 8), LearnedBias())
    captured = capture(model, (torch.randn(2, 6, 8),))
    calls = _attention_calls(captured)
    assert len(calls) == 1 and _masked(calls[0])


def test_fold_reports_its_count_and_needs_equal_lengths() -> None:
    graph = fx.Graph()
    q, k = graph.placeholder("q"), graph.placeholder("k")
    q.meta["val"], k.meta["val"] = torch.empty(1, 1, 4, 2), torch.empty(1, 1, 5, 2)
    ones = graph.call_function(torch.ops.aten.ones.default, ([4, 5],), {"dtype": torch.bool})
    mask = graph.call_function(torch.ops.aten.tril.default, (ones,))
    masked = graph.call_function(_SDPA, (q, k, k, mask))
    full = graph.call_function(_SDPA, (q, k, k, ones))
    graph.output((masked, full))
    assert fold_causal_masks(graph, {}) == 1
    assert masked.args[3] is mask  # query 4 and key 5 long: is_causal would align differently
    assert len(full.args) == 3 and not full.kwargs.get("is_causal")  # all true: no mask, whatever the lengths


@pytest.mark.parametrize("kind", ["full", "full_additive"])
def test_a_constant_mask_that_masks_nothing_is_dropped(kind: str) -> None:
    """An encoder's or a vision model's mask without padding: eager code passes none and runs flash."""
    torch.manual_seed(0)
    model, x = Attention(kind), torch.randn(2, 6, 8)
    captured = capture(model, (x,))
    calls = _attention_calls(captured)
    assert len(calls) == 2 and not any(_masked(n) or n.kwargs.get("is_causal") for n in calls)
    (out,) = _run(captured, [x])
    torch.testing.assert_close(out, model(x))


def test_hf_llama_attention_runs_causal_as_eagerly() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16))
    captured = capture(model, {"input_ids": ids, "labels": ids, "use_cache": False})
    calls = _attention_calls(captured)
    assert len(calls) == 2 and all(n.kwargs.get("is_causal") is True and not _masked(n) for n in calls)
    tensors = _run(captured, [ids, ids])
    reference = model(input_ids=ids, labels=ids, use_cache=False)
    out = captured.output.rebuild(tensors)
    torch.testing.assert_close(out.loss, reference.loss)
    torch.testing.assert_close(out.logits, reference.logits)


def test_hf_llama_built_on_meta_runs_causal_as_eagerly() -> None:
    """The decoder a user builds under ``init_module(empty_init=True)``: its mask is made on meta."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    calls = _attention_calls(capture(model, {"input_ids": ids, "labels": ids, "use_cache": False}))
    assert len(calls) == 2 and all(n.kwargs.get("is_causal") is True and not _masked(n) for n in calls)


def test_the_gpt_example_built_on_meta_runs_causal() -> None:
    """examples/gpt.py makes its mask with ``tril(ones(..., device=x.device))``: built under
    ``init_module(empty_init=True)`` (meta), its stages must still run ``is_causal=True``, not the masked
    kernel."""
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT.from_preset("tiny")
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    calls = _attention_calls(capture(model, (tokens,)))
    assert calls and all(n.kwargs.get("is_causal") is True and not _masked(n) for n in calls)
