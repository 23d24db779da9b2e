"""Roofline estimate of one block on a named device spec, from a forward and backward run on meta tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_autopart.capture.graph import Block
from lightning_autopart.devices import DeviceSpec
from lightning_autopart.errors import ConfigError
from lightning_autopart.profile.autocast_meta import MetaAutocast
from lightning_autopart.profile.gemms import Gemm
from lightning_autopart.profile.opcount import OpCounter, OpRecord, Roofline
from lightning_autopart.profile.precision import Precision
from lightning_autopart.profile.records import CostPoint
from lightning_autopart.profile.runner import BlockCost, RunMemory, Runner

__all__: list[str] = []

_META = torch.device("meta")
#: Largest head size flash attention takes on a GPU.
_FLASH_HEAD_SIZE = 256
_SDPA = {
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}


class FusedAttention(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` on meta tensors as one fused (flash) kernel.

    On meta, sdpa would take its math path: a materialised ``T x T`` score matrix, several kernels, and
    that matrix saved for backward. Real devices run a fused kernel that saves only the output and the
    log-sum-exp, so the estimate uses the CPU flash-attention op, which has meta kernels, a derivative
    and (see ``opcount``) FLOP formulas. A boolean mask becomes an additive one first, as sdpa does. Calls a
    GPU runs on the math path pass through: grouped key/value heads in float32 or with a mask, a learned bias
    as the mask; so do calls that are not 4-D. With ``kernels="cpu"`` the CPU's choice is followed instead:
    flash for any mask, and for grouped heads under ``enable_gqa``; the math path with dropout, a learned bias,
    or fewer key/value heads broadcast without ``enable_gqa`` (Falcon's one key/value head: its ranks read
    0.92-0.95 of their measured peaks priced as flash).
    """

    def __init__(self, kernels: str = "cuda") -> None:
        super().__init__()
        self.kernels = kernels

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _SDPA and len(args) >= 3:
            fused = _fused_sdpa(self.kernels, *args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused_sdpa(
    kernels: str,
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
    if not all(isinstance(t, torch.Tensor) and t.is_meta and t.dim() == 4 for t in tensors):
        return None
    if kernels == "cpu" and dropout_p > 0:
        return None  # the CPU's flash kernel takes no dropout
    grouped = not q.shape[1] == k.shape[1] == v.shape[1]
    if grouped and not (enable_gqa if kernels == "cpu" else _flash_groups(q, k, v, attn_mask, enable_gqa)):
        return None  # grouped heads a GPU runs on the math path; a CPU too, unless asked to group them
    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        return (
            None  # a learned bias as the mask (T5's position bias): the fused kernel has no gradient for it
        )
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
        attn_mask = _additive(attn_mask, q.dtype)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


def _flash_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, enable_gqa: bool) -> bool:
    """Whether a GPU runs these grouped key/value heads fused: only flash attention takes them (half
    precision, no mask, head size up to 256); memory-efficient attention does not, so float32 or a mask means
    the math path. The CPU flash op estimate mode calls takes grouped heads as they are: nothing is
    repeated."""
    heads, kv_heads = q.shape[1], k.shape[1]
    grouped = enable_gqa and kv_heads == v.shape[1] and heads % kv_heads == 0
    flash = mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= _FLASH_HEAD_SIZE
    return grouped and flash


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one every sdpa kernel receives: a new tensor in the query's dtype, made
    at each call (so each attention saves its own), as ``scaled_dot_product_attention`` converts it."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), float("-inf"), zero)


def estimate_block(block: Block, precision: Precision, roofline: Roofline) -> BlockCost:
    """Cost of ``block`` under ``roofline`` without real compute or memory.

    A copy of the block runs forward and backward on meta tensors, parameters and floating inputs held in
    the compute dtype (a "-mixed" precision keeps float32 parameters and applies autocast's casts on meta: see [Note: autocast on meta]), attention
    as one fused kernel (:class:`FusedAttention`). Each aten op costs :meth:`Roofline.op_us`: ``max(flops /
    sustained FLOP/s, bytes / sustained bandwidth) + launch_us``, matrix products and convolutions priced by
    their tiles and waves when ``roofline`` was built with ``waves=True`` (see [Note: GEMM waves] in
    opcount.py); the fixed part of a phase is its kernel count times ``launch_us``. Saved-tensor bytes and
    backward's transient peak are metered as in measure mode.
    """
    counter, saved, memory, names, _ = _counted(block, precision, roofline, keep_ops=False)
    fwd, bwd = counter.counts["fwd"], counter.counts["bwd"]
    fixed = (fwd.kernels * roofline.launch_us, bwd.kernels * roofline.launch_us)
    return BlockCost.of(counter, saved, (fwd.time_us, bwd.time_us), fixed, memory, names)


def _counted(
    block: Block, precision: Precision, roofline: Roofline, *, keep_ops: bool
) -> tuple[
    OpCounter,
    tuple[int, int, int],
    RunMemory,
    tuple[frozenset[str], frozenset[str]],
    tuple[tuple[int, ...], int],
]:
    """A counted forward and backward of a meta copy of ``block``, its saved bytes as ``Runner.counted_run``
    returns them, what it held beyond them (``Runner.memory``), the names of what it saved, and the moments of its transient (``Runner.moments``)."""
    if precision.mixed and precision.compute is not None:
        runner = Runner(block, _META, precision)  # float32 weights, autocast's casts (see MetaAutocast)
        runner.context = partial(_mixed, precision.compute, roofline.kernels)
    else:
        runner = Runner(block, _META, Precision(precision.name, precision.compute, precision.compute))
        runner.context = partial(FusedAttention, roofline.kernels)
    counter = OpCounter(roofline, keep_ops=keep_ops)
    try:
        saved = runner.counted_run(counter)
    finally:
        runner.release()  # see [Note: no copy outlives the profiler] in sandbox.py
    return counter, saved, runner.memory(), runner.saved_names, runner.moments


@contextlib.contextmanager
def _mixed(dtype: torch.dtype, kernels: str) -> Iterator[None]:
    """Autocast to ``dtype`` on meta tensors, attention as one fused kernel (casts first, then the kernel), both
    as the ``kernels`` device ("cuda" or "cpu") runs them."""
    with FusedAttention(kernels), MetaAutocast(dtype, kernels):
        yield


def batch_sizes(block_a: Block, block_b: Block) -> tuple[int, int]:
    """The batch sizes two captures of one block were taken at, read from their inputs.

    They are the leading dimensions of the first tensor input whose leading dimension differs between the
    two; a block with no such input (a position embedding) does not depend on the batch, and ``(1, 2)`` is
    returned. Pass the captures' ``batch_size`` instead where a block's first batch-dependent input is not
    batch-major (a flattened ``(batch * seq, d)`` would read as ``batch * seq``).
    """
    leaves_a = [t for t in tree_leaves(block_a.args) if isinstance(t, torch.Tensor) and t.dim() > 0]
    leaves_b = [t for t in tree_leaves(block_b.args) if isinstance(t, torch.Tensor) and t.dim() > 0]
    for x, y in zip(leaves_a, leaves_b, strict=False):
        if x.shape[0] != y.shape[0]:
            return int(x.shape[0]), int(y.shape[0])
    return 1, 2


def _affine(at_a: float, at_b: float, a: int, b: int) -> Callable[[int], float]:
    """The line through ``(a, at_a)`` and ``(b, at_b)``."""
    slope = (at_b - at_a) / (b - a)
    return lambda x: at_a + slope * (x - a)


def _affine_int(at_a: int, at_b: int, a: int, b: int) -> Callable[[int], int]:
    """The same for integers (exact while the quantity is affine in whole samples), never below 0."""
    return lambda x: max(0, round((at_a * (b - x) + at_b * (x - a)) / (b - a)))


def _peak_line(
    moments_a: tuple[tuple[int, ...], int], moments_b: tuple[tuple[int, ...], int], a: int, b: int
) -> Callable[[int], int] | None:
    """The transient at any batch from two runs' moments (``Runner.moments``) at batches ``a`` and ``b``: the
    largest of each moment's line ([Note: a peak's moments] in transient.py); None where the runs' operations do
    not pair one to one."""
    (xs, inputs_a), (ys, inputs_b) = moments_a, moments_b
    if not xs or len(xs) != len(ys):
        return None
    pairs = set(zip(xs, ys, strict=True))
    inputs = _affine_int(inputs_a, inputs_b, a, b)

    def at(n: int) -> int:
        top = max(round((x * (b - n) + y * (n - a)) / (b - a)) for x, y in pairs)
        return max(0, top) + inputs(n)

    return at


def _same_graph(ops_a: list[OpRecord], ops_b: list[OpRecord]) -> bool:
    """Whether two counted runs ran the same kernels in the same order (so they pair one to one)."""
    return len(ops_a) == len(ops_b) and all(
        x.phase == y.phase and x.op == y.op and [g.kind for g in x.gemms] == [g.kind for g in y.gemms]
        for x, y in zip(ops_a, ops_b, strict=True)
    )


def _op_time(x: OpRecord, y: OpRecord, a: int, b: int, roofline: Roofline) -> Callable[[int], float]:
    """The time of one kernel at any batch, from the same kernel at batches ``a`` and ``b``."""
    flops = _affine(x.flops, y.flops, a, b)
    nbytes = _affine(x.nbytes, y.nbytes, a, b)
    dims = [
        [_affine_int(p, q, a, b) for p, q in ((g.batch, h.batch), (g.m, h.m), (g.n, h.n), (g.k, h.k))]
        for g, h in zip(x.gemms, y.gemms, strict=True)
    ]
    kinds = [g.kind for g in x.gemms]

    def at(n: int) -> float:
        gemms = tuple(Gemm(kind, *(d(n) for d in dim)) for kind, dim in zip(kinds, dims, strict=True))
        return roofline.op_us(max(0.0, flops(n)), max(0.0, nbytes(n)), gemms)

    return at


def _total(kernels: list[Callable[[int], float]]) -> Callable[[int], float]:
    return lambda n: sum(k(n) for k in kernels)


def _at_least(floor: float, line: Callable[[int], float]) -> Callable[[int], float]:
    return lambda n: max(floor, line(n))


def estimate_curve(
    block_a: Block,
    block_b: Block,
    precision: Precision,
    spec: DeviceSpec | Roofline,
    sizes: Iterable[int],
    *,
    samples: tuple[int, int] | None = None,
    cut_bytes: tuple[int, int] = (0, 0),
    transient_bytes: tuple[int, int] | None = None,
) -> list[CostPoint]:
    """The cost curve of one block (see [Note: cost curves] in records.py) at every batch size in ``sizes``.

    torch.export bakes the batch into a captured graph, so a block runs only at the batch it was captured
    at. ``block_a`` and ``block_b`` are the same block captured at ``a < b`` samples; both run forward and
    backward on meta tensors under an :class:`OpCounter` (as :func:`estimate_block` runs them), and their
    kernels pair one to one. A kernel's FLOPs, its bytes and the dimensions of its matrix products are affine
    in the batch (the batch-proportional dimension: ``M`` of a forward product, ``K`` of a weight gradient,
    the positions of a convolution), so the lines through their values at ``a`` and ``b`` give them at any
    batch, and :meth:`Roofline.op_us` prices the kernel there as exactly as a capture at that batch would: no
    interpolation of times, so memory-bound kernels turning compute-bound and the waves of [Note: GEMM
    waves] are where they fall. A quantity that is not affine in the batch (a block multiplying the batch
    with itself) is not caught by two points and comes out wrong.

    When the two runs do not run the same kernels (a block that takes another path at another batch), the
    pairing is impossible: the forward and backward times then follow the line through the two runs' total
    times, kept at or above their launch costs.

    Args:
        block_a: The block captured at ``a`` samples.
        block_b: The same block captured at ``b > a`` samples.
        precision: Parameter and compute dtypes, as for :func:`estimate_block`.
        spec: The device: a spec (priced by ``Roofline.of(spec, precision.compute_name, waves=True)``, TF32 as
            torch is set now) or a ready :class:`Roofline`.
        sizes: Batch sizes (samples, at least 1) to put points at; the caller passes powers of two up to the
            largest micro-batch and that micro-batch.

    Keyword Args:
        samples: ``(a, b)``, the captures' batch sizes (recommended); default: read from the blocks'
            inputs by :func:`batch_sizes`.
        cut_bytes: Bytes crossing the cut after the block at ``a`` and at ``b`` (the captured model's
            ``cuts[index]``, which a block alone does not know); the curve's ``cut_bytes`` is their line.
        transient_bytes: Backward's transient peak at ``a`` and at ``b``, whose line the curve follows; default:
            the largest of the lines of the two runs' moments, what is alive after each of their paired
            operations ([Note: a peak's moments] in transient.py; the line of their peaks where the runs do
            not pair).

    Returns:
        ``(samples, fwd_us, bwd_us, activation_bytes, transient_bytes, cut_bytes)`` per size, ascending and
        without repeats. Activation bytes (the tensors saved for backward) are the line through the two runs'.

    Raises:
        ConfigError: ``a >= b``, or a size below 1.
    """
    a, b = samples if samples is not None else batch_sizes(block_a, block_b)
    if not 0 < a < b:
        raise ConfigError(f"a cost curve needs two captures at batch sizes 0 < a < b, got a={a}, b={b}")
    points = sorted(set(sizes))
    if points and points[0] < 1:
        raise ConfigError(f"cost curve sizes must be at least 1 sample, got {points[0]}")
    roofline = spec if isinstance(spec, Roofline) else Roofline.of(spec, precision.compute_name, waves=True)
    run_a, saved_a, memory_a, _, moments_a = _counted(block_a, precision, roofline, keep_ops=True)
    run_b, saved_b, memory_b, _, moments_b = _counted(block_b, precision, roofline, keep_ops=True)
    activation = _affine_int(saved_a[0], saved_b[0], a, b)
    cut = _affine_int(cut_bytes[0], cut_bytes[1], a, b)
    transient = _affine_int(*(transient_bytes or (memory_a.transient, memory_b.transient)), a, b)
    if transient_bytes is None:  # the largest of the moments' lines: [Note: a peak's moments] in transient.py
        transient = _peak_line(moments_a, moments_b, a, b) or transient

    phase_time: dict[str, Callable[[int], float]] = {}
    if _same_graph(run_a.ops, run_b.ops):
        for phase in ("fwd", "bwd"):
            kernels = [
                _op_time(x, y, a, b, roofline)
                for x, y in zip(run_a.ops, run_b.ops, strict=True)
                if x.phase == phase
            ]
            phase_time[phase] = _total(kernels)
    else:
        for phase in ("fwd", "bwd"):
            ca, cb = run_a.counts[phase], run_b.counts[phase]
            line = _affine(ca.time_us, cb.time_us, a, b)
            floor = min(ca.kernels, cb.kernels) * roofline.launch_us
            phase_time[phase] = _at_least(floor, line)
    return [
        (n, phase_time["fwd"](n), phase_time["bwd"](n), activation(n), transient(n), cut(n)) for n in points
    ]
