"""Per-aten-op accounting of FLOPs, bytes moved, kernel launches and roofline time under a dispatch mode.

[Note: GEMM waves] A GPU runs a matrix product as a grid of output tiles, each tile computed by one streaming
multiprocessor (SM) over the whole reduction dimension K; tiles are handed to the SMs in waves, and a wave
takes as long as one tile, however few SMs it occupies. So a product of ``B`` independent ``(M x K) @ (K x N)``
matrices (``mm``/``addmm``: B = 1; ``bmm``/``baddbmm``: the batch; a convolution: its groups, see
:func:`conv_gemms`) on a device of ``S`` SMs with output tile ``tm x tn`` costs::

    tiles   = B * ceil(M / tm) * ceil(N / tn)             (the cheaper of the tile's two orientations)
    split   = min(S // tiles, ceil(K / 256)) if tiles < S else 1      (split-K fills an idle device)
    waves   = ceil(tiles * split / S)
    tile_us = 2 * min(tm, M) * min(tn, N) * ceil(K / split) / (peak / S * efficiency)
    bytes   = operands + output (+ 2 * split * B * M * N * 4 of float32 partial sums when split > 1)
    time    = max(waves * tile_us, bytes / (bandwidth * bw_efficiency)) + launch_us

``peak`` is the device's dense peak for the product's math (:meth:`DeviceSpec.matmul_flops`: bf16/fp16 tensor
cores, TF32 tensor cores for float32 where torch allows it, else the plain FP32 units) and ``efficiency`` is
``DeviceSpec.flops_efficiency``: the fraction of its peak one SM reaches while it works on a tile. On tensor
cores the tile is CUTLASS's default threadblock shape, 128 x 256 (``DefaultGemmConfiguration<OpClassTensorOp,
Sm80>``: 128x256x64). On the float32 FMA units the library has kernels of many tiles (cuBLAS's sm80 ``ffma``
kernels of 128x128, 128x64, 128x32, 64x128, CUTLASS's ``simt_sgemm`` of 256x128) and picks one that wastes
little of the last wave, so the plan is the fastest over :data:`SIMT_TILES`: an H100 ran ``(512 x 5000) @
(5000 x 5000)`` with its 128x32 kernel, 5 waves 95 % full, where 128 x 128 tiles fill 61 % of 2 waves. An FMA
unit needs about 7x fewer operand bytes per second than a tensor core, so small SIMT tiles stay fed. A tile is
never wider than the matrix (a 2-row product does 2-row tiles, as cuBLAS's small kernels do). When the output
has fewer tiles than there are SMs, the library splits K (split-K) into slices of at least 256 so that more SMs
work; the slices' partial sums cost memory traffic. Products of a wave or more are not split: this is the
classic split-K heuristic, and where a library balances the last wave instead (stream-K, persistent kernels),
the estimate of such a product is pessimistic by at most one wave.

Tensor-core kernels load each operand in 16-byte vectors, so every dimension must be a multiple of 8 elements
(16-bit) or 4 (TF32). A product off that (GPT-2's vocabulary of 50257) runs on kernels that load one element at
a time (cuBLAS's ``align1``), bound by those loads: it is priced at the peak over the vector width (989 / 8 =
124 TFLOP/s in bfloat16 on an H100, which ran GPT-2's LM head at 95-148).

Examples (H100, 132 SMs, float32 without TF32): ``(8192 x 768) @ (768 x 2304)`` in 128 x 128 tiles is
64 x 18 = 1152 tiles, 9 waves, 97 % of the slots used. Every other op keeps the plain roofline ``max(flops / (peak x flops_efficiency),
bytes / (bandwidth x bw_efficiency)) + launch_us`` at :meth:`DeviceSpec.peak_flops`; so do the attention
kernels (flash/memory-efficient attention are not one GEMM: they fuse two products and a softmax per tile,
and their FLOP formula is the whole story we know). A spec with one SM (the "cpu" spec), or a
:class:`Roofline` built with ``waves=False``, prices a product at its FLOPs over the sustained rate: no tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from lightning_autopart.capture.kept_functions import run_whole
from lightning_autopart.devices import DeviceSpec, tf32_convolutions, tf32_matmuls
from lightning_autopart.profile.gemms import CONVOLUTIONS, GROUPED, Gemm, gemms_of, relayout_bytes
from lightning_autopart.profile.norm_passes import reread_bytes

__all__: list[str] = []

_aten = torch.ops.aten

#: Ops that allocate or re-describe memory without running a kernel (views are recognised by their schema).
_NO_KERNEL = {
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten._unsafe_view,
    _aten.lift_fresh,
    torch.ops.prim.device,
}

#: Namespaces of torch's own ops: an op of any other (a library's custom op) with no FLOP formula and no
#: decomposition may hide math the counter cannot see (see :attr:`OpCounter.opaque`).
_OWN_NAMESPACES = frozenset({"aten", "prim", "prims"})

def _heads(shape: Any, heads: int) -> tuple[int, ...]:
    """A key or value shape ``(b, h, s, d)`` with the query's ``heads``: grouped key/value heads cost what
    repeated ones do, and torch before 2.13 counts only equal heads."""
    return (shape[0], heads, *shape[2:])


#: FLOP formulas torch.utils.flop_counter lacks: CPU flash attention (what CPU runs and meta estimates use).
_EXTRA_FLOPS: dict[Any, Any] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(
            q.shape, _heads(k.shape, q.shape[1]), _heads(v.shape, q.shape[1])
        )
    ),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(
            g.shape, q.shape, _heads(k.shape, q.shape[1]), _heads(v.shape, q.shape[1])
        )
    ),
}

#: Output tile (rows x columns) of one SM's share of a product on tensor cores.
TENSOR_CORE_TILE = (128, 256)
#: Output tiles of the float32 FMA-unit (SIMT) kernels cuBLAS chooses among (sm80 ``ffma`` kernels and
#: CUTLASS's ``simt_sgemm``), either orientation; see [Note: GEMM waves].
SIMT_TILES = ((256, 128), (128, 128), (128, 64), (128, 32), (64, 64))
SIMT_TILE = SIMT_TILES[1]
#: Bytes of one vector load: tensor-core kernels need every operand's rows aligned to it.
VECTOR_BYTES = 16
#: Smallest slice of K that split-K hands one SM.
SPLIT_K_MIN = 256
#: Bytes of one split-K partial sum (accumulated in float32).
_PARTIAL_BYTES = 4


#: AccumulateGrad's in-place add into an existing gradient.
_ACCUMULATE = _aten.add_.Tensor

#: Fused attention kernels a GPU runs, each with the position of its query (the key and value follow it).
_GPU_ATTENTION = {
    _aten._scaled_dot_product_flash_attention: 0,
    _aten._scaled_dot_product_efficient_attention: 0,
    _aten._scaled_dot_product_cudnn_attention: 0,
    _aten._scaled_dot_product_flash_attention_backward: 1,
    _aten._scaled_dot_product_efficient_attention_backward: 1,
    _aten._scaled_dot_product_cudnn_attention_backward: 1,
}


def flop_formula(packet: Any) -> Any:
    """The FLOP formula of an op overload packet, or None when it has none."""
    formula = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
    if formula is None and str(packet) in GROUPED:
        return functools.partial(_grouped_flops, packet)
    if formula is not None and packet in _GPU_ATTENTION:
        return functools.partial(_grouped_attention, formula, _GPU_ATTENTION[packet])
    return formula


def _grouped_attention(formula: Any, q_at: int, *args: Any, **kwargs: Any) -> Any:
    """``formula`` of a fused attention whose key and value may have fewer heads than its query
    (``enable_gqa``, [Note: grouped heads]): they are counted as repeated, as torch 2.13's formulas count them
    and torch 2.11's refuse them."""
    q, k, v = args[q_at : q_at + 3]
    grouped = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4
    if grouped and k.shape[1] != q.shape[1]:
        heads = q.shape[1]
        wide = [torch.empty(_heads(t.shape, heads), dtype=t.dtype, device="meta") for t in (k, v)]
        args = (*args[: q_at + 1], *wide, *args[q_at + 3 :])
    return formula(*args, **kwargs)


