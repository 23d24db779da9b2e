"""Timing of one block on a real device: forward and backward medians, saved-tensor bytes, FLOPs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from lightning_autopart.capture.graph import Block
from lightning_autopart.profile import cuda_clock
from lightning_autopart.profile.cuda_clock import CudaClock
from lightning_autopart.profile.opcount import OpCounter
from lightning_autopart.profile.precision import Precision
from lightning_autopart.profile.runner import BlockCost, RunMemory, Runner
from lightning_autopart.profile.sandbox import clear_grads, fresh_inputs

__all__ = ["backward_handoff_us", "trimmed_mean"]


class BlockFailed(Exception):
    """A block of a window failed to run: ``position`` in the window, the original error as the cause."""

    def __init__(self, position: int, error: Exception) -> None:
        super().__init__(f"block {position} of the window: {type(error).__name__}: {error}")
        self.position = position
        self.error = error


def measure_block(
    block: Block, device: torch.device, precision: Precision, launch_us: float, warmup: int, repeats: int
) -> BlockCost:
    """Time a copy of one block alone (see :func:`measure_blocks`)."""
    return measure_blocks([block], device, precision, launch_us, warmup, repeats)[0]


def measure_blocks(
    blocks: Sequence[Block],
    device: torch.device,
    precision: Precision,
    launch_us: float,
    warmup: int,
    repeats: int,
) -> list[BlockCost]:
    """Time copies of consecutive ``blocks`` as a stage runs them: every forward in order, then every backward
    in reverse, ``repeats`` times after ``warmup`` rounds; each block's times are its medians.

    [Note: blocks in order] A block timed alone, over and over, keeps its weights and activations in cache;
    in a stage the other blocks evict them between its forward and its backward. On a 2-core EPYC (1 MiB
    L2 per core) a Linear(512, 512) timed alone ran its backward 2x faster than inside a chain of five, so
    a stage's measured profile came out 2-2.5x low. Running the window's blocks in stage order gives each
    block the cache its neighbours leave, as training does.

    One more untimed run per block, first, counts FLOPs and kernels and meters saved tensors under a
    dispatch mode. CUDA is timed with events, anything else with perf_counter.

    [Note: launch latency] A synchronize before a block that is then timed with events alone adds
    the host's launch latency to every block: on an H100 in bf16-mixed, where kernels take microseconds,
    measure mode predicted a GPT-2 step 1.21-1.40x and a Llama step 1.27-1.43x too long. So on CUDA each block
    runs behind a spin kernel that outlasts its host work, and the device's time and the host's are kept
    apart (:mod:`.cuda_clock`, [Note: host and device]). The batch-independent part is ``kernels x
    launch_us``, capped at 0.9 of the measured time.

    [Note: host timing statistic] A training step lasts as long as the mean of its actions, and on a CPU that
    other ranks (and, on a shared machine, other tenants) contend for, a block's times are bimodal: slow phases
    last tens of milliseconds. The median of 5 rounds sees one phase: on the 2-core test machine it predicted a
    2-stage MLP step at 14.0-17.5 ms in runs that took 36-37 ms. On a host device the rounds go on (up to 30)
    until they span 0.3 s, and a block's time is the mean of the middle 80 % of its rounds (one-off stalls
    dropped); the same model then predicted 21.5-22.3 ms for runs of 21.7-23.8 ms. CUDA keeps the median of
    ``repeats``: the events time the device, which no other process shares.
    """
    runners: list[Runner] = []
    counters: list[OpCounter] = []
    saved: list[tuple[int, int, int]] = []
    memory: list[RunMemory] = []
    names: list[tuple[frozenset[str], frozenset[str]]] = []
    fwd_times: list[list[float]] = [[] for _ in blocks]
    bwd_times: list[list[float]] = [[] for _ in blocks]
    fwd_host: list[list[float]] = [[] for _ in blocks]
    bwd_host: list[list[float]] = [[] for _ in blocks]
    clock = CudaClock(device) if device.type == "cuda" else None
    outputs: list[list[torch.Tensor]] = []
    try:
        for i, block in enumerate(blocks):
            try:
                runner = Runner(block, device, precision)
                runners.append(runner)
                counter = OpCounter()
                saved.append(runner.counted_run(counter))
                memory.append(runner.memory())
                names.append(runner.saved_names)
            except Exception as error:
                raise BlockFailed(i, error) from error
            counters.append(counter)
        rounds, started = warmup + repeats, 0.0
        round_ = 0
        while round_ < rounds:
            timed = round_ >= warmup
            if round_ == warmup:
                started = time.perf_counter()
            round_ += 1
            outputs.clear()
            for i, runner in enumerate(runners):
                forward = partial(runner.forward, fresh_inputs(runner.args))
                kernels = counters[i].counts["fwd"].kernels
                outputs.append(_run(clock, ("fwd", i), forward, kernels, (fwd_times[i], fwd_host[i]), timed))
            for i in reversed(range(len(runners))):
                if outputs[i]:
                    backward = partial(runners[i].backward, outputs[i])
                    kernels = counters[i].counts["bwd"].kernels
                    _run(clock, ("bwd", i), backward, kernels, (bwd_times[i], bwd_host[i]), timed)
                elif timed:  # nothing of the block's output needs a gradient
                    bwd_times[i].append(0.0)
                    bwd_host[i].append(0.0)
            if clock is not None:
                _settle_clock(clock)
            for runner in runners:
                clear_grads(runner.program, runner.args)
            more = device.type != "cuda" and round_ == rounds < warmup + _MAX_HOST_ROUNDS
            if more and time.perf_counter() - started < _HOST_BUDGET_S:  # see [Note: host timing statistic]
                rounds += 1
    finally:
        # Free the copies now, also when a block failed (see [Note: no copy outlives the profiler]).
        outputs.clear()
        for runner in runners:
            runner.release()
        runners.clear()
    costs = []
    # each block's backward was its own autograd call; a stage's is one (see [Note: chained runs])
    handoff = backward_handoff_us(device) if clock is not None and cuda_clock.CHAIN else 0.0
    for i in range(len(blocks)):
        fwd_us, bwd_us = _typical(fwd_times[i], device), _typical(bwd_times[i], device)
        fwd, bwd = counters[i].counts["fwd"], counters[i].counts["bwd"]
        fixed = (min(fwd.kernels * launch_us, 0.9 * fwd_us), min(bwd.kernels * launch_us, 0.9 * bwd_us))
        host = (0.0, 0.0)
        if clock is not None:
            host = (_typical(fwd_host[i], device), max(0.0, _typical(bwd_host[i], device) - handoff))
        costs.append(BlockCost.of(counters[i], saved[i], (fwd_us, bwd_us), fixed, memory[i], names[i], host))
    return costs


def backward_handoff_us(device: torch.device, rounds: int = 21) -> float:
    """Host microseconds an autograd backward call costs beyond launching its kernels: the median call of a
    one-element product's backward less the median of launching its two kernels directly. On CUDA the call
    hands its graph to the device's autograd thread and waits for it to finish."""
    x = torch.zeros(1, device=device, requires_grad=True)
    seed = torch.ones(1, device=device)
    calls: list[float] = []
    launches: list[float] = []
    for _ in range(rounds):
        y = x * 2
        _synchronize(device)
        began = time.perf_counter()
        torch.autograd.backward(y, seed)
        calls.append(time.perf_counter() - began)
        _synchronize(device)
        began = time.perf_counter()
        x.grad.add_(seed * 2)  # type: ignore[union-attr]  # the same two kernels: the product, the accumulation
        launches.append(time.perf_counter() - began)
    _synchronize(device)
    return max(0.0, statistics.median(calls) - statistics.median(launches)) * 1e6


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Timed rounds on a host device: at least ``repeats``, more (up to this many) until the timed rounds took
#: ``_HOST_BUDGET_S`` seconds (see [Note: host timing statistic]).
_MAX_HOST_ROUNDS = 30
_HOST_BUDGET_S = 0.3


