"""A torchrun worker: trains zoo models under several plans with PipelineRunner and saves the results.

Usage: ``python -m torch.distributed.run --nproc_per_node=N tests/distributed/_runtime_worker.py CASES OUT``,
where CASES is a JSON list of {"model", "stages", "replicas", "schedule"} and OUT a directory; rank r writes
``OUT/rank{r}.pt`` = {case index: {"params": {fqn: tensor}, "losses": [loss per step], ...}}.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.capture import capture
from lightning_autopart.runtime.runner import PipelineRunner
from tests.distributed.runtime_cases import batches, loss_fn, make_case_plan, micro_example
from tests.models import make

__all__: list[str] = []


def run_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train ``STEPS`` SGD steps of one case; return this rank's parameters and losses.

    With ``accumulate`` = k, each optimizer step takes k batches of ``BATCH`` samples, k - 1 of them with
    ``sync=False`` and a loss divided by k, as Lightning's ``accumulate_grad_batches`` does.
    """
    model = make(case["model"])
    captured = capture(model, micro_example(case["model"]), method="export")
    plan = make_case_plan(case, captured.num_blocks)
    k = case.get("accumulate", 1)
    loss_of = loss_fn(case["model"])
    outputs: list[weakref.ref[torch.Tensor]] = []  # this step's last-stage outputs
    alive: list[int] = []  # at each loss, the step's earlier outputs still alive

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        alive.append(sum(ref() is not None for ref in outputs))
        outputs.append(weakref.ref(out))
        return loss_of(out, y) / k

    runner = PipelineRunner(plan, captured, rank, "cpu", loss)
    params = list(dict.fromkeys(p for m in runner.modules.values() for p in m.parameters()))
    optimizer = torch.optim.SGD(params, lr=0.1)
    share = runner.local_batch_size
    losses = []
    all_reduces = {True: 0, False: 0}  # calls by sync flag of the step
    real_all_reduce = dist.all_reduce
    for x, y in batches(case["model"], plan.batch_size * k):
        total = None
        for j in range(k):
            lo = j * plan.batch_size + runner.placement.replica * share
            xs, ys = x[lo : lo + share], y[lo : lo + share]
            sync = j == k - 1

            def counted(*args: Any, sync: bool = sync, **kwargs: Any) -> Any:
                all_reduces[sync] += 1
                return real_all_reduce(*args, **kwargs)

            dist.all_reduce = counted
            outputs.clear()
            try:
                loss = runner.step(xs if runner.is_first else None, ys if runner.is_last else None, sync=sync)
            finally:
                dist.all_reduce = real_all_reduce
            total = None if loss is None else float(loss) + (total or 0.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    named = {n: p.detach().clone() for m in runner.modules.values() for n, p in m.named_parameters()}
    return {
        "params": named,
        "losses": losses,
        "replica": runner.placement.replica,
        "all_reduces": all_reduces,
        "outputs_alive": max(alive, default=0),
    }


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    try:
        for i, case in enumerate(cases):
            if case["stages"] * case["replicas"] // case.get("chunks", 1) == dist.get_world_size():
                results[i] = run_case(case, rank)
                dist.barrier()
    finally:
        torch.save(results, out / f"rank{rank}.pt")
        dist.destroy_process_group()
    os._exit(0)  # skip the slow interpreter teardown of torch


if __name__ == "__main__":
    main()
