"""Hugging Face models, captured, train as they do eagerly: one backward through the exported graph gives
every parameter the gradient eager training gives (model code nobody here wrote; dropout off, so both runs
are deterministic, or draw alike from one seed), also with Hugging Face's reentrant activation checkpointing.
Custom autograd Functions (BLOOM's GeLU, RecurrentGemma's clipped square root, PhiMoE's router), checkpointing,
tied embeddings, shared relative-position tables and folded attention masks all have to come out right for this
to hold."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

pytest.importorskip("transformers")

from lightning_autopart.capture import capture
from tests.hf_architectures import ARCHITECTURES, Architecture, build, inputs


def _output(out: object) -> torch.Tensor:
    """The logits, or the first floating output that needs a gradient."""
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    leaves = pytree.tree_leaves(out)
    return next(t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad)


def check_gradients(name: str | Architecture, checkpointing: bool) -> None:
    """One backward through the export of architecture ``name`` (a name or a row) gives every parameter eager's
    gradient; shared with bench/hf_sweep.py."""
    model = build(name, "cpu", dropout=False).train()
    if checkpointing:  # reentrant, as older training scripts ask for it (it was torch's default)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    x = inputs(name, "cpu")
    captured = capture(model, x)
    assert captured.method == "export" and captured.split_graph is not None, f"captured by {captured.method}"
    torch.manual_seed(1)  # the same draws (PhiMoE's router samples its experts in training)
    _output(model(**x)).float().square().mean().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = captured.output.rebuild(list(captured.split_graph(*x.values())))
    _output(out).float().square().mean().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(eager)
    for n, grad in eager.items():
        torch.testing.assert_close(got[n], grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_captured_gradients_equal_eager_ones(name: str) -> None:
    check_gradients(name, checkpointing=False)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing_enable's new name in 5.x
@pytest.mark.parametrize("name", ["qwen2", "bloom", "roberta", "bart", "swin", "whisper"])
def test_with_reentrant_checkpointing_too(name: str) -> None:
    check_gradients(name, checkpointing=True)
