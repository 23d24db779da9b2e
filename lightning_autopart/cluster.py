"""The cluster a plan is made for: nodes, devices, memory and bandwidths, and byte-size strings."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from lightning_autopart.devices import DeviceSpec, device_spec
from lightning_autopart.errors import ConfigError

__all__ = ["Cluster", "format_bytes", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """Parse "40GB" (10**9), "40GiB" (2**30), "512MB" or a plain number of bytes into an int."""
    if isinstance(value, bool):
        raise ConfigError(f"memory size must be a number of bytes or a string like '40GB', not {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise ConfigError(f"memory size must be positive, got {value!r}")
        return int(value)
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot parse memory size {value!r}; write a number with a unit such as '40GB', '80GiB' or '512MB'"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"memory size must be positive, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    """Render a byte count with a decimal unit ("43.1 GB")."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical devices; bandwidths in bytes/s, one direction, per device."""

    #: Number of nodes.
    nodes: int
    #: Devices (ranks) in each node.
    devices_per_node: int
    #: Memory of one device in bytes.
    device_memory_bytes: int
    #: Point-to-point bandwidth inside a node.
    intra_node_bw: float
    #: Point-to-point bandwidth between nodes.
    inter_node_bw: float
    #: All-reduce bus bandwidth inside a node.
    intra_allreduce_bw: float
    #: All-reduce bus bandwidth across nodes.
    inter_allreduce_bw: float
    #: Per-message latency in microseconds.
    latency_us: float = 10.0
    #: Fraction of device memory kept free for the allocator, workspaces and fragmentation.
    memory_reserve: float = 0.1
    #: Device spec name these figures come from ("custom" when given by hand).
    device: str = "custom"
    #: Host time per pipeline action and per training step, microseconds (see :class:`DeviceSpec`).
    action_us: float = 0.0
    step_us: float = 0.0
    #: Whether host time hides behind device time (True) or adds to it (False: CPU).
    async_host: bool = True

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ConfigError(
                f"a cluster needs at least one node and one device per node, got nodes={self.nodes}, "
                f"devices_per_node={self.devices_per_node}; pass --devices N (and --nodes M) with N, M >= 1"
            )
        if self.device_memory_bytes <= 0:
            raise ConfigError(f"device memory must be positive, got {self.device_memory_bytes} bytes")
        if not 0.0 <= self.memory_reserve < 1.0:
            raise ConfigError(f"memory_reserve must be in [0, 1), got {self.memory_reserve}")
        if self.action_us < 0 or self.step_us < 0:
            raise ConfigError(
                f"host overheads must be >= 0 microseconds, got action_us={self.action_us}, step_us={self.step_us}"
            )

    @property
    def step_host_us(self) -> float:
        """The step's fixed host work that adds to the step time: ``step_us`` where the host does the math;
        none where it runs ahead of the device, whose queue of kernels covers it."""
        return 0.0 if self.async_host else self.step_us

    @property
    def world_size(self) -> int:
        """Total number of devices (ranks)."""
        return self.nodes * self.devices_per_node

    @property
    def usable_memory_bytes(self) -> int:
        """Memory a stage may plan to use on one device."""
        return int(self.device_memory_bytes * (1.0 - self.memory_reserve))

    def node_of(self, rank: int) -> int:
        """Node index of a global rank (ranks are numbered node by node)."""
        return rank // self.devices_per_node

    @classmethod
    def from_spec(
        cls,
        spec: str | DeviceSpec,
        devices: int,
        nodes: int = 1,
        device_memory: str | int | None = None,
        memory_reserve: float = 0.1,
    ) -> Cluster:
        """A cluster of ``nodes`` x ``devices`` devices of a named spec; ``device_memory`` overrides its memory."""
        s = device_spec(spec) if isinstance(spec, str) else spec
        memory = parse_bytes(device_memory) if device_memory is not None else s.memory_bytes
        return cls(
            nodes=nodes,
            devices_per_node=devices,
            device_memory_bytes=memory,
            intra_node_bw=s.intra_node_bw,
            inter_node_bw=s.inter_node_bw,
            intra_allreduce_bw=s.intra_allreduce_bw,
            inter_allreduce_bw=s.inter_allreduce_bw,
            latency_us=s.latency_us,
            memory_reserve=memory_reserve,
            device=s.name,
            action_us=s.action_us,
            step_us=s.step_us,
            async_host=s.async_host,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)
