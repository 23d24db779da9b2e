"""Timing a block on CUDA as training runs it: the device's time and the host's time, apart.

[Note: host and device] In training the host runs ahead of a CUDA device: it queues a layer's kernels while
the device still works on earlier ones, so a step lasts about ``max(sum of device times, sum of host times)``,
not the sum of each block's larger one. Where a layer's Python outlasts its kernels (bf16 Hugging Face layers on
a slow host), the host catches up during the cheap layers and falls behind again during the LM head. CUDA events
around a block time the device only while the device has work queued: a block launched onto an idle device is
timed at its host's pace. Measured that way, a slower H100 host predicted a Llama bf16 step 1.33x too long.

So each timed run of a block starts on an idle device (a synchronize) with a spin kernel
(``torch.cuda._sleep``) lasting 1.5x the block's host time seen so far: the host queues all of the block's
kernels while the device spins, the events then time the device's work alone, and ``perf_counter`` times the
host's. The planner prices a stage as ``max(device sum, host sum)`` (see [Note: host overhead] in cost.py).

A run whose host work outlasts its spin, or whose end event is already reached when the host returns, left the
device idle for a while: the block synchronized inside (``.item()``, ``nonzero``, a data-dependent shape) and
waited for the spin, or the host was slower than the spin allowed. Such a run counts as serial, and so does
every run of a block that launches more kernels than the device's queue takes while it spins
(:data:`QUEUE_KERNELS`) and every run when :data:`SPIN` is off: its host time is its device time, which adds
the same to both sums, as a block the host cannot run ahead of does.

[Note: chained runs] A synchronize before every block leaves the host idle between blocks, where a training
step's host never pauses; on an H200 the same Llama's profiled host time differed by 20-40 % between two
machines whose plain steps differed by 5 %. With :data:`CHAIN` (opt-in, for ``bench/fidelity.py --modes
measure-chained`` until a GPU session has compared it), runs follow each other without a synchronize while
the device's queue holds them (:data:`QUEUE_KERNELS` launches since the last one): each run still waits
behind its own spin, so the device, which lags the host by every earlier spin, never idles inside a run, and
the host runs from block to block as in a step. Each block's backward is still its own autograd call, handed
to the device's autograd thread and back, where a stage's backward is one call: in this mode that hand-off
(``measure.backward_handoff_us``, timed once per profile) is taken off each block's backward host time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CHAIN", "QUEUE_KERNELS", "SPIN", "CudaClock"]

#: Time blocks behind a spin kernel (host and device apart). False: events only, no synchronize between
#: blocks, every run serial (the timing of before, kept for ``bench/fidelity.py --modes measure-serial``).
SPIN = True

#: Most kernels a block may launch behind a spin: the driver's queue holds about 1,024 launches, and a host
#: that fills it waits for the spin, which would then count as host time.
QUEUE_KERNELS = 512

#: Chain runs without a synchronize between them while the queue holds them (see [Note: chained runs]).
CHAIN = False

#: Launches a run adds besides its kernels: its spin and its two events.
_PER_RUN = 3

#: The spin lasts ``_MARGIN`` times the block's longest host time seen, plus ``_FLOOR_US``, at most ``_CAP_US``.
_MARGIN, _FLOOR_US, _CAP_US = 1.5, 20.0, 1e6

_cycles_per_us: dict[int, float] = {}


def cycles_per_us(device: torch.device) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond on ``device``, timed once per process: the fastest of
    three spins, so that a clock that boosts later makes spins no shorter than asked."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _cycles_per_us.get(index)
    if rate is None:
        cycles, rates = 2_000_000, []
        with torch.cuda.device(index):
            torch.cuda._sleep(1000)  # load the kernel
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                torch.cuda.synchronize(index)
                rates.append(cycles / max(start.elapsed_time(end) * 1e3, 1.0))
        rate = _cycles_per_us[index] = max(rates)
    return rate


@dataclass
class _Run:
    device_us: list[float]
    host_us: list[float]
    start: Any
    end: Any
    host: float
    serial: bool


@dataclass
class CudaClock:
    """Times block runs on one CUDA device (see [Note: host and device]); the times are read by :meth:`settle`."""

    device: torch.device
    #: The caller's label of the last run (a device error surfaces at the next synchronize: it names this).
    last: Any = None
    _seen: dict[Any, float] = field(default_factory=dict)
    _pending: list[_Run] = field(default_factory=list)
    #: Launches queued since the last synchronize (see [Note: chained runs]).
    _queued: int = 0

    def idle(self, kernels: int | None = None) -> None:
        """Wait until the device has run everything queued (a no-op when :data:`SPIN` is off); with
        :data:`CHAIN`, only when a next run of ``kernels`` launches would overfill the queue."""
        if not SPIN:
            return
        launches = None if kernels is None else kernels + _PER_RUN
        if CHAIN and launches is not None and self._queued + launches <= QUEUE_KERNELS:
            self._queued += launches
            return
        torch.cuda.synchronize(self.device)
        self._queued = launches or 0

    def run(
        self,
        key: Any,
        run: Callable[[], Any],
        kernels: int,
        times: tuple[list[float], list[float]] | None,
    ) -> Any:
        """``run()`` behind a spin when the block's host time is known, on a device made :meth:`idle` first;
        its device and host microseconds go to ``times`` (device, host) at :meth:`settle` (None: not recorded)."""
        seen = self._seen.get(key)
        spin_us = 0.0
        if SPIN and kernels <= QUEUE_KERNELS and seen is not None:
            spin_us = min(_MARGIN * seen + _FLOOR_US, _CAP_US)
            torch.cuda._sleep(max(1, int(spin_us * cycles_per_us(self.device))))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        result = run()
        host = (time.perf_counter() - began) * 1e6
        end.record()
        # the host outlasted its spin (it waited for the device) or finds the device idle: see the note
        waited = bool(end.query()) or (spin_us > 0.0 and host + _FLOOR_US >= spin_us)
        if not waited or seen is None:
            self._seen[key] = max(host, seen or 0.0)
        if times is not None:
            self._pending.append(_Run(times[0], times[1], start, end, host, spin_us == 0.0 or waited))
        return result

    def settle(self) -> None:
        """Wait for the device and file every pending run's times."""
        torch.cuda.synchronize(self.device)
        self._queued = 0
        for r in self._pending:
            device_us = r.start.elapsed_time(r.end) * 1e3
            r.device_us.append(device_us)
            r.host_us.append(device_us if r.serial else r.host)
        self._pending.clear()
