"""A sub-second probe of this CPU: matmul FLOP/s, copy bandwidth, per-op dispatch overhead, and the host time of
a pipeline action and of a training step's fixed work (messages between two threads over loopback)."""

from __future__ import annotations

import functools
import socket
import statistics
import threading
import time
from collections.abc import Callable

import torch

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

    An action costs its bookkeeping (half of a tiny forward + backward, :func:`_tiny_action`) plus one message
    to its neighbour: a send and its matching receive between two threads over a loopback socket pair (post,
    copy, the receiver's wake-up: what gloo's transport does per message). A step's fixed work outside the
    pipeline is two messages (the loss sent along the pipeline, the launcher's stop check of each step).
    Returns ``(action_us, step_us)``. (No gloo group is made here: a second process group inside a rank's
    process crashed its exit on torch 2.11.)
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
    message_us = _loopback_message_us(reps)
    return bookkeeping + message_us, 2 * message_us


def _loopback_message_us(reps: int) -> float:
    """One-way time of a small message between two threads over a socket pair (the fastest of 3 rounds, us)."""
    a, b = socket.socketpair()

    def echo() -> None:
        for _ in range(3 * reps):
            b.sendall(b.recv(8))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    best = float("inf")
    try:
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                a.sendall(b"autopart")
                a.recv(8)
            best = min(best, (time.perf_counter() - start) / reps / 2 * 1e6)
    finally:
        thread.join(timeout=5)
        a.close()
        b.close()
    return best
