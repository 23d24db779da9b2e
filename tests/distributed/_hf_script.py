"""A Hugging Face user's training script: fits the cases of a JSON file with AutoPartitionStrategy, one launch.

Usage: ``python tests/distributed/_hf_script.py CASES OUT DEVICES [FIRST]`` (Lightning's launcher starts the
other processes): fits cases FIRST, FIRST+1, ... of the list. After each case rank r writes
``OUT/rank{r}-from{FIRST}.pt`` = {case index: {"params", "losses", "metrics", ...} or {"error": traceback}}.
All cases run in one launch: importing transformers in every rank costs more than a case.

A case that fails on every rank at the same point (a planning error is raised on all ranks) does not stop the
launch: the ranks agree on it through the job's store and go on with the next case. When a rank does not finish
a case (it waits on a rank that failed alone), the ranks that did exit with code 1, which ends the others' wait
too, and the test relaunches from the next case.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.runtime.topology import place
from tests.distributed.job import end_job
from tests.distributed.launch import CHILD_HASHSEED
from tests.hf_cases import STEPS, fit
from tests.step_peak import StepPeak, stage_buffers

__all__: list[str] = []

#: How long a rank that finished a case waits for the others to finish it too.
AGREE_TIMEOUT = timedelta(seconds=20)


def run(case: dict[str, Any], devices: int) -> dict[str, Any]:
    """Fit one case; return this rank's stage parameters (original names), its logged losses and its place."""
    strategy = AutoPartitionStrategy(
        num_stages=case["stages"],
        micro_batches=case.get("micro_batches", 2),
        schedule=case.get("schedule", "GPipe"),
        profile="estimate",
    )
    # Each rank's peak tensor bytes in the steady steps, receive buffers included ([Note: pipeline buffers])
    probe = StepPeak(1, STEPS, extra=lambda trainer: stage_buffers(strategy._runner._schedules.values()))
    model, losses, metrics = fit(case, strategy, devices, devices // case["stages"], probe)
    local = {id(p) for p in strategy._params}
    params = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in local}
    held = {n: p.device.type for n, p in model.named_parameters() if id(p) not in local}  # meta: freed
    assert strategy.plan is not None
    placement = place(strategy.plan, dist.get_rank())
    return {
        "params": params,
        "losses": losses,
        "metrics": metrics,
        "plan_stages": strategy.plan.num_stages,
        "schedule": strategy.plan.schedule,
        "stages": placement.stages,
        "replica": placement.replica,
        "held_elsewhere": held,
        "peak": max(probe.peaks),
        "predicted_peak": sum(strategy.plan.stages[s].memory_bytes for s in placement.stages),
    }


def everyone_finished(case: int, devices: int) -> bool:
    """Whether every rank finished ``case`` (passed or failed) and none gave up waiting for the others."""
    if not dist.is_initialized():
        return False
    store = dist.distributed_c10d._get_default_store()
    abort = f"hf/case{case}/abort"
    try:
        store.set(f"hf/case{case}/rank{dist.get_rank()}", "done")
        store.wait([f"hf/case{case}/rank{r}" for r in range(devices)], AGREE_TIMEOUT)
        return not store.check([abort])
    except Exception:  # a rank is stuck, or gone with the store's host
        with contextlib.suppress(
            Exception
        ):  # before exiting: a rank we waited for sees it once our exit frees it
            store.set(abort, "1")
        return False


def main() -> None:
    if "LOCAL_RANK" not in os.environ and (seed := os.environ.get(CHILD_HASHSEED)):
        os.environ["PYTHONHASHSEED"] = seed  # rank 0, before Lightning's launcher starts the other ranks
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    devices = int(sys.argv[3])
    first = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    results: dict[int, Any] = {}
    for i, case in enumerate(cases[first:], first):
        try:
            results[i] = run(case, devices)
        except Exception:
            traceback.print_exc()
            results[i] = {"error": traceback.format_exc(), "grad_enabled_after": torch.is_grad_enabled()}
            # The next case starts as in a fresh process: an error inside a torch.no_grad region of a captured
            # program (a higher-order op that does not restore the mode on error) can leave autograd off.
            torch.set_grad_enabled(True)
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
        torch.save(results, out / f"rank{rank}-from{first}.pt")
        if not everyone_finished(i, devices):
            os._exit(1)
    end_job()


if __name__ == "__main__":
    main()
