"""Named device specs: the numbers a roofline estimate and a dry-run cluster need, for hardware we may not have.

Figures are vendors' published dense peaks and typical fabric bandwidths of DGX/HGX-class nodes; the
``*_efficiency`` fields turn peaks into what real kernels reach. The "cpu" spec is a placeholder that
:func:`lightning_autopart.profile.calibrate_cpu` replaces with numbers probed on this machine.

Compute peaks, dense (NVIDIA's sheets print the tensor-core figures "with sparsity", twice these):

============  ====  ======  ==========  ===========  ================================================
spec          SMs   FP32    TF32 tensor BF16/FP16    source
============  ====  ======  ==========  ===========  ================================================
v100-32gb      80   15.7 T  (none)      125 T        Tesla V100 SXM2 datasheet; Volta has no TF32
a100-40/80gb  108   19.5 T  156 T       312 T        NVIDIA A100 datasheet (SXM4; 312* / 624* sparse)
h100-80gb     132   67 T    494.7 T     989 T        H100 Tensor Core GPU whitepaper, SXM5: 66.9/494.7/989.4
h200-141gb    132   67 T    494.7 T     989 T        H200 SXM datasheet (67 / 989* / 1979* with sparsity)
============  ====  ======  ==========  ===========  ================================================

FP32 is the plain (non-tensor-core, "no TF32") FMA rate; the SM counts are those of the SXM parts (V100 80,
A100 108, H100/H200 132). Which peak an operation gets is :meth:`DeviceSpec.matmul_flops`: float32 matrix
products run on TF32 tensor cores only where torch allows it (:func:`tf32_matmuls`, :func:`tf32_convolutions`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_autopart.errors import ConfigError

__all__ = [
    "DeviceSpec", "device_spec", "device_spec_names", "register_spec", "tf32_convolutions", "tf32_matmuls"
]

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Peak compute, memory and links of one accelerator model in a typical multi-device node."""

    #: Spec name, lower case ("a100-40gb").
    name: str
    #: Device memory in bytes.
    memory_bytes: int
    #: Dense peak FLOP/s for float32 math (no TF32).
    fp32_flops: float
    #: Dense peak FLOP/s for bfloat16/float16 tensor-core math.
    bf16_flops: float
    #: Device memory bandwidth in bytes/s.
    memory_bw: float
    #: Point-to-point bandwidth between two devices of one node, bytes/s, one direction.
    intra_node_bw: float
    #: Point-to-point bandwidth between devices on different nodes, bytes/s, one direction, per device.
    inter_node_bw: float
    #: All-reduce bus bandwidth inside a node (NCCL-tests "busbw"), bytes/s.
    intra_allreduce_bw: float
    #: All-reduce bus bandwidth across nodes, bytes/s.
    inter_allreduce_bw: float
    #: Latency of one message, microseconds.
    latency_us: float
    #: Fixed cost of one kernel launch, microseconds.
    launch_us: float
    #: Fraction of peak FLOP/s that large matrix products reach.
    flops_efficiency: float = 0.6
    #: Fraction of peak memory bandwidth that memory-bound kernels reach.
    bw_efficiency: float = 0.7
    #: Devices in one node of the typical system.
    devices_per_node: int = 8
    #: Streaming multiprocessors: the units a matrix product's output tiles are spread over in waves. The
    #: "cpu" spec has 1: its calibrated rate is that of a whole (multi-threaded) matmul, so no wave model.
    sm_count: int = 1
    #: Dense peak FLOP/s of float32 matrix products on TF32 tensor cores; 0 where there are none (V100, CPU).
    tf32_flops: float = 0.0
    #: Host time of one pipeline action (a stage's forward or backward of one micro-batch) beyond its math:
    #: the schedule's bookkeeping, autograd's entry, posting and completing the action's sends and receives
    #: (an estimate for GPU hosts; the CPU probe measures it, see [Note: host overhead] in partition/cost.py).
    action_us: float = 100.0
    #: Host time of one training step outside the pipeline: the loss's broadcast and the stop check (priced
    #: only where the host does the math, ``async_host=False``).
    step_us: float = 300.0
    #: Whether the host runs ahead of the device (queued kernels), so host time hides behind device time;
    #: False where the host does the math itself (CPU): host and math then add up.
    async_host: bool = True

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a parameter/compute dtype name ("float32", "bfloat16", "float16")."""
        return self.fp32_flops if _is_fp32(dtype) else self.bf16_flops

    def tensor_cores(self, dtype: str, tf32: bool | None = None) -> bool:
        """Whether a matrix product in ``dtype`` runs on tensor cores: 16-bit always (where the device has
        them), float32 only with TF32 allowed (``tf32``; None: :func:`tf32_matmuls`) and present."""
        if _is_fp32(dtype):
            allowed = tf32_matmuls() if tf32 is None else tf32
            return allowed and dtype in _FLOAT32 and self.tf32_flops > 0
        return self.bf16_flops > self.fp32_flops

    def matmul_flops(self, dtype: str, tf32: bool | None = None) -> float:
        """Dense peak FLOP/s of a matrix product's math in ``dtype``.

        bfloat16/float16: the tensor-core peak. float32: the TF32 tensor-core peak when TF32 is allowed
        (``tf32``; None: as torch is set now for matmuls, :func:`tf32_matmuls`; pass
        :func:`tf32_convolutions` for a convolution) and the device has TF32, else the plain FP32 peak.
        float64 is priced as float32 without TF32, as :meth:`peak_flops` does.
        """
        if _is_fp32(dtype):
            return self.tf32_flops if self.tensor_cores(dtype, tf32) else self.fp32_flops
        return self.bf16_flops


_FLOAT32 = ("float32", "32", "32-true", "fp32", "float")


def _is_fp32(dtype: str) -> bool:
    return dtype in (*_FLOAT32, "float64", "64", "64-true", "fp64", "double")


def tf32_matmuls() -> bool:
    """Whether torch lets float32 matrix products (mm, addmm, bmm, ...) use TF32 tensor cores.

    ``torch.get_float32_matmul_precision()`` "high" or "medium" (what ``torch.backends.cuda.matmul.allow_tf32 =
    True`` also sets) allows it; the default "highest" does not.
    """
    import torch

    return torch.get_float32_matmul_precision() in ("high", "medium")


def tf32_convolutions() -> bool:
    """Whether torch lets float32 convolutions use TF32 tensor cores: ``torch.backends.cudnn.allow_tf32``.

    Unlike matmuls this defaults to True, so a float32 ResNet on an A100/H100 runs its convolutions in TF32
    unless the user turns it off.
    """
    import torch

    return bool(torch.backends.cudnn.allow_tf32)


_SPECS: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        DeviceSpec(
            "v100-32gb", 32 * _GIB, 15.7e12, 125e12, 900e9, 130e9, 12.5e9, 130e9, 12.5e9, 10.0, 5.0, sm_count=80
        ),
        DeviceSpec(
            "a100-40gb", 40 * _GIB, 19.5e12, 312e12, 1555e9, 235e9, 25e9, 230e9, 25e9, 8.0, 4.0,
            sm_count=108, tf32_flops=156e12,
        ),
        DeviceSpec(
            "a100-80gb", 80 * _GIB, 19.5e12, 312e12, 2039e9, 235e9, 25e9, 230e9, 25e9, 8.0, 4.0,
            sm_count=108, tf32_flops=156e12,
        ),
        DeviceSpec(
            "h100-80gb", 80 * _GIB, 67e12, 989e12, 3350e9, 360e9, 50e9, 360e9, 50e9, 6.0, 3.0,
            sm_count=132, tf32_flops=494.7e12,
        ),
        DeviceSpec(
            "h200-141gb", 141 * _GIB, 67e12, 989e12, 4800e9, 360e9, 50e9, 360e9, 50e9, 6.0, 3.0,
            sm_count=132, tf32_flops=494.7e12,
        ),
        # Placeholder figures for one CPU process with one thread talking gloo over loopback; calibrate_cpu()
        # replaces compute and memory bandwidth with measured values. One "SM" and no TF32: a matrix product
        # costs its FLOPs at the calibrated matmul rate, no tiles or waves.
        DeviceSpec(
            "cpu",
            16 * _GIB,
            50e9,
            50e9,
            10e9,
            1e9,
            1e9,
            1e9,
            1e9,
            100.0,
            10.0,
            flops_efficiency=1.0,
            bw_efficiency=1.0,
            devices_per_node=2,
            async_host=False,
        ),
    )
}

_ALIASES = {
    "v100": "v100-32gb",
    "a100": "a100-40gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "h200-140gb": "h200-141gb",
}


def device_spec_names() -> list[str]:
    """Names accepted by :func:`device_spec`."""
    return sorted(_SPECS)


def device_spec(name: str, **overrides: float | int) -> DeviceSpec:
    """Look up a device spec by name (case-insensitive; "a100" means "a100-40gb"), optionally overriding fields."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in _SPECS:
        raise ConfigError(
            f"unknown device spec {name!r}; known specs: {', '.join(device_spec_names())}; use the closest "
            "known spec and give the memory per device (CLI: --device-spec h200-141gb --device-memory 192GB; "
            "Python: device_spec('h200-141gb', memory_bytes=...))"
        )
    spec = _SPECS[key]
    return replace(spec, **overrides) if overrides else spec  # type: ignore[arg-type]


def register_spec(spec: DeviceSpec) -> None:
    """Make ``spec`` known to :func:`device_spec` under its name in this process (a spec derived from the local
    device, see [Note: derived device specs] in ``profile/cuda_spec.py``).

    Raises:
        ConfigError: the name is a built-in spec's with other figures.
    """
    known = _SPECS.get(spec.name)
    if known is not None and known != spec:
        raise ConfigError(f"device spec {spec.name!r} exists with other figures; give the new one another name")
    _SPECS[spec.name] = spec
