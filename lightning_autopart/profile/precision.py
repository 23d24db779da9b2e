"""Precision of a profile: parameter and compute dtypes from a dtype name or a Lightning precision string."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_autopart.capture.graph import TensorInfo
from lightning_autopart.errors import ConfigError

__all__: list[str] = []

#: Names accepted for ``dtype``: plain dtype names and Lightning precision strings, mapped to
#: (parameter dtype, compute dtype). "-mixed" keeps float32 parameters and computes under autocast.
_PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "fp32": (torch.float32, torch.float32),
    "float": (torch.float32, torch.float32),
    "32": (torch.float32, torch.float32),
    "32-true": (torch.float32, torch.float32),
    "float64": (torch.float64, torch.float64),
    "fp64": (torch.float64, torch.float64),
    "double": (torch.float64, torch.float64),
    "64": (torch.float64, torch.float64),
    "64-true": (torch.float64, torch.float64),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "fp16": (torch.float16, torch.float16),
    "half": (torch.float16, torch.float16),
    "16": (torch.float16, torch.float16),
    "16-true": (torch.float16, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}


def known_precisions() -> frozenset[str]:
    """The dtype and precision names :func:`parse_precision` takes."""
    return frozenset(_PRECISIONS)


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Precision:
    """Parameter and compute dtypes of a profile; None keeps each tensor's own dtype."""

    #: Name as given (or derived from the parameters).
    name: str
    #: Dtype floating parameters are cast to, None to keep them.
    param: torch.dtype | None
    #: Dtype floating activations are computed in, None to keep them.
    compute: torch.dtype | None

    @property
    def mixed(self) -> bool:
        """Parameters and compute differ: the forward runs under autocast."""
        return self.param is not None and self.compute is not None and self.param != self.compute

    @property
    def param_name(self) -> str:
        """Parameter dtype name for ``ModelProfile.dtype``."""
        return dtype_name(self.param) if self.param is not None else self.name

    @property
    def compute_name(self) -> str:
        """Compute dtype name, the one that picks the peak FLOP/s of a spec."""
        return dtype_name(self.compute) if self.compute is not None else self.name


def parse_precision(dtype: str | None, module: nn.Module) -> Precision:
    """Resolve ``dtype`` ("bfloat16", "bf16-mixed", ...); None: the dtype of most parameter elements."""
    if dtype is None:
        counts: dict[torch.dtype, int] = {}
        for p in module.parameters():
            if p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        name = dtype_name(max(counts, key=lambda d: counts[d])) if counts else "float32"
        return Precision(name, None, None)
    key = dtype.strip().lower().removeprefix("torch.")
    if key not in _PRECISIONS:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of: {', '.join(sorted(_PRECISIONS))}")
    param, compute = _PRECISIONS[key]
    return Precision(key, param, compute)


def lightning_autocast(device_type: str, dtype: torch.dtype) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The autocast Lightning's mixed precision runs a step under, as a context factory: no cast cache, so each
    use of a weight makes its own copy."""
    return lambda: torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def scaled_nbytes(info: TensorInfo, dtype: torch.dtype | None) -> int:
    """Bytes of a captured tensor once floating tensors are held in ``dtype`` (None: as captured)."""
    captured = getattr(torch, info.dtype, None)
    if dtype is None or not isinstance(captured, torch.dtype) or not captured.is_floating_point:
        return info.nbytes
    return info.nbytes // captured.itemsize * dtype.itemsize
