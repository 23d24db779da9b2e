"""Throughput of autopart with a forced 2-stage plan against a hand-written torch.distributed.pipelining script.

Usage: ``python bench/strategy_vs_pipelining.py [--rounds 3] [--steps 30] [--warmup 5] [--batch 64]
[--fidelity N]``. Both
sides train the MLP of ``bench/strategy_vs_ddp.py`` on 2 CPU processes (gloo, 1 thread each) with the same
batch, 4 micro-batches, 1F1B and SGD. autopart runs under Lightning (``python ... --worker autopart``, ``devices=2``,
``num_stages=2``) and saves its plan; the manual side (``torchrun --nproc_per_node=2 ... --worker manual``) cuts
the same model where that plan cut it, wraps each half in a ``PipelineStage`` and loops
``Schedule1F1B.step`` + ``SGD.step``, reading batches through the same ``DataLoader`` as the Lightning side
(``--sliced-data``: slices of the whole tensors instead). Runs alternate; the driver prints every round, the medians, the ratio
autopart / manual and the measured step time of autopart against the plan's predicted step time. Measured
profiles vary from run to run, so only the first autopart run plans (``profile="measure"``) and saves the plan;
later autopart runs load it (``load_plan``): every run has the same cut. ``--fidelity N`` adds N autopart runs
that each plan afresh and compares each run's step time with its own plan's prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

import strategy_vs_ddp as common
from strategy_vs_ddp import LAYERS, MLP, dataset, launch, median_table, train

__all__: list[str] = []

#: Micro-batches and schedule of both sides.
MICRO_BATCHES, SCHEDULE = 4, "1F1B"


def leaf_names(model: nn.Module) -> list[str]:
    """The FQNs of ``model``'s leaf modules in forward order (the MLP's forward follows registration order)."""
    return [name for name, m in model.named_modules() if name and not list(m.children())]


def cut_from_plan(path: str) -> int:
    """How many leaf modules of :class:`MLP` the plan's first stage holds (the plan names them ``model.*``)."""
    plan = json.loads(Path(path).read_text())
    first = plan["stages"][0]["modules"]
    leaves = [f"model.{n}" for n in leaf_names(MLP())]
    held = [n for n in leaves if any(n == m or n.startswith(m + ".") for m in first)]
    if held != leaves[: len(held)]:
        raise RuntimeError(f"stage 0 of the plan is not a prefix of the model: {first}")
    if not 0 < len(held) < len(leaves):
        raise RuntimeError(f"the plan's first stage holds {len(held)} of {len(leaves)} leaf modules: {first}")
    return len(held)


