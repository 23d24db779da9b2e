"""Named device specs: the numbers a roofline estimate and a dry-run cluster need, for hardware we may not have.

Figures are vendors' published dense peaks and typical fabric bandwidths of DGX/HGX-class nodes; the
``*_efficiency`` fields turn peaks into what real kernels reach. The "cpu" spec is a placeholder that
:func:`lightning_autopart.profile.calibrate_cpu` replaces with numbers probed on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_autopart.errors import ConfigError

__all__ = ["DeviceSpec", "device_spec", "device_spec_names"]

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

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a parameter/compute dtype name ("float32", "bfloat16", "float16")."""
        return self.fp32_flops if dtype in ("float32", "float64", "32", "32-true") else self.bf16_flops


_SPECS: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        DeviceSpec("v100-32gb", 32 * _GIB, 15.7e12, 125e12, 900e9, 130e9, 12.5e9, 130e9, 12.5e9, 10.0, 5.0),
        DeviceSpec("a100-40gb", 40 * _GIB, 19.5e12, 312e12, 1555e9, 235e9, 25e9, 230e9, 25e9, 8.0, 4.0),
        DeviceSpec("a100-80gb", 80 * _GIB, 19.5e12, 312e12, 2039e9, 235e9, 25e9, 230e9, 25e9, 8.0, 4.0),
        DeviceSpec("h100-80gb", 80 * _GIB, 67e12, 989e12, 3350e9, 360e9, 50e9, 360e9, 50e9, 6.0, 3.0),
        DeviceSpec("h200-141gb", 141 * _GIB, 67e12, 989e12, 4800e9, 360e9, 50e9, 360e9, 50e9, 6.0, 3.0),
        # Placeholder figures for one CPU process with one thread talking gloo over loopback; calibrate_cpu()
        # replaces compute and memory bandwidth with measured values.
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
            f"unknown device spec {name!r}; known specs: {', '.join(device_spec_names())} "
            "(or describe the device with --device-memory and the bandwidth options)"
        )
    spec = _SPECS[key]
    return replace(spec, **overrides) if overrides else spec  # type: ignore[arg-type]
