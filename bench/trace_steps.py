"""Where each rank's step time goes: autopart against the hand-written pipelining script, phase by phase.

Usage: ``python bench/trace_steps.py [--batch 64] [--hidden 512] [--steps 40] [--warmup 5]``. Runs the
``autopart`` and ``manual`` workers of ``bench/strategy_vs_pipelining.py`` once each (autopart plans and saves
its plan, manual cuts there), with a tracer installed in every process: wrapped functions record
``perf_counter`` spans (the stage's forward and backward chunks, waits for peers, the optimizer step, data
loading and, under Lightning, its per-step SIGTERM broadcast and the replay of the last stage's logs). It prints
one table of milliseconds per step for each side and rank, so the time between two schedules (the first stage's
inter-step gap sits on the pipeline's critical path) can be read off and attributed.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__: list[str] = []

#: Where traced processes write their spans (set by the driver for its workers).
OUT_ENV = "AUTOPART_TRACE_DIR"

#: Spans recorded in this process: (label, start, end).
SPANS: list[tuple[str, float, float]] = []

#: Labels in table order, with what each measures.
PHASES = {
    "step": "one optimizer step, schedule start to schedule start",
    "sched": "the pipeline schedule's step()",
    "fwd": "stage forward chunks",
    "bwd": "stage backward chunks (last stage: loss backward included)",
    "wait": "waits for peers' activations / gradients",
    "gap": "from the end of one schedule to the start of the next",
    "opt": "SGD's parameter update",
    "data": "DataLoader next()",
    "sigterm": "Lightning's per-step SIGTERM broadcast",
    "replay": "autopart: last stage's loss/logs shared and self.log'ed again",
}


def _wrap(owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def traced(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPANS.append((label, start, time.perf_counter()))

    setattr(owner, name, traced)


def install(kind: str) -> None:
    """Wrap the traced functions and dump the spans to ``$AUTOPART_TRACE_DIR/{kind}_{rank}.json`` at exit."""
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage
    import torch.optim.sgd as sgd
    import torch.utils.data.dataloader as dataloader

    _wrap(sgd, "sgd", "opt")  # the update only (Lightning's SGD.step also runs the closure)
    _wrap(schedules.PipelineScheduleSingle, "step", "sched")
    _wrap(schedules, "_wait_batch_p2p", "wait")
    _wrap(stage._PipelineStageBase, "forward_one_chunk", "fwd")
    _wrap(stage._PipelineStageBase, "backward_one_chunk", "bwd")
    _wrap(dataloader._BaseDataLoaderIter, "__next__", "data")
    if kind == "autopart":
        from lightning.pytorch.loops import training_epoch_loop

        from lightning_autopart.lightning import steps

        _wrap(training_epoch_loop._TrainingEpochLoop, "_broadcast_sigterm_tensor", "sigterm")
        _wrap(steps.PipelinedSteps, "replay", "replay")
    exit_now = os._exit

    def dump(code: int = 0) -> None:  # the workers leave by os._exit
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        Path(os.environ[OUT_ENV], f"{kind}_{rank}.json").write_text(json.dumps(SPANS))
        exit_now(code)

    os._exit = dump  # type: ignore[assignment]


def per_step(spans: list[list[Any]], skip: int) -> dict[str, float]:
    """Milliseconds per step of each label over the schedules after the first ``skip``."""
    scheds = sorted((s for s in spans if s[0] == "sched"), key=lambda s: s[1])[skip:]
    first, last, n = scheds[0][1], scheds[-1][1], len(scheds) - 1
    out = {"step": (last - first) / n, "gap": sum(b[1] - a[2] for a, b in itertools.pairwise(scheds)) / n}
    for label, start, end in spans:
        if first <= start < last:
            out[label] = out.get(label, 0.0) + (end - start) / n
    return {k: 1e3 * v for k, v in out.items()}


def table(rows: dict[str, dict[str, float]]) -> str:
    """A markdown table: one column per side and rank, one row per phase."""
    names = list(rows)
    lines = ["| ms per step | " + " | ".join(names) + " | what |", "|---|" + "---:|" * len(names) + "---|"]
    for phase, what in PHASES.items():
        cells = [f"{rows[n][phase]:.2f}" if phase in rows[n] else "-" for n in names]
        lines.append(f"| {phase} | " + " | ".join(cells) + f" | {what} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--with-runner", action="store_true", help="also trace PipelineRunner without Lightning"
    )
    args, rest = parser.parse_known_args()
    if "--worker" in rest:  # a traced worker: install the tracer, then run the benchmark's worker
        install(rest[rest.index("--worker") + 1])
        import strategy_vs_pipelining as bench

        sys.argv = [sys.argv[0], *rest, *_timing(args)]
        bench.main()
        return
    import strategy_vs_pipelining as bench

    out = tempfile.mkdtemp(prefix="autopart_trace_")
    os.environ[OUT_ENV] = out
    plan = str(Path(out, "plan.json"))
    here = [sys.executable, __file__, *_timing(args)]
    bench.launch([*here, "--worker", "autopart", "--plan", plan])
    bench.common.HIDDEN = args.hidden
    cut = bench.cut_from_plan(plan)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
    ]
    sides = {"manual": ["--cut", str(cut)]} | ({"runner": ["--plan", plan]} if args.with_runner else {})
    for kind, extra in sides.items():
        bench.launch([*torchrun, f"--master_port={bench._port()}", *here[1:], "--worker", kind, *extra])
    rows = {}
    for kind in [*sides, "autopart"]:
        for rank in (0, 1):
            spans = json.loads(Path(out, f"{kind}_{rank}.json").read_text())
            rows[f"{kind} rank {rank}"] = per_step(spans, skip=args.warmup)
    print(
        f"MLP 9 x Linear({args.hidden}), batch {args.batch}, {bench.MICRO_BATCHES} micro-batches, "
        f"{bench.SCHEDULE}, cut after leaf module {cut}; {args.steps} steps after {args.warmup} warm-up\n"
    )
    print(table(rows))
    ratio = statistics.mean(
        rows[f"manual rank {r}"]["step"] / rows[f"autopart rank {r}"]["step"] for r in (0, 1)
    )
    print(f"\nthroughput autopart / manual in this pair of traced runs: {ratio:.3f}")


def _timing(args: argparse.Namespace) -> list[str]:
    sizes = ["--batch", str(args.batch), "--hidden", str(args.hidden)]
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), *sizes]


if __name__ == "__main__":
    main()