def _autopart(warmup: int, steps: int, plan_path: str, load: bool) -> None:
    from lightning_autopart import AutoPartitionStrategy

    files = {"load_plan": plan_path} if load else {"save_plan": plan_path}
    strategy = AutoPartitionStrategy(num_stages=2, micro_batches=MICRO_BATCHES, schedule=SCHEDULE, **files)
    trainer, timer = train(strategy, warmup, steps)
    if trainer.is_global_zero:
        plan = strategy.plan
        assert plan is not None and plan.num_stages == 2 and plan.micro_batches == MICRO_BATCHES
        samples = steps * common.BATCH * plan.replicas
        result = {
            "samples_per_s": samples / timer.elapsed,
            "step_s": timer.elapsed / steps,
            "predicted_step_s": plan.prediction.step_us / 1e6,
            "schedule": plan.schedule,
            "cut": [list(s.blocks) for s in plan.stages],
            "prediction": dataclasses.asdict(plan.prediction),
            "stages_us": [(s.fwd_us, s.bwd_us, s.p2p_us, s.optimizer_us) for s in plan.stages],
        }
        print("RESULT " + json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def batches(batch: int, count: int, sliced: bool) -> Iterator[list[torch.Tensor]]:
    """``count`` batches of the benchmark's data: through the same ``DataLoader`` as the Lightning side, or
    (``sliced``) as slices of the whole tensors, which skips the per-sample loading a real script pays."""
    data = dataset(batch * count)
    if sliced:
        for i in range(count):
            yield [t[i * batch : (i + 1) * batch] for t in data.tensors]
    else:
        yield from DataLoader(data, batch_size=batch, drop_last=True)


def _manual(warmup: int, steps: int, cut: int, sliced: bool) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights as LitMLP
    model = MLP()
    leaves = [model.get_submodule(n) for n in leaf_names(model)]
    module = nn.Sequential(*(leaves[:cut] if rank == 0 else leaves[cut:]))
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    batch = common.BATCH
    start = 0.0
    gc.collect()  # as the Lightning side's Timer does (``strategy_vs_ddp.Timer``)
    for i, (x, y) in enumerate(batches(batch, warmup + steps, sliced)):
        if i == warmup:
            start = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
        optimizer.step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print("RESULT " + json.dumps({"samples_per_s": steps * batch / elapsed, "step_s": elapsed / steps}))
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _runner(warmup: int, steps: int, plan_path: str, sliced: bool) -> None:
    """autopart's runtime without Lightning: ``PipelineRunner`` on the saved plan, in the manual script's loop."""
    from lightning_autopart.capture import capture
    from lightning_autopart.plan import Plan
    from lightning_autopart.runtime.runner import PipelineRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = Plan.load(plan_path)
    torch.manual_seed(0)
    model = MLP()
    captured = capture(model, ((torch.randn(plan.micro_batch_size, common.HIDDEN),), {}), max_blocks=64)
    runner = PipelineRunner(plan, captured, rank, "cpu", F.mse_loss)
    params = [p for m in runner.modules.values() for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    start = 0.0
    gc.collect()  # as the Lightning side's Timer does (``strategy_vs_ddp.Timer``)
    for i, (x, y) in enumerate(batches(plan.batch_size, warmup + steps, sliced)):
        if i == warmup:
            start = time.perf_counter()
        optimizer.zero_grad()
        runner.step(x if runner.is_first else None, y if runner.is_last else None)
        optimizer.step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        samples = steps * plan.batch_size
        print("RESULT " + json.dumps({"samples_per_s": samples / elapsed, "step_s": elapsed / steps}))
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", choices=["autopart", "manual", "runner"])
    parser.add_argument(
        "--with-runner",
        action="store_true",
        help="also time PipelineRunner alone (autopart without Lightning)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--plan", default="/tmp/autopart_bench_plan.json")
    parser.add_argument("--load", action="store_true", help="autopart: run the plan at --plan")
    parser.add_argument("--cut", type=int, default=0)
    parser.add_argument("--batch", type=int, default=common.BATCH, help="samples per step (one pipeline)")
    parser.add_argument("--hidden", type=int, default=common.HIDDEN, help="width of the MLP's layers")
    parser.add_argument(
        "--fidelity",
        type=int,
        default=0,
        help="then N more autopart runs that each plan afresh: measured / predicted step time per run",
    )
    parser.add_argument(
        "--sliced-data",
        action="store_true",
        help="manual and runner sides slice whole tensors instead of using the Lightning side's DataLoader",
    )
    args = parser.parse_args()
    common.BATCH = args.batch
    common.HIDDEN = args.hidden
    if args.worker == "autopart":
        _autopart(args.warmup, args.steps, args.plan, args.load)
    if args.worker == "manual":
        _manual(args.warmup, args.steps, args.cut, args.sliced_data)
    if args.worker == "runner":
        _runner(args.warmup, args.steps, args.plan, args.sliced_data)
    timing = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    timing += ["--sliced-data"] if args.sliced_data else []
    timing += ["--hidden", str(args.hidden)]
    results: dict[str, list[dict[str, Any]]] = {"manual": [], "autopart": [], "runner": []}
    cut = 0
    for r in range(args.rounds):
        order = ["autopart", "manual"] if r % 2 == 0 else ["manual", "autopart"]
        if r == 0:
            order = ["autopart", "manual"]  # the manual side needs the plan's cut
        if args.with_runner:
            order.insert(1, "runner")
        for kind in order:
            if kind == "autopart":
                # Measured profiles vary from run to run: plan once, then every run uses that plan's cut.
                load = ["--load"] if results["autopart"] else []
                cmd = [sys.executable, __file__, "--worker", kind, "--plan", args.plan, *load, *timing]
            else:
                cut = cut or cut_from_plan(args.plan)
                extra = ["--plan", args.plan] if kind == "runner" else ["--cut", str(cut)]
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node=2",
                    "--master_addr=127.0.0.1",
                    f"--master_port={_port()}",
                    __file__,
                    "--worker",
                    kind,
                    *extra,
                    *timing,
                ]
            result = launch(cmd)
            results[kind].append(result)
            print(f"round {r + 1} {kind}: {result['samples_per_s']:.1f} samples/s", file=sys.stderr)
    first = results["autopart"][0]
    loading = "sliced tensors" if args.sliced_data else "the same DataLoader"
    print(
        f"manual/runner data: {loading}; "
        f"MLP {LAYERS + 1} x Linear({common.HIDDEN}), batch {args.batch}, {MICRO_BATCHES} micro-batches, {first['schedule']}, "
        f"2 stages (cut after leaf module {cut}: {first['cut'][0][-1]} | {first['cut'][1][0]}), 2 processes x "
        f"1 thread, gloo, {args.steps} timed steps after {args.warmup} warm-up, {args.rounds} interleaved rounds\n"
    )
    print(median_table(results, "manual", "autopart"))
    if args.with_runner:
        print("\n" + median_table(results, "manual", "runner"))
    measured = statistics.median(r["step_s"] for r in results["autopart"])
    predicted = first["predicted_step_s"]
    print(
        f"\nautopart step time: measured {measured * 1e3:.1f} ms (median), plan predicted "
        f"{predicted * 1e3:.1f} ms: measured / predicted = **{measured / predicted:.2f}**"
    )
    parts = {k: round(v / 1e3, 2) for k, v in first["prediction"].items() if k.endswith("_us")}
    stages = [[round(x / 1e3, 2) for x in s] for s in first["stages_us"]]
    print(f"predicted parts (ms): {parts}; per stage (fwd, bwd, p2p per micro-batch; optimizer): {stages}")
    if args.fidelity:
        _fidelity(args.fidelity, args.plan + ".fidelity", timing)


def _fidelity(runs: int, plan: str, timing: list[str]) -> None:
    """``runs`` autopart runs that each profile, probe and plan, then train: each run's measured step time
    against its own plan's prediction (the plan and the training see the machine in the same state)."""
    ratios = []
    for i in range(runs):
        result = launch([sys.executable, __file__, "--worker", "autopart", "--plan", plan, *timing])
        ratio = result["step_s"] / result["predicted_step_s"]
        ratios.append(ratio)
        predicted = result["prediction"]
        parts = ", ".join(f"{predicted[k] / 1e3:.1f}" for k in ("compute_us", "bubble_us", "host_us"))
        print(
            f"fidelity run {i + 1}: measured {result['step_s'] * 1e3:.1f} ms, predicted "
            f"{result['predicted_step_s'] * 1e3:.1f} ms: {ratio:.2f} (its compute, bubble, host: {parts} ms)",
            file=sys.stderr,
        )
    listed = ", ".join(f"{r:.2f}" for r in ratios)
    print(
        f"\nplanned afresh in each of {runs} runs, measured / predicted: {listed}; median "
        f"**{statistics.median(ratios):.2f}**, range {min(ratios):.2f}-{max(ratios):.2f}"
    )


def _port() -> int:
    from strategy_vs_ddp import _free_port

    return _free_port()


if __name__ == "__main__":
    main()
