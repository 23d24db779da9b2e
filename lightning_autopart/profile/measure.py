"""Timing of one block on a real device: forward and backward medians, saved-tensor bytes, FLOPs."""

from __future__ import annotations

import statistics
import time

import torch

from lightning_autopart.graph import Block
from lightning_autopart.profile.opcount import OpCounter
from lightning_autopart.profile.precision import Precision
from lightning_autopart.profile.runner import BlockCost, Runner
from lightning_autopart.profile.sandbox import clear_grads, fresh_inputs

__all__: list[str] = []


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_block(
    block: Block, device: torch.device, precision: Precision, launch_us: float, warmup: int, repeats: int
) -> BlockCost:
    """Time ``repeats`` forward+backward runs of a copy of ``block`` on ``device`` after ``warmup`` runs.

    One more untimed run, first, counts FLOPs and kernels and meters saved tensors under a dispatch mode.
    Times are medians; CUDA is timed with events, anything else with perf_counter. The batch-independent
    part is ``kernels x launch_us``, capped at 0.9 of the measured time.
    """
    runner = Runner(block, device, precision)
    counter = OpCounter()
    activation_bytes, saved_inputs, saved_outputs = runner.counted_run(counter)
    for _ in range(warmup):
        outputs = runner.forward(fresh_inputs(runner.args))
        runner.backward(outputs)
        clear_grads(runner.program, runner.args)
    _synchronize(device)

    fwd_times: list[float] = []
    bwd_times: list[float] = []
    for _ in range(repeats):
        inputs = fresh_inputs(runner.args)
        if device.type == "cuda":
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            outputs = runner.forward(inputs)
            mid.record()
            runner.backward(outputs)
            end.record()
            torch.cuda.synchronize(device)
            fwd_times.append(start.elapsed_time(mid) * 1e3)
            bwd_times.append(mid.elapsed_time(end) * 1e3 if outputs else 0.0)
        else:
            t0 = time.perf_counter()
            outputs = runner.forward(inputs)
            t1 = time.perf_counter()
            runner.backward(outputs)
            t2 = time.perf_counter()
            fwd_times.append((t1 - t0) * 1e6)
            bwd_times.append((t2 - t1) * 1e6 if outputs else 0.0)
        clear_grads(runner.program, runner.args)

    fwd_us = statistics.median(fwd_times)
    bwd_us = statistics.median(bwd_times)
    fwd, bwd = counter.counts["fwd"], counter.counts["bwd"]
    return BlockCost(
        fwd_us=fwd_us,
        bwd_us=bwd_us,
        fwd_fixed_us=min(fwd.kernels * launch_us, 0.9 * fwd_us),
        bwd_fixed_us=min(bwd.kernels * launch_us, 0.9 * bwd_us),
        activation_bytes=activation_bytes,
        saved_input_bytes=saved_inputs,
        saved_output_bytes=saved_outputs,
        fwd_flops=fwd.flops,
        bwd_flops=bwd.flops,
        fwd_kernels=fwd.kernels,
        bwd_kernels=bwd.kernels,
    )
