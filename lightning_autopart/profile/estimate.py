"""Roofline estimate of one block on a named device spec, from a forward and backward run on meta tensors."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_autopart.graph import Block
from lightning_autopart.profile.opcount import OpCounter, Roofline
from lightning_autopart.profile.precision import Precision
from lightning_autopart.profile.runner import BlockCost, Runner

__all__: list[str] = []

_META = torch.device("meta")
_SDPA = {
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}


class FusedAttention(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` on meta tensors as one fused (flash) kernel.

    On meta, sdpa would take its math path: a materialised ``T x T`` score matrix, several kernels, and
    that matrix saved for backward. Real devices run a fused kernel that saves only the output and the
    log-sum-exp, so the estimate uses the CPU flash-attention op, which has meta kernels, a derivative
    and (see ``opcount``) FLOP formulas. Calls it cannot express (grouped-query heads, non-4-D) pass through.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _SDPA and len(args) >= 3:
            fused = _fused_sdpa(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused_sdpa(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    tensors = (q, k, v)
    if enable_gqa or not all(isinstance(t, torch.Tensor) and t.is_meta and t.dim() == 4 for t in tensors):
        return None
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        return None
    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        return None  # a learned bias as the mask (T5's position bias): the fused kernel has no gradient for it
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


def estimate_block(block: Block, precision: Precision, roofline: Roofline) -> BlockCost:
    """Cost of ``block`` under ``roofline`` without real compute or memory.

    A copy of the block runs forward and backward on meta tensors, parameters and floating inputs held in
    the compute dtype (a "-mixed" precision is modelled as compute in its low-precision dtype), attention
    as one fused kernel (:class:`FusedAttention`). Each aten
    op costs ``max(flops / sustained FLOP/s, bytes / sustained bandwidth) + launch_us``; the fixed part of
    a phase is its kernel count times ``launch_us``. Saved-tensor bytes are metered as in measure mode.
    """
    compute = Precision(precision.name, precision.compute, precision.compute)
    runner = Runner(block, _META, compute)
    runner.context = FusedAttention
    counter = OpCounter(roofline)
    try:
        saved = runner.counted_run(counter)
    finally:
        runner.release()  # see [Note: no copy outlives the profiler] in sandbox.py
    fwd, bwd = counter.counts["fwd"], counter.counts["bwd"]
    fixed = (fwd.kernels * roofline.launch_us, bwd.kernels * roofline.launch_us)
    return BlockCost.of(counter, saved, (fwd.time_us, bwd.time_us), fixed)
