"""Products the counter cannot see one by one. Grouped matrix products (a mixture of experts' matmul) are
priced by their FLOPs and products: torch's ``_grouped_mm`` in each of its layouts, and Hugging Face's
fallback custom op, which a dispatch mode cannot see inside. Any other custom op with no FLOP formula is
named, not silently free."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_autopart.devices import device_spec
from lightning_autopart.profile.gemms import GROUPED, Gemm, gemms_of
from lightning_autopart.profile.opcount import OpCounter, Roofline, flop_formula


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


@pytest.mark.parametrize(
    ("a", "b", "gemm"),
    [
        ((10, 8), (3, 8, 6), Gemm("matmul", 1, 10, 6, 8)),  # routed tokens through their experts
        ((3, 4, 8), (3, 8, 6), Gemm("matmul", 3, 4, 6, 8)),  # batched
        ((8, 10), (10, 6), Gemm("matmul", 1, 8, 6, 10)),  # weight gradient: K split among the groups
        ((3, 4, 8), (8, 12), Gemm("matmul", 1, 4, 12, 8)),
    ],
)
def test_each_layout_of_torch_grouped_mm(a: tuple[int, ...], b: tuple[int, ...], gemm: Gemm) -> None:
    packet = torch.ops.aten._grouped_mm
    assert gemms_of(packet, (_meta(*a), _meta(*b)), {}, None) == (gemm,)
    assert flop_formula(packet)(_meta(*a), _meta(*b)) == gemm.flops


def test_the_fallbacks_backward_is_both_gradients() -> None:
    x, w, grad = _meta(10, 8), _meta(3, 8, 6), _meta(10, 6)
    gemms = GROUPED["transformers.grouped_mm_fallback_backward"](x, w, None, grad)
    assert gemms == (Gemm("matmul", 1, 10, 8, 6), Gemm("matmul", 1, 8, 6, 10))
    assert sum(g.flops for g in gemms) == 2 * 2 * 10 * 8 * 6


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_counter_prices_the_opaque_fallback_op(device: str) -> None:
    """The custom op runs its products out of the mode's sight: the counter still counts them, forward and
    backward (2 x 10 x 8 x 6 FLOPs, then twice that)."""
    pytest.importorskip("transformers.integrations.moe")
    x = torch.randn(10, 8, device=device, requires_grad=True)
    w = torch.randn(3, 8, 6, device=device, requires_grad=True)
    offs = torch.tensor([3, 7, 10], device=device)
    counter = OpCounter(Roofline.of(device_spec("h100"), "float32", waves=True), keep_ops=True)
    out: Any
    with counter:
        counter.phase = "fwd"
        out = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
        counter.phase = "bwd"
        out.backward(torch.ones_like(out))
        counter.phase = None
    assert counter.counts["fwd"].flops == 2 * 10 * 8 * 6
    assert counter.counts["bwd"].flops == 2 * 2 * 10 * 8 * 6
    assert [o.gemms for o in counter.ops if o.phase == "fwd" and o.gemms] == [(Gemm("matmul", 1, 10, 6, 8),)]
    assert counter.counts["fwd"].time_us > 0


@torch.library.custom_op("autopart_test::opaque_product", mutates_args=())
def _opaque_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A library's kernel: a product the dispatch mode cannot see inside, with no FLOP formula."""
    return x @ w


@_opaque_product.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def _keep(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _gradients(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = ctx.saved_tensors
    return grad @ w.T, x.T @ grad


_opaque_product.register_autograd(_gradients, setup_context=_keep)


class _UsesOpaque(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_opaque_product(self.first(x), self.first.weight))


def test_a_custom_op_without_flops_is_named_not_silently_free() -> None:
    """Estimate mode prices an op it cannot see into by its bytes alone: the profile names it, a warning says
    so with the fix, and the plan's notes carry it. Measure mode times it: named in the profile, no
    warning."""
    from lightning_autopart import Cluster, plan_model
    from lightning_autopart.capture import capture
    from lightning_autopart.profile import profile

    with torch.device("meta"):
        model = _UsesOpaque()
    x = torch.empty(8, 16, device="meta")
    expected = r"priced autopart_test\.opaque_product \(custom ops .* profile='measure'"
    with pytest.warns(UserWarning, match=expected):
        plan = plan_model(model, x, Cluster.from_spec("h100", 1), 8)
    assert plan.notes["unpriced_ops"] == "autopart_test.opaque_product"
    real = _UsesOpaque()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measured = profile(capture(real, torch.randn(8, 16)), mode="measure", repeats=1)
    assert measured.meta["opaque_ops"] == ["autopart_test.opaque_product"]
