"""A torchrun worker for the log channel: 2 stages x 2 replicas; each pipeline's last stage shares a step
sequence whose logged names change, then every stage gathers what its gradient hooks logged (while the last
message is still in flight on the same group). Rank r writes ``OUT/rank{r}.pt``: the (loss, records) it
received per step, the records gathered per call, and the timeout of every group it is in (the channel's, the
runtime's), the job's being :data:`TIMEOUT`.

Usage: ``python -m torch.distributed.run --nproc_per_node=4 tests/distributed/_channel_worker.py OUT``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.grad_logs import GradientLogs
from lightning_autopart.lightning.hooks import LogRecord
from lightning_autopart.lightning.log_channel import open_log_channel
from lightning_autopart.runtime.topology import build_groups, place
from tests.distributed.job import end_job
from tests.pipeline_plans import make_plan

__all__ = ["TIMEOUT", "gradient_logs", "steps"]

#: The job's timeout (``init_process_group``): every group autopart creates must take it, not torch's 30 minutes.
TIMEOUT = timedelta(seconds=41)


def steps(replica: int) -> list[tuple[str, float | None, list[LogRecord]]]:
    """The (kind, loss, records) a pipeline's last stage shares, step by step; values depend on the replica."""
    r = float(replica)
    loss = LogRecord("loss", torch.tensor(1.25 + r), {"prog_bar": True, "sync_dist": True})
    return [
        ("training_step", 0.5 + r, [loss]),
        ("training_step", 0.25 + r, [LogRecord("loss", torch.tensor(2.5 + r), loss.kwargs)]),
        ("training_step", 0.125, [loss, LogRecord("odd", 3 + replica, {}), LogRecord("f", 0.75, {})]),
        ("validation_step", None, [LogRecord("val", torch.tensor(7.0 + r, dtype=torch.bfloat16), {})]),
        ("training_step", 1.0 + r, [loss, LogRecord("odd", 5, {}), LogRecord("f", 1.5 + r, {})]),
        ("validation_step", None, [LogRecord("val", torch.tensor(8.0, dtype=torch.bfloat16), {})]),
        ("training_step", 2.0, []),
        ("training_step", 3.0, [LogRecord("vec", torch.arange(3, dtype=torch.int64) + replica, {})]),
        # what a step returns beside its loss: objects travel in the layout (the second step reuses it, the third
        # has a new value, so a new layout)
        *[
            ("training_step", 4.0, [loss, LogRecord("ids", ids, {"autopart_output": True})])
            for ids in ([1, 2 + replica], [1, 2 + replica], ["a", replica])
        ],
    ]


def gradient_logs(stage: int) -> list[list[LogRecord]]:
    """What a stage's gradient hooks log, call by call: layouts new, known, empty on one stage, known again."""
    s = float(stage)
    return [
        [LogRecord(f"w{stage}", torch.tensor(0.5 + s), {}), LogRecord("lr", 0.1, {"prog_bar": True})],
        [LogRecord(f"w{stage}", torch.tensor(1.5 + s), {}), LogRecord("lr", 0.2, {"prog_bar": True})],
        [] if stage else [LogRecord("only0", torch.arange(4.0), {"on_epoch": True})],
        [LogRecord(f"w{stage}", torch.tensor(2.5 + s), {}), LogRecord("lr", 0.3, {"prog_bar": True})],
        [LogRecord("n", 7 + stage, {}), LogRecord("b", torch.tensor([1.0 + s], dtype=torch.bfloat16), {})],
        [LogRecord("n", 9 + stage, {}), LogRecord("b", torch.tensor([2.0 - s], dtype=torch.bfloat16), {})],
    ]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    plan = make_plan(4, 2, 2)
    channel = open_log_channel(plan, rank)
    replica = next(i for i, r in enumerate(plan.stages[-1].ranks) if channel.src == r)
    got: list[Any] = []
    for i, (kind, loss, records) in enumerate(steps(replica)):
        if i % 2:
            channel.expect(kind)  # receivers may post the receive early (steps do), or not
        if channel.is_src:
            got.append(channel.share(kind, None if loss is None else torch.tensor(loss), records))
        else:
            got.append(channel.share(kind, None, []))
    placement = place(plan, rank)
    logs = GradientLogs.of(channel, placement, plan)
    gathered = [logs.gather("on_after_backward", records) for records in gradient_logs(placement.pp_rank)]
    channel.wait()
    groups = [channel.group, *build_groups(plan, [("tie", (0, 1))]).values()]
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout for g in groups if g is not None]
    torch.save({"replica": replica, "got": got, "gathered": gathered, "timeouts": timeouts}, out / f"rank{rank}.pt")
    end_job()


if __name__ == "__main__":
    main()
