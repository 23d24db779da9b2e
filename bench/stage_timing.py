"""Does timing a stage block by block (as measure mode profiles) match the stage run as training runs it?

Usage: ``python bench/stage_timing.py [--rounds 7] [--layers 5] [--hidden 512] [--micro-batch 16]``. One
process, one thread: a stage of ``layers`` Linear + ReLU blocks is timed two ways, alternately: block by block
on one micro-batch (each block's forward and backward on its own, summed: the profile's way) and whole, with 4
micro-batches in 1F1B order (F F B F B F B B: the first of two stages), per micro-batch. Each round is run with
the other core idle and beside a process that keeps it busy with products; the two ways take turns going
first. Prints each round and the median ratio whole / block by block. A ratio near 1 rules the profile's
timing out as the source of a gap between predicted and measured CPU pipelines (docs/benchmarks.md, eleventh
session).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

__all__: list[str] = []

#: 1F1B on the first of two stages with 4 micro-batches.
ORDER = "FFBFBFBB"

#: The busy neighbour: one thread of 256 x 256 products until killed.
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nwhile True:\n    a @ a"


def time_by_block(blocks: list[nn.Module], batch: int, width: int, rounds: int = 30) -> float:
    """Sum over blocks of each block's median forward + backward time (ms) on one micro-batch."""
    fwd: list[list[float]] = [[] for _ in blocks]
    bwd: list[list[float]] = [[] for _ in blocks]
    for _ in range(rounds):
        x = torch.randn(batch, width)
        outputs = []
        for i, block in enumerate(blocks):
            start = time.perf_counter()
            y = block(x.detach().requires_grad_())
            fwd[i].append(time.perf_counter() - start)
            outputs.append(y)
            x = y
        for i in reversed(range(len(blocks))):
            start = time.perf_counter()
            outputs[i].backward(torch.ones_like(outputs[i]))
            bwd[i].append(time.perf_counter() - start)
        for block in blocks:
            block.zero_grad(set_to_none=True)
    return sum(statistics.median(f) + statistics.median(b) for f, b in zip(fwd, bwd, strict=True)) * 1e3


def time_whole(stage: nn.Module, batch: int, width: int, rounds: int = 30) -> float:
    """Median time (ms) per micro-batch of the whole stage running ``ORDER``."""
    times = []
    micro_batches = ORDER.count("F")
    for _ in range(rounds):
        inputs = [torch.randn(batch, width) for _ in range(micro_batches)]
        live: list[torch.Tensor] = []
        forwarded = 0
        start = time.perf_counter()
        for op in ORDER:
            if op == "F":
                live.append(stage(inputs[forwarded]))
                forwarded += 1
            else:
                y = live.pop(0)
                y.backward(torch.ones_like(y))
        times.append((time.perf_counter() - start) / micro_batches)
        stage.zero_grad(set_to_none=True)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = args.hidden
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(args.layers)]
    stage = nn.Sequential(*blocks)
    ratios: dict[str, list[float]] = {"idle": [], "busy": []}
    for r in range(args.rounds):
        for neighbour in ("idle", "busy"):
            busy = subprocess.Popen([sys.executable, "-c", BUSY]) if neighbour == "busy" else None
            try:
                if busy is not None:
                    time.sleep(3.0)  # past its import of torch: computing
                if r % 2:  # alternate which way goes first, so that a drift does not favour one
                    whole = time_whole(stage, args.micro_batch, width)
                    by_block = time_by_block(blocks, args.micro_batch, width)
                else:
                    by_block = time_by_block(blocks, args.micro_batch, width)
                    whole = time_whole(stage, args.micro_batch, width)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            ratios[neighbour].append(whole / by_block)
            print(
                f"round {r + 1}, other core {neighbour}: block by block {by_block:.2f} ms, whole "
                f"{whole:.2f} ms per micro-batch, ratio {whole / by_block:.2f}"
            )
    for neighbour, values in ratios.items():
        listed = ", ".join(f"{v:.2f}" for v in values)
        print(f"other core {neighbour}: whole / block by block {listed}; median **{statistics.median(values):.2f}**")


if __name__ == "__main__":
    main()
