"""Per-aten-op accounting of FLOPs, bytes moved, kernel launches and roofline time under a dispatch mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from lightning_autopart.devices import DeviceSpec

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

#: FLOP formulas torch.utils.flop_counter lacks: CPU flash attention (what CPU runs and meta estimates use).
_EXTRA_FLOPS: dict[Any, Any] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape)
    ),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(
            g.shape, q.shape, k.shape, v.shape
        )
    ),
}


def flop_formula(packet: Any) -> Any:
    """The FLOP formula of an op overload packet, or None when it has none."""
    return flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)


@dataclass(slots=True)
class Roofline:
    """Throughputs of one device in per-microsecond units, ready for the per-op roofline."""

    #: Sustained FLOP per microsecond (peak x efficiency).
    flops_per_us: float
    #: Sustained bytes per microsecond (bandwidth x efficiency).
    bytes_per_us: float
    #: Fixed cost of each kernel, microseconds.
    launch_us: float

    @classmethod
    def of(cls, spec: DeviceSpec, dtype: str) -> Roofline:
        """The roofline of ``spec`` for compute in ``dtype``."""
        return cls(
            flops_per_us=spec.peak_flops(dtype) * spec.flops_efficiency / 1e6,
            bytes_per_us=spec.memory_bw * spec.bw_efficiency / 1e6,
            launch_us=spec.launch_us,
        )

    def op_us(self, flops: float, nbytes: float) -> float:
        """Time of one kernel: the slower of compute and memory traffic, plus its launch."""
        return max(flops / self.flops_per_us, nbytes / self.bytes_per_us) + self.launch_us


@dataclass(slots=True)
class PhaseCount:
    """Totals of one phase (forward or backward)."""

    flops: float = 0.0
    nbytes: float = 0.0
    kernels: int = 0
    time_us: float = 0.0


class OpCounter(TorchDispatchMode):
    """Counts every aten op run while :attr:`phase` names a phase ("fwd" or "bwd"); ops outside are free.

    FLOPs come from ``torch.utils.flop_counter``'s registered formulas (plus CPU flash attention). An op
    without a formula that decomposes (a composite op) is counted as one kernel whose FLOPs are those of
    its decomposition, so the op count stays the number of launches. Bytes moved are the sizes of the
    op's tensor arguments plus its outputs. Views and allocations are free: no kernel, no bytes.
    """

    def __init__(self, roofline: Roofline | None = None) -> None:
        super().__init__()
        self.roofline = roofline
        #: The phase being counted, or None to run ops uncounted.
        self.phase: str | None = None
        #: Totals per phase name.
        self.counts: dict[str, PhaseCount] = {"fwd": PhaseCount(), "bwd": PhaseCount()}
        self._depth = 0
        self._pending_flops = 0.0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.phase is None:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        top = self._depth == 0
        if top:
            self._pending_flops = 0.0
        formula = flop_formula(packet)
        out: Any = NotImplemented
        if formula is None and packet not in _NO_KERNEL:
            self._depth += 1
            try:
                with self:
                    out = func.decompose(*args, **kwargs)
            finally:
                self._depth -= 1
        if out is NotImplemented:
            out = func(*args, **kwargs)
            if formula is not None:
                self._pending_flops += float(formula(*args, **kwargs, out_val=out))
        if top:
            self._record(func, packet, (args, kwargs, out))
        return out

    def _record(self, func: Any, packet: Any, tensors: Any) -> None:
        count = self.counts[self.phase or "fwd"]
        flops = self._pending_flops
        count.flops += flops
        if func.is_view or packet in _NO_KERNEL:
            return
        leaves, _ = tree_flatten(tensors)
        nbytes = float(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))
        count.nbytes += nbytes
        count.kernels += 1
        if self.roofline is not None:
            count.time_us += self.roofline.op_us(flops, nbytes)
