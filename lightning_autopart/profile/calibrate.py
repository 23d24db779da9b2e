"""A sub-second probe of this CPU: matmul FLOP/s, copy bandwidth, per-op dispatch overhead, and the host time of
a pipeline action and of a training step's fixed work (gloo messages between two in-process ranks)."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_autopart.devices import DeviceSpec, device_spec

__all__ = ["calibrate_cpu", "probe_host"]


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
    """Probe this machine (0.1 to 0.5 s): the "cpu" spec with measured compute, bandwidth and launch cost.

    Returns:
        ``device_spec("cpu")`` with ``fp32_flops`` and ``bf16_flops`` set to the float32 rate of the fastest
        of ten 512 x 512 matmuls, ``memory_bw`` to the rate of the fastest of ten 32 MiB copies (read plus
        write bytes), and ``launch_us`` to the median cost of one tiny ``torch.add`` recorded by autograd
        (dispatcher and Python overhead), ``action_us`` and ``step_us`` to :func:`probe_host`'s. The result is
        cached for the process.
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
    action_us, step_us = probe_host()
    return device_spec(
        "cpu",
        fp32_flops=flops,
        bf16_flops=flops,
        memory_bw=bandwidth,
        launch_us=launch_us,
        action_us=action_us,
        step_us=step_us,
    )


def _tiny_action(layer: torch.nn.Module) -> None:
    """A forward and a backward of a pipeline stage with no math to speak of: detach the received input, run,
    flatten the outputs, enter autograd with the received gradient (what a schedule does per action)."""
    x = torch.zeros(2, 4).requires_grad_()
    out = layer(x)
    torch.autograd.backward((out,), (torch.ones_like(out),))


def probe_host(reps: int = 100) -> tuple[float, float]:
    """Host time of one pipeline action and of a step's fixed work on this machine, in microseconds.

    An action costs its bookkeeping (half of a tiny forward + backward, :func:`_tiny_action`) plus one gloo
    message: a send and its matching receive between two gloo ranks on threads of this process (post, copy,
    the receiver's wake-up), the unit every forward and backward of a pipelined stage exchanges with its
    neighbour. A step's fixed work outside the pipeline is two small gloo broadcasts (the loss sent along the
    pipeline and the launcher's stop check of each step). Returns ``(action_us, step_us)``; (0, 0) where
    gloo is unavailable.
    """
    layer = torch.nn.Linear(4, 4)
    _tiny_action(layer)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            _tiny_action(layer)
        runs.append((time.perf_counter() - start) / reps * 1e6)
    bookkeeping = statistics.median(runs) / 2
    try:
        message_us, broadcast_us = _gloo_pair(reps)
    except (RuntimeError, AttributeError):  # a torch build without gloo
        return 0.0, 0.0
    return bookkeeping + message_us, 2 * broadcast_us


def _gloo_pair(reps: int) -> tuple[float, float]:
    """One-way message time and broadcast time between two gloo ranks on two threads (medians, us)."""
    store = dist.HashStore()
    times: list[list[float]] = [[], []]

    def run(rank: int) -> None:
        group: Any = dist.ProcessGroupGloo(dist.PrefixStore("autopart-probe", store), rank, 2, timedelta(seconds=30))
        t = torch.zeros(1)
        for _ in range(3):  # the first round warms the connection; the fastest of the others is kept
            start = time.perf_counter()
            for i in range(reps):
                if (rank + i) % 2 == 0:
                    group.send([t], 1 - rank, i).wait()
                else:
                    group.recv([t], 1 - rank, i).wait()
            one_way = (time.perf_counter() - start) / reps * 1e6
            start = time.perf_counter()
            for _ in range(reps):
                group.broadcast([t], dist.BroadcastOptions()).wait()
            got = [one_way, (time.perf_counter() - start) / reps * 1e6]
            times[rank] = [min(a, b) for a, b in zip(times[rank], got, strict=True)] if times[rank] else got

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    if any(th.is_alive() for th in threads) or not all(times):
        raise RuntimeError("the gloo probe did not finish")
    return times[0][0], times[0][1]
