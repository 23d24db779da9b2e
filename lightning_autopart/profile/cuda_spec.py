"""A device spec for the local CUDA device: the named spec where it is that part, else one derived from what
the driver reports (SMs, clocks, memory bus), so that a GPU we have no sheet for is not priced as an A100.

[Note: derived device specs]
The named specs (``devices.py``) are the SXM parts of DGX/HGX nodes. An H100 PCIe (114 SMs, 2.0 TB/s), an H100
NVL, a GH200, an L4 or an A10G share a name prefix with one of them, or none, yet differ by up to 10x in
bandwidth and compute. The local device is matched to a named spec only when its SM count and memory (within
5 %: an H100 NVL has 94 GB) are that spec's; otherwise its spec is computed:

- memory bandwidth: the memory clock x 2 (double data rate) x the bus width in bytes. This gives the sheets'
  figures for HBM2e/HBM3 (A100 1,555 GB/s, H100 SXM 3,352 GB/s) and GDDR6/6X (L4 300 GB/s, RTX 4090 1,008 GB/s);
- compute peaks: SMs x the SM clock (the boost clock the driver reports) x the dense FLOPs one SM does per clock
  on that architecture (``_PER_SM_CLOCK``, from the vendors' sheets: e.g. 132 x 1.98 GHz x 256 = 66.9 TFLOP/s
  of float32 on an H100 SXM). Hopper's tensor cores run below the boost clock at their rated peak (989 TFLOP/s
  at 1.83 GHz), so its per-clock figure is taken against the boost clock. GeForce parts do bf16/fp16 products
  with float32 accumulation, as torch asks for, at half the rate of the data-center parts of their
  architecture;
- links: no sheet says how the devices are wired, so PCIe 4.0 x16 figures (25 GB/s point to point, 20 GB/s
  all-reduce inside a node, a 100 Gb/s network across nodes): an underestimate on NVLink machines, which
  makes the planner cautious about communication, never optimistic.

The derived spec is registered under its name (``nvidia-l4-22gb``) so that :func:`device_spec` finds it in
this process, as profiles and clusters look specs up by name.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from lightning_autopart.devices import DeviceSpec, device_spec, device_spec_names, register_spec
from lightning_autopart.errors import ConfigError

__all__ = ["CudaProperties", "local_cuda_spec", "spec_from_properties"]

_GIB = 1 << 30

#: Dense FLOPs one SM does per clock, by compute capability: (float32 FMA units x 2, TF32 tensor, 16-bit tensor).
_PER_SM_CLOCK: dict[tuple[int, int], tuple[float, float, float]] = {
    (7, 0): (128, 0, 1024),  # V100: 80 x 1.53 GHz -> 15.7 / - / 125 T
    (7, 5): (128, 0, 1024),  # T4: 40 x 1.59 GHz -> 8.1 / - / 65 T
    (8, 0): (128, 1024, 2048),  # A100: 108 x 1.41 GHz -> 19.5 / 156 / 312 T
    (8, 6): (256, 512, 1024),  # A10: 72 x 1.695 GHz -> 31.2 / 62.5 / 125 T
    (8, 7): (256, 512, 1024),  # Orin: Ampere's consumer SM
    (8, 9): (256, 512, 1024),  # L4: 58 x 2.04 GHz -> 30.3 / 60 / 121 T; L40S 142 x 2.52 GHz -> 91.6 / 183 / 362 T
    (9, 0): (256, 1890, 3780),  # H100 PCIe: 114 x 1.755 GHz -> 51.2 / 378 / 756 T (tensor cores below boost)
    (10, 0): (256, 3850, 7700),  # B200: 148 SMs, 2.25 P dense 16-bit
    (12, 0): (256, 512, 1024),  # RTX PRO / GeForce 50: consumer Blackwell SM
}

#: Fabric of a node whose wiring is unknown, bytes/s: PCIe 4.0 x16 point to point and all-reduce inside a node,
#: a 100 Gb/s network across nodes.
_PCIE_BW, _PCIE_ALLREDUCE_BW, _NETWORK_BW = 25e9, 20e9, 12.5e9
_LATENCY_US, _LAUNCH_US = 10.0, 4.0
#: The chips of the named specs (a derived spec's name starts with its vendor's, "nvidia-").
_FAMILIES = ("v100", "a100", "h100", "h200")
#: How far the memory may differ from a named spec's for the device to still be that part.
_MEMORY_TOLERANCE = 0.05


@dataclass(frozen=True)
class CudaProperties:
    """What the driver reports about one CUDA device (``torch.cuda.get_device_properties``), as plain numbers."""

    name: str
    major: int
    minor: int
    sm_count: int
    #: Peak SM clock and memory clock, kHz (0 where torch does not report them).
    clock_khz: int
    memory_clock_khz: int
    memory_bus_width: int
    total_memory: int
    #: An AMD GPU under ROCm, which torch also calls "cuda": its compute capability is not NVIDIA's.
    hip: bool = False

    @classmethod
    def of(cls, props: Any) -> CudaProperties:
        """The numbers of a ``torch.cuda.get_device_properties`` result (clocks are 0 on torch builds without them)."""
        import torch

        return cls(
            name=str(props.name),
            major=int(props.major),
            minor=int(props.minor),
            sm_count=int(props.multi_processor_count),
            clock_khz=int(getattr(props, "clock_rate", 0) or 0),
            memory_clock_khz=int(getattr(props, "memory_clock_rate", 0) or 0),
            memory_bus_width=int(getattr(props, "memory_bus_width", 0) or 0),
            total_memory=int(props.total_memory),
            hip=torch.version.hip is not None,
        )


def _named(props: CudaProperties) -> DeviceSpec | None:
    """The named spec this device is, by its name's family, SM count and memory; None when none is."""
    lowered = props.name.lower()
    for name in device_spec_names():
        family = name.split("-")[0]
        if family not in _FAMILIES or family not in lowered:
            continue
        spec = device_spec(name)
        if spec.sm_count == props.sm_count and abs(props.total_memory / spec.memory_bytes - 1) <= _MEMORY_TOLERANCE:
            return spec
    return None


