"""A sub-second probe of this CPU: matmul FLOP/s, copy bandwidth and per-op dispatch overhead."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from lightning_autopart.devices import DeviceSpec, device_spec

__all__ = ["calibrate_cpu"]


def _best_seconds(fn: Callable[[], object], trials: int) -> float:
    fn()  # warm caches and the allocator
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@functools.cache
def calibrate_cpu() -> DeviceSpec:
    """Probe this machine (0.1 to 0.4 s): the "cpu" spec with measured compute, bandwidth and launch cost.

    Returns:
        ``device_spec("cpu")`` with ``fp32_flops`` and ``bf16_flops`` set to the float32 rate of the fastest
        of ten 512 x 512 matmuls, ``memory_bw`` to the rate of the fastest of ten 32 MiB copies (read plus
        write bytes), and ``launch_us`` to the median cost of one tiny ``torch.add`` recorded by autograd
        (dispatcher and Python overhead). The result is cached for the process.
    """
    n = 512
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    flops = 2.0 * n**3 / _best_seconds(lambda: torch.mm(a, b), trials=10)

    src = torch.empty(8 << 20, dtype=torch.float32)  # 32 MiB, far beyond the caches
    src.fill_(1.0)
    dst = torch.empty_like(src)
    bandwidth = 2.0 * src.nbytes / _best_seconds(lambda: dst.copy_(src), trials=10)

    x = torch.zeros(1, requires_grad=True)  # the op also records an autograd node, as in training
    reps = 200

    def tiny_ops() -> None:
        for _ in range(reps):
            torch.add(x, x)

    tiny_ops()
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        tiny_ops()
        samples.append((time.perf_counter() - start) / reps * 1e6)
    launch_us = statistics.median(samples)
    return device_spec("cpu", fp32_flops=flops, bf16_flops=flops, memory_bw=bandwidth, launch_us=launch_us)
