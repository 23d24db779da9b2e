"""The CUDA clock's bookkeeping ([Note: host and device]) on a scripted stand-in for ``torch.cuda``: when a run
is spun, how long the spin is, and which runs count as serial. The real device is in tests/gpu."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from lightning_autopart.profile import cuda_clock
from lightning_autopart.profile.cuda_clock import QUEUE_KERNELS, CudaClock

RATE = 1000.0  # spin cycles per microsecond


class FakeCuda:
    """Records what the clock asks of the device; events report ``device_us`` and whether the device is idle."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.device_us = 80.0
        self.idle_after_run = False

    def synchronize(self, device: Any = None) -> None:
        self.log.append("sync")

    def _sleep(self, cycles: int) -> None:
        self.log.append(("spin", cycles))

    def Event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def record(self) -> None:
        self.cuda.log.append("event")

    def query(self) -> bool:
        return self.cuda.idle_after_run

    def elapsed_time(self, end: FakeEvent) -> float:
        return self.cuda.device_us / 1e3


class FakeTime:
    """perf_counter that a run advances by its host time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCuda, FakeTime]:
    cuda, clock = FakeCuda(), FakeTime()
    for name in ("synchronize", "_sleep", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(cuda_clock, "time", clock)
    monkeypatch.setitem(cuda_clock._cycles_per_us, 0, RATE)
    return cuda, clock


def _run(clock: CudaClock, time_: FakeTime, host_us: float, kernels: int = 10) -> tuple[list[float], list[float]]:
    times: tuple[list[float], list[float]] = ([], [])

    def run() -> str:
        time_.now += host_us / 1e6
        return "out"

    clock.idle()
    assert clock.run("fwd0", run, kernels, times) == "out"
    clock.settle()
    return times


def test_a_known_host_time_is_spun_over_and_kept_apart_from_the_device(fake: tuple[FakeCuda, FakeTime]) -> None:
    cuda, now = fake
    clock = CudaClock(torch.device("cuda", 0))
    # first run: the host time is not known yet, so no spin; it counts as serial (host = device)
    assert _run(clock, now, 300.0) == ([80.0], [80.0])
    assert not [x for x in cuda.log if isinstance(x, tuple)]
    cuda.log.clear()
    # second run: a spin of 1.5x the host time seen (+20 us) before the block; the host's own time is kept
    assert _run(clock, now, 250.0) == ([80.0], [pytest.approx(250.0)])
    assert cuda.log[:3] == ["sync", ("spin", int((1.5 * 300.0 + 20.0) * RATE)), "event"]


def test_a_run_that_waited_for_the_device_counts_as_serial(fake: tuple[FakeCuda, FakeTime]) -> None:
    """A block that synchronizes inside waits for the spin: its host time is not its own, whether the device is
    idle when the host returns or still runs the kernels launched after the sync."""
    cuda, now = fake
    clock = CudaClock(torch.device("cuda", 0))
    _run(clock, now, 100.0)
    cuda.idle_after_run = True
    assert _run(clock, now, 90.0) == ([80.0], [80.0])  # the device idle when the host returns
    cuda.idle_after_run = False
    assert _run(clock, now, 1.5 * 100.0 + 20.0 - 19.0) == ([80.0], [80.0])  # the host outlasted its spin
    assert _run(clock, now, 120.0) == ([80.0], [pytest.approx(120.0)])  # within the spin: its own time
    cuda.log.clear()
    _run(clock, now, 100.0)  # the waited-for time does not lengthen the next spin; the host's own does
    assert [x[1] for x in cuda.log if isinstance(x, tuple)] == [pytest.approx((1.5 * 120.0 + 20.0) * RATE, abs=1)]


def test_a_block_with_more_kernels_than_the_queue_takes_is_not_spun(fake: tuple[FakeCuda, FakeTime]) -> None:
    cuda, now = fake
    clock = CudaClock(torch.device("cuda", 0))
    for _ in range(3):
        assert _run(clock, now, 300.0, kernels=QUEUE_KERNELS + 1) == ([80.0], [80.0])
    assert not [x for x in cuda.log if isinstance(x, tuple)]


def test_without_spin_the_queue_is_never_emptied(
    fake: tuple[FakeCuda, FakeTime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPIN off is the timing of before: events only, no synchronize between blocks, every run serial."""
    cuda, now = fake
    monkeypatch.setattr(cuda_clock, "SPIN", False)
    clock = CudaClock(torch.device("cuda", 0))
    for _ in range(3):
        assert _run(clock, now, 300.0) == ([80.0], [80.0])
    assert cuda.log.count("sync") == 3  # settle's, once per round
    assert not [x for x in cuda.log if isinstance(x, tuple)]


def test_the_spin_rate_is_the_fastest_of_three_spins(
    fake: tuple[FakeCuda, FakeTime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that boosts after the first spin must not make later spins shorter than asked."""
    monkeypatch.setattr(cuda_clock, "_cycles_per_us", {})
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    durations = iter([2000.0, 1000.0, 1500.0])  # microseconds of each 2e6-cycle spin
    monkeypatch.setattr(FakeEvent, "elapsed_time", lambda self, end: next(durations) / 1e3)
    assert cuda_clock.cycles_per_us(torch.device("cuda", 0)) == 2000.0
    assert cuda_clock.cycles_per_us(torch.device("cuda", 0)) == 2000.0  # once per process


def test_chained_runs_synchronize_only_when_the_queue_would_overfill(
    fake: tuple[FakeCuda, FakeTime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: chained runs]: the host runs from block to block while the device's queue holds the launches."""
    cuda, now = fake
    monkeypatch.setattr(cuda_clock, "CHAIN", True)
    clock = CudaClock(torch.device("cuda", 0))
    kernels = 100  # each run queues its kernels, a spin and two events
    per_run = kernels + 3
    runs = QUEUE_KERNELS // per_run + 1  # the last of them no longer fits

    def one(key: int) -> None:
        clock.idle(kernels)
        clock.run(("fwd", key), lambda: setattr(now, "now", now.now + 1e-4), kernels, ([], []))

    for key in range(runs):
        one(key)
    assert cuda.log.count("sync") == 1  # before the run that overfilled the queue only
    clock.settle()
    cuda.log.clear()
    one(0)
    assert cuda.log.count("sync") == 0  # settle emptied the queue
    monkeypatch.setattr(cuda_clock, "CHAIN", False)
    one(1)
    assert cuda.log.count("sync") == 1  # unchained: a synchronize before every run


def test_a_backward_calls_hand_off_is_measured_apart_from_its_kernels() -> None:
    from lightning_autopart.profile.measure import backward_handoff_us

    handoff = backward_handoff_us(torch.device("cpu"), rounds=5)
    assert 0.0 <= handoff < 1e5