def _spec_name(props: CudaProperties) -> str:
    words = props.name.lower().replace("_", " ").replace("-", " ").split()
    return "-".join([*words, f"{round(props.total_memory / _GIB)}gb"])


def spec_from_properties(props: CudaProperties) -> DeviceSpec:
    """The spec of a device from its reported numbers ([Note: derived device specs]): a named spec where it is
    that part, else peaks from SMs x clock x the architecture's per-clock rate and bandwidth from the bus.

    Raises:
        ConfigError: the clocks are unknown (older torch) or the architecture is not in the table; the message
            names the fix (``--device-spec`` / ``device_spec(...)`` with overrides).
    """
    named = _named(props)
    if named is not None:
        return named
    rates = None if props.hip else _PER_SM_CLOCK.get((props.major, props.minor), _PER_SM_CLOCK.get((props.major, 0)))
    if rates is None or not (props.clock_khz and props.memory_clock_khz and props.memory_bus_width):
        if props.hip:
            why = "an AMD GPU: no table of its per-clock rates"
        elif rates is None:
            why = f"compute capability {props.major}.{props.minor} is not in the table"
        else:
            why = "this torch does not report its clocks"
        raise ConfigError(
            f"no device spec for {props.name!r} ({why}); name the closest spec and this device's memory "
            f"(CLI: --device-spec a100-40gb --device-memory {props.total_memory / _GIB:.0f}GB; Python: "
            "device_spec('a100-40gb', memory_bw=..., bf16_flops=...))"
        )
    fp32, tf32, half = rates
    if "geforce" in props.name.lower() and props.major >= 8:
        half, tf32 = half / 2, tf32 / 2  # float32 accumulation at half rate on consumer parts
    per_clock = props.sm_count * props.clock_khz * 1e3
    return DeviceSpec(
        _spec_name(props),
        props.total_memory,
        fp32 * per_clock,
        half * per_clock,
        2 * props.memory_clock_khz * 1e3 * props.memory_bus_width / 8,
        intra_node_bw=_PCIE_BW,
        inter_node_bw=_NETWORK_BW,
        intra_allreduce_bw=_PCIE_ALLREDUCE_BW,
        inter_allreduce_bw=_NETWORK_BW,
        latency_us=_LATENCY_US,
        launch_us=_LAUNCH_US,
        sm_count=props.sm_count,
        tf32_flops=tf32 * per_clock,
    )


#: The spec a device gets when none can be derived (with a warning that says so and how to name one).
FALLBACK = "a100-40gb"


def local_cuda_spec(props: Any) -> DeviceSpec:
    """The spec of a CUDA device from its ``torch.cuda.get_device_properties``, registered under its name; the
    A100 40 GB's, with a warning naming the fix, where none can be derived."""
    try:
        spec = spec_from_properties(CudaProperties.of(props))
    except ConfigError as err:
        warnings.warn(f"autopart: {err}; priced as {FALLBACK} meanwhile", stacklevel=2)
        return device_spec(FALLBACK)
    if spec.name not in device_spec_names():
        register_spec(spec)
    return spec
