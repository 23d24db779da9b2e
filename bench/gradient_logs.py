"""What gathering the gradient hooks' logs over a pipeline costs per hook call ([Note: gradient hooks]).

Usage: ``python bench/gradient_logs.py [--calls N] [--params 10,200]``. Two gloo processes on the CPU (one
thread each) stand for the two stages of a pipeline; each logs what Lightning's ``grad_norm`` gives for its own
parameters (a norm per parameter and a stage "total") plus a learning rate, and every call gathers and merges
both stages' records as the strategy does after ``on_before_optimizer_step``. Prints the mean time of one call
(gather and merge, after 3 calls that learn the layouts) per number of parameters a stage logs.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_autopart.lightning.grad_logs import GradientLogs
from lightning_autopart.lightning.hooks import LogRecord

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _records(rank: int, params: int, step: int) -> list[LogRecord]:
    norms = [LogRecord(f"grad_2.0_norm/stage{rank}.p{i}", torch.tensor(0.1 * i + step), {}) for i in range(params)]
    return [*norms, LogRecord("grad_2.0_norm_total", torch.tensor(1.0 + rank), {}), LogRecord("lr", 0.1, {})]


def _rank(rank: int, port: int, counts: list[int], calls: int, out: dict[int, float]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        for params in counts:
            logs = GradientLogs(group, None, rank, ["0", "1"], torch.device("cpu"), rank)
            made = [_records(rank, params, step) for step in range(calls + 3)]
            for records in made[:3]:
                logs.merge("on_before_optimizer_step", logs.gather("on_before_optimizer_step", records))
            dist.barrier()
            began = time.perf_counter()
            for records in made[3:]:
                logs.merge("on_before_optimizer_step", logs.gather("on_before_optimizer_step", records))
            if rank == 0:
                out[params] = (time.perf_counter() - began) / calls
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--params", default="10,200", help="parameters a stage logs a norm of, comma-separated")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.params.split(",")]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), counts, args.calls, out), nprocs=2)
        times = dict(out)
    print("| norms logged per stage | records merged | ms per hook call |\n|---:|---:|---:|")
    for params in counts:
        print(f"| {params} | {2 * params + 2} | {times[params] * 1e3:.2f} |")
    return times


if __name__ == "__main__":
    main()