def trimmed_mean(values: list[float]) -> float:
    """The mean of the middle 80 % of ``values`` (see [Note: host timing statistic])."""
    ordered = sorted(values)
    cut = len(ordered) // 10
    return statistics.fmean(ordered[cut : len(ordered) - cut])


def _typical(times: list[float], device: torch.device) -> float:
    """A block's time from its rounds: the median on CUDA, the mean of the middle 80 % on a host device (see
    [Note: host timing statistic])."""
    return statistics.median(times) if device.type == "cuda" else trimmed_mean(times)


def _run(
    clock: CudaClock | None,
    key: tuple[str, int],
    run: Callable[[], Any],
    kernels: int,
    times: tuple[list[float], list[float]],
    record: bool,
) -> Any:
    """``run()`` of block ``key[1]``, its device and host microseconds into ``times`` when ``record``: on
    ``clock`` (CUDA), else by ``perf_counter`` (the host is the device); errors become BlockFailed."""
    position = key[1]
    if clock is None:
        try:
            t0 = time.perf_counter()
            result = run()
            elapsed = (time.perf_counter() - t0) * 1e6
        except Exception as error:
            raise BlockFailed(position, error) from error
        if record:
            times[0].append(elapsed)
        return result
    try:
        clock.idle(kernels)
    except Exception as error:  # the previous run's error, reported by CUDA only now
        raise BlockFailed(clock.last if clock.last is not None else position, error) from error
    clock.last = position
    try:
        return clock.run(key, run, kernels, times if record else None)
    except Exception as error:
        raise BlockFailed(position, error) from error


def _settle_clock(clock: CudaClock) -> None:
    """Read the round's times (a device error names the round's last block run: CUDA reports it only now)."""
    try:
        clock.settle()
    except Exception as error:
        raise BlockFailed(clock.last or 0, error) from error
