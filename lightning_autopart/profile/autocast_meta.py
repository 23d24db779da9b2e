"""Autocast's casts on meta tensors, so that estimate mode prices a "-mixed" precision as the device runs it.

[Note: autocast on meta] ``torch.autocast`` applies to tensors of the device type it names; meta tensors have
none, so a meta copy under autocast runs every op in float32. Running the whole block in bfloat16 instead (what
estimate mode did) misses what autocast really does: the weight copies made every forward (on an H100, 4 ms
of a 52 ms GPT-2 bf16-mixed step in ``copy_``), the float32 ops it keeps (layer norms, softmax, the loss) and
the float32 activations they save. :class:`MetaAutocast` applies autocast's own op lists at the ``torch``
function level, above autograd as autocast is, so the casts are ops the counters see and autograd
differentiates: products, convolutions and attention in the low-precision dtype, the float32 list in float32,
everything else as type promotion gives it. Every use of a parameter is cast afresh, as Lightning's autocast
(``cache_enabled=False``) does: a weight a loop applies T times leaves T copies for the backward.
The lists are those of the device the estimate prices: a CPU's autocast keeps far fewer ops in float32 (no
layer norm, softmax or ``pow``), so a GELU's intermediates that a GPU saves in float32 a CPU saves in bfloat16.

[Note: the loss under autocast] ``F.cross_entropy`` is on none of CUDA's lists (``autocast_mode.h``): it
decomposes into ``log_softmax`` with the input's own dtype set, which autocast keeps (a bfloat16 result,
saved for the backward), and ``nll_loss``, on the float32 list (a float32 copy of the log-probabilities, saved
too). Estimated as one float32 cast of the logits, GPT small's bf16-mixed loss was priced with a float32
log-softmax, a float32 gradient of it and a float32 gradient of the logits: 1.08 of its measured peak on an
H200, 0.99 now (with the loss run under autocast at all: [Note: the loss] in loss.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from lightning_autopart.capture.kept_functions import modes_inside

__all__: list[str] = []

_T = torch.Tensor

#: Ops autocast runs in the low-precision dtype (CUDA's "lower_precision_fp" list).
_LOW: frozenset[Any] = frozenset(
    {
        F.linear, F.bilinear, F.prelu, F.scaled_dot_product_attention,
        F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
        torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm,
        torch.mv, _T.mv, torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm, _T.addbmm,
        torch.addmv, _T.addmv, torch.addr, _T.addr, torch.chain_matmul, torch.linalg.multi_dot,
        # products autocast lists, or reaches through the products they decompose into
        torch.einsum, torch.tensordot, torch.linalg.vecdot,
    }
)  # fmt: skip

#: Ops autocast runs in float32 (CUDA's "fp32" list, the ones models call). Its "fp32_set_opt_dtype" ops (softmax,
#: sum, ...) are here too: autocast sets their output dtype, and their kernels convert a bfloat16 input first.
_FP32: frozenset[Any] = frozenset(
    {
        F.layer_norm, F.group_norm, F.softmax, F.log_softmax, F.softmin, F.softplus, F.normalize,
        F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
        F.poisson_nll_loss, F.binary_cross_entropy_with_logits, F.cosine_similarity, F.cosine_embedding_loss,
        F.margin_ranking_loss, F.hinge_embedding_loss, F.soft_margin_loss, F.multi_margin_loss,
        F.multilabel_margin_loss, F.triplet_margin_loss, F.pdist,
        torch.softmax, _T.softmax, torch.log_softmax, _T.log_softmax, torch.exp, _T.exp, torch.expm1, _T.expm1,
        torch.log, _T.log, torch.log1p, _T.log1p, torch.log2, _T.log2, torch.log10, _T.log10,
        torch.pow, _T.pow, _T.__pow__, _T.__rpow__, torch.rsqrt, _T.rsqrt, torch.reciprocal, _T.reciprocal,
        _T.__rtruediv__, torch.sum, _T.sum, torch.prod, _T.prod, torch.cumsum, _T.cumsum, torch.cumprod,
        _T.cumprod, torch.norm, _T.norm, torch.dist, torch.cdist, torch.acos, torch.asin, torch.cosh,
        torch.sinh, torch.tan, torch.erfinv, torch.renorm, torch.logsumexp, _T.logsumexp,
    }
)  # fmt: skip

_aten = torch.ops.aten

#: The same lists as aten ops, for graphs captured at the aten level (``torch.export``); matched by packet.
_LOW_ATEN: frozenset[Any] = frozenset(
    {
        _aten.linear, _aten.bilinear, _aten.prelu, _aten.matmul, _aten.mm, _aten.bmm, _aten.mv, _aten.addmm,
        _aten.baddbmm, _aten.addbmm, _aten.addmv, _aten.addr, _aten.chain_matmul, _aten.linalg_multi_dot,
        _aten.conv1d, _aten.conv2d, _aten.conv3d, _aten.conv_transpose1d, _aten.conv_transpose2d,
        _aten.conv_transpose3d, _aten.convolution, _aten._convolution, _aten.scaled_dot_product_attention,
        _aten.einsum, _aten.tensordot, _aten.linalg_vecdot,
    }
)  # fmt: skip
_FP32_ATEN: frozenset[Any] = frozenset(
    {
        _aten.layer_norm, _aten.native_layer_norm, _aten.group_norm, _aten.native_group_norm, _aten.softmax,
        _aten._softmax, _aten.log_softmax, _aten._log_softmax, _aten.cross_entropy_loss, _aten.nll_loss,
        _aten.nll_loss_forward, _aten.nll_loss2d, _aten.mse_loss, _aten.l1_loss, _aten.smooth_l1_loss,
        _aten.huber_loss, _aten.kl_div, _aten.binary_cross_entropy_with_logits, _aten.softplus,
        _aten.cosine_similarity, _aten.exp, _aten.expm1, _aten.log, _aten.log1p, _aten.log2, _aten.log10,
        _aten.pow, _aten.rsqrt, _aten.reciprocal, _aten.sum, _aten.prod, _aten.cumsum, _aten.cumprod,
        _aten.norm, _aten.linalg_vector_norm, _aten.dist, _aten.cdist, _aten.pdist, _aten.acos, _aten.asin,
        _aten.cosh, _aten.sinh, _aten.tan, _aten.erfinv, _aten.renorm, _aten.logsumexp,
    }
)  # fmt: skip

#: What CPU autocast leaves out of them (checked on torch 2.13): no vector products among the low-precision ops,
#: and of the float32 ones only the losses, ``prod`` and ``cdist`` (norms, softmax and pointwise math run in
#: their input's dtype).
_NOT_LOW_ON_CPU: frozenset[Any] = frozenset(
    {torch.mv, _T.mv, torch.addmv, _T.addmv, torch.addr, _T.addr, F.bilinear, torch.chain_matmul,
     _aten.mv, _aten.addmv, _aten.addr, _aten.bilinear, _aten.chain_matmul}
)  # fmt: skip
_FP32_ON_CPU: frozenset[Any] = frozenset(
    {
        F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.kl_div, F.poisson_nll_loss,
        F.binary_cross_entropy_with_logits, F.cosine_embedding_loss, F.margin_ranking_loss,
        F.hinge_embedding_loss, F.soft_margin_loss, F.multi_margin_loss, F.triplet_margin_loss, torch.prod,
        _T.prod, torch.cdist, _aten.cross_entropy_loss, _aten.nll_loss, _aten.nll_loss_forward, _aten.nll_loss2d,
        _aten.mse_loss, _aten.l1_loss, _aten.smooth_l1_loss, _aten.kl_div, _aten.binary_cross_entropy_with_logits,
        _aten.prod, _aten.cdist,
    }
)  # fmt: skip
#: Per device type: the low-precision functions and aten packets, then the float32 ones. CUDA's
#: ``F.cross_entropy`` is on no list: it decomposes ([Note: the loss under autocast]).
_LISTS: dict[str, tuple[frozenset[Any], frozenset[Any], frozenset[Any], frozenset[Any]]] = {
    "cuda": (_LOW, _LOW_ATEN, _FP32 - {F.cross_entropy}, _FP32_ATEN),
    "cpu": (_LOW - _NOT_LOW_ON_CPU, _LOW_ATEN - _NOT_LOW_ON_CPU, _FP32 & _FP32_ON_CPU, _FP32_ATEN & _FP32_ON_CPU),
}

_LOW_SOURCES = frozenset({torch.float32})
#: The operator a kept autograd Function runs as ([Note: Functions kept whole]).
_KEPT = torch.ops.autopart.function_call
_FP32_SOURCES = frozenset({torch.bfloat16, torch.float16})


class MetaAutocast(TorchFunctionMode):
    """``torch.autocast(device, dtype=dtype)`` for meta tensors (see [Note: autocast on meta]), with the op lists
    of ``device`` ("cuda", or "cpu": a CPU run's)."""

    def __init__(self, dtype: torch.dtype, device: str = "cuda") -> None:
        super().__init__()
        self.dtype = dtype
        self._cuda = device != "cpu"
        self._low, self._low_aten, self._fp32, self._fp32_aten = _LISTS["cuda" if self._cuda else "cpu"]

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        if func in self._low or packet in self._low_aten:
            args, kwargs = tree_map(lambda x: self._cast(x, _LOW_SOURCES, self.dtype), (args, kwargs))
        elif func in self._fp32 or packet in self._fp32_aten:
            args, kwargs = tree_map(lambda x: self._cast(x, _FP32_SOURCES, torch.float32), (args, kwargs))
        elif func is F.cross_entropy and self._cuda:
            return _cross_entropy(*args, **kwargs)
        elif packet is _KEPT:  # a Function kept whole: its own operations are autocast too
            with modes_inside(self):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _cast(self, x: Any, sources: frozenset[torch.dtype], dtype: torch.dtype) -> Any:
        if not isinstance(x, torch.Tensor) or x.dtype not in sources:
            return x
        return x.to(dtype)


def _cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` as CUDA's autocast runs it ([Note: the loss under autocast]): not on its lists, it
    decomposes into ``log_softmax`` with the input's dtype set (kept: a low-precision result, saved) and
    ``nll_loss`` (on the float32 list: a float32 copy of the log-probabilities, saved too). Soft targets and
    label smoothing reduce the log-probabilities their own way; those are priced with the input cast to float32."""
    low = input.dtype in _FP32_SOURCES
    if not low or size_average is not None or reduce is not None or label_smoothing > 0 or target.is_floating_point():
        if low:
            input, target = input.float(), target.float() if target.dtype in _FP32_SOURCES else target
            weight = weight.float() if weight is not None and weight.dtype in _FP32_SOURCES else weight
        return F.cross_entropy(
            input, target, weight, size_average=size_average, ignore_index=ignore_index, reduce=reduce,
            reduction=reduction, label_smoothing=label_smoothing,
        )  # fmt: skip
    logp = torch.log_softmax(input, 0 if input.dim() == 1 else 1, dtype=input.dtype)
    return F.nll_loss(
        logp.float(), target, None if weight is None else weight.float(), ignore_index=ignore_index,
        reduction=reduction,
    )  # fmt: skip