def _grouped_flops(packet: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> float:
    """FLOPs of a grouped product: those of its products (:data:`~.gemms.GROUPED`)."""
    return sum(g.flops for g in gemms_of(packet, args, kwargs, out_val))


@dataclass(frozen=True, slots=True)
class GemmRate:
    """How one kind of matrix product runs on a device (see [Note: GEMM waves])."""

    #: Sustained FLOP per microsecond of the whole device (peak x efficiency).
    flops_per_us: float
    #: Streaming multiprocessors; 1 means no wave model (a product costs its FLOPs at ``flops_per_us``).
    sm_count: int = 1
    #: Output tile of one SM, rows x columns (either orientation is used, whichever needs fewer tiles).
    tile: tuple[int, int] = SIMT_TILE
    #: Other tiles the library may choose instead (the fastest plan of all is taken).
    more_tiles: tuple[tuple[int, int], ...] = ()
    #: Elements per vector load that every dimension must be a multiple of (tensor cores: 16 bytes); a product
    #: off it runs at :attr:`misaligned_flops_per_us`. 1: no such rule.
    align: int = 1
    #: FLOP per microsecond of a misaligned product: the peak over ``align`` (one element per load).
    misaligned_flops_per_us: float = 0.0

    def waves(self, gemm: Gemm) -> tuple[int, int, int]:
        """``(tiles, split, waves)`` of ``gemm``: output tiles, K slices per tile, and waves over the SMs."""
        return self._plan(gemm)[1:]

    def compute_us(self, gemm: Gemm) -> tuple[float, float]:
        """Compute time of ``gemm`` in microseconds, and the extra bytes its split-K partial sums move."""
        if min(gemm.batch, gemm.m, gemm.n, gemm.k) <= 0:
            return 0.0, 0.0
        if self.sm_count <= 1:
            return gemm.flops / self.flops_per_us, 0.0
        time_us, _, split, _ = self._plan(gemm)
        extra = 2.0 * split * gemm.batch * gemm.m * gemm.n * _PARTIAL_BYTES if split > 1 else 0.0
        if self.misaligned(gemm):
            time_us = max(time_us, gemm.flops / self.misaligned_flops_per_us)
        return time_us, extra

    def misaligned(self, gemm: Gemm) -> bool:
        """Whether ``gemm`` has a dimension off the vector width, so it runs one element per load."""
        a = self.align
        return a > 1 and self.misaligned_flops_per_us > 0 and any(d % a for d in (gemm.m, gemm.n, gemm.k))

    def _plan(self, gemm: Gemm) -> tuple[float, int, int, int]:
        sms = max(1, self.sm_count)
        per_sm = self.flops_per_us / sms
        best: tuple[float, int, int, int] | None = None
        shapes = {t for tile in (self.tile, *self.more_tiles) for t in (tile, tile[::-1])}
        for tm, tn in sorted(shapes):
            tiles = gemm.batch * -(-gemm.m // tm) * -(-gemm.n // tn)
            split = 1
            if 0 < tiles < sms:
                split = max(1, min(sms // tiles, -(-gemm.k // SPLIT_K_MIN)))
            waves = -(-tiles * split // sms)
            tile_flops = 2.0 * min(tm, gemm.m) * min(tn, gemm.n) * -(-gemm.k // split)
            plan = (waves * tile_flops / per_sm, tiles, split, waves)
            if best is None or plan < best:
                best = plan
        assert best is not None
        return best


@dataclass(slots=True)
class Roofline:
    """Throughputs of one device in per-microsecond units, ready for the per-op roofline."""

    #: Sustained FLOP per microsecond (peak x efficiency) of ops other than matrix products.
    flops_per_us: float
    #: Sustained bytes per microsecond (bandwidth x efficiency).
    bytes_per_us: float
    #: Fixed cost of each kernel, microseconds.
    launch_us: float
    #: How ``mm``/``addmm``/``bmm``/``baddbmm`` run; None: at ``flops_per_us``, no tiles.
    matmul: GemmRate | None = None
    #: How convolutions run; None: at ``flops_per_us``, no tiles.
    conv: GemmRate | None = None
    #: Whose kernels the estimate prices, "cuda" or "cpu" (the "cpu" spec): attention's (``FusedAttention``) and
    #: autocast's op lists (``MetaAutocast``).
    kernels: str = "cuda"

    @classmethod
    def of(
        cls,
        spec: DeviceSpec,
        dtype: str,
        *,
        waves: bool = False,
        tf32: bool | None = None,
        conv_tf32: bool | None = None,
    ) -> Roofline:
        """The roofline of ``spec`` for compute in ``dtype``.

        Args:
            spec: The device.
            dtype: Compute dtype name ("float32", "bfloat16", ...).
            waves: Price matrix products by output tiles and waves over ``spec.sm_count`` SMs (see
                [Note: GEMM waves]); False prices them at their FLOPs, as any other op.
            tf32: Whether float32 matmuls use TF32 tensor cores; None: as torch is set now (:func:`tf32_matmuls`).
            conv_tf32: The same for convolutions; None: :func:`tf32_convolutions` (cuDNN's default is True).
        """
        tf32 = tf32_matmuls() if tf32 is None else tf32
        conv_tf32 = tf32_convolutions() if conv_tf32 is None else conv_tf32
        sms = spec.sm_count if waves else 1

        def rate(allow_tf32: bool) -> GemmRate:
            peak = spec.matmul_flops(dtype, allow_tf32) / 1e6
            if not spec.tensor_cores(dtype, allow_tf32):
                return GemmRate(peak * spec.flops_efficiency, sms, SIMT_TILE, SIMT_TILES)
            align = VECTOR_BYTES // _element_bytes(dtype) if sms > 1 else 1
            return GemmRate(peak * spec.flops_efficiency, sms, TENSOR_CORE_TILE, (), align, peak / align)

        return cls(
            flops_per_us=spec.peak_flops(dtype) * spec.flops_efficiency / 1e6,
            bytes_per_us=spec.memory_bw * spec.bw_efficiency / 1e6,
            launch_us=spec.launch_us,
            matmul=rate(tf32),
            conv=rate(conv_tf32),
            kernels="cpu" if spec.name == "cpu" else "cuda",
        )

    def gemm_us(self, gemm: Gemm) -> tuple[float, float]:
        """Compute time of one matrix product and the extra bytes it moves (split-K partial sums)."""
        rate = self.conv if gemm.kind == "conv" else self.matmul
        if rate is None:
            return gemm.flops / self.flops_per_us, 0.0
        return rate.compute_us(gemm)

    def op_us(self, flops: float, nbytes: float, gemms: tuple[Gemm, ...] = ()) -> float:
        """Time of one kernel: the slower of compute and memory traffic, plus its launch.

        An op with ``gemms`` (a matrix product or convolution) computes for the time of its products as
        [Note: GEMM waves] prices them, whatever ``flops`` says; any other op for ``flops`` at the plain rate.
        """
        if not gemms:
            return max(flops / self.flops_per_us, nbytes / self.bytes_per_us) + self.launch_us
        compute = extra = 0.0
        for gemm in gemms:
            us, more = self.gemm_us(gemm)
            compute += us
            extra += more
        return max(compute, (nbytes + extra) / self.bytes_per_us) + self.launch_us


def _element_bytes(dtype: str) -> int:
    """Bytes of one element of a compute dtype name (float32 for names torch does not know)."""
    found = getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else 4


@dataclass(slots=True)
class PhaseCount:
    """Totals of one phase (forward or backward)."""

    flops: float = 0.0
    nbytes: float = 0.0
    kernels: int = 0
    time_us: float = 0.0


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One kernel the counter saw: what :meth:`Roofline.op_us` needs to price it at any size."""

    #: "fwd" or "bwd".
    phase: str
    #: The aten overload ("aten.mm.default").
    op: str
    flops: float
    nbytes: float
    #: Its matrix products (empty for other ops).
    gemms: tuple[Gemm, ...]


class OpCounter(TorchDispatchMode):
    """Counts every aten op run while :attr:`phase` names a phase ("fwd" or "bwd"); ops outside are free.

    FLOPs come from ``torch.utils.flop_counter``'s registered formulas (plus CPU flash attention). An op
    without a formula that decomposes (a composite op) is counted as one kernel whose FLOPs are those of
    its decomposition, so the op count stays the number of launches. Bytes moved are the sizes of the
    op's tensor arguments plus its outputs, and what a normalization reads twice (see
    [Note: normalization passes]). Views and allocations are free: no kernel, no bytes. Matrix products
    and convolutions also record their GEMM shapes (see [Note: GEMM waves]); with ``keep_ops`` every kernel
    is kept in :attr:`ops`.
    """

    def __init__(self, roofline: Roofline | None = None, *, keep_ops: bool = False) -> None:
        super().__init__()
        self.roofline = roofline
        #: The phase being counted, or None to run ops uncounted.
        self.phase: str | None = None
        #: Totals per phase name.
        self.counts: dict[str, PhaseCount] = {"fwd": PhaseCount(), "bwd": PhaseCount()}
        #: Every counted kernel in order, when ``keep_ops``.
        self.ops: list[OpRecord] = []
        self._keep_ops = keep_ops
        self._depth = 0
        self._pending_flops = 0.0
        self._pending_gemms: list[Gemm] = []
        #: Other libraries' ops (custom ops) with no FLOP formula that ran whole: priced by their bytes alone.
        self.opaque: set[str] = set()
        #: Ids of gradients the run's backward adds into: those adds are a later micro-batch's, run uncounted
        #: (see [Note: gradient accumulation] in step.py).
        self.accumulators: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.phase is None or (func is _ACCUMULATE and id(args[0]) in self.accumulators):
            return func(*args, **kwargs)
        packet = func._overloadpacket
        top = self._depth == 0
        if top:
            self._pending_flops = 0.0
            self._pending_gemms = []
        formula = flop_formula(packet)
        out: Any = NotImplemented
        if formula is None and packet not in _NO_KERNEL:
            # a kept autograd Function's math is its forward's operations ([Note: Functions kept whole])
            expand = run_whole if packet is torch.ops.autopart.function_call else func.decompose
            self._depth += 1
            try:
                with self:
                    out = expand(*args, **kwargs)
            finally:
                self._depth -= 1
        if out is NotImplemented:
            out = func(*args, **kwargs)
            if formula is not None:
                self._pending_flops += float(formula(*args, **kwargs, out_val=out))
            elif func.namespace not in _OWN_NAMESPACES and packet not in _NO_KERNEL:
                self.opaque.add(str(packet))
            self._pending_gemms.extend(gemms_of(packet, args, kwargs, out))
        if top:
            self._record(func, packet, (args, kwargs, out))
        return out

    def _record(self, func: Any, packet: Any, tensors: Any) -> None:
        phase = self.phase or "fwd"
        count = self.counts[phase]
        flops = self._pending_flops
        count.flops += flops
        if func.is_view or packet in _NO_KERNEL:
            return
        leaves, _ = tree_flatten(tensors)
        nbytes = float(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))
        gemms = tuple(self._pending_gemms)
        conv = self.roofline.conv if self.roofline is not None else None
        if conv is not None and conv.align > 1 and packet in CONVOLUTIONS:
            nbytes += relayout_bytes(packet, *tensors)
        nbytes += reread_bytes(func, *tensors[:2])  # [Note: normalization passes]
        count.nbytes += nbytes
        count.kernels += 1
        if self.roofline is not None:
            count.time_us += self.roofline.op_us(flops, nbytes, gemms)
        if self._keep_ops:
            self.ops.append(OpRecord(phase, str(func), flops, nbytes, gemms))
