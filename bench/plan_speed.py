"""Planner speed: ``partition`` on synthetic transformer-like profiles; prints a markdown table to stdout.

Usage: ``python bench/plan_speed.py [--repeats 3] [--quick]``. The profile is a GPT-like stack (hidden 2048,
sequence 2048, Adam, float32 states): a big embedding first, ``layers`` identical layers, a tied output head last,
on an A100-40GB-like cluster of 8-device nodes. Each row reports the median wall time of ``repeats`` runs and
the search statistics of the last one, plus the baseline partitioners scored with the same cost model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_autopart.cluster import Cluster
from lightning_autopart.partition import evaluate, partition
from lightning_autopart.partition.heuristics import (
    deepspeed_parameters,
    deepspeed_uniform,
    torchgpipe_balance_by_time,
)
from lightning_autopart.profile.records import BlockProfile, ModelProfile, TiedParam

__all__ = ["transformer_profile"]


def transformer_profile(layers: int, hidden: int = 2048, seq: int = 2048, vocab: int = 50257) -> ModelProfile:
    """A GPT-like profile with ``layers + 2`` blocks at batch 1 (embedding, layers, tied head)."""
    flops_per_s = 312e12 * 0.6
    h = hidden

    def block(name: str, params: int, fwd_flops: float, act: int, cut: int, fixed: float) -> BlockProfile:
        fwd = fwd_flops / flops_per_s * 1e6 + fixed
        return BlockProfile(
            name=name,
            modules=(name,),
            param_shapes=((f"{name}.weight", (params,)),),
            param_count=params,
            param_bytes=4 * params,
            grad_bytes=4 * params,
            optimizer_bytes=8 * params,
            buffer_bytes=0,
            fwd_us=fwd,
            bwd_us=2 * (fwd - fixed) + 2 * fixed,
            fwd_fixed_us=fixed,
            bwd_fixed_us=2 * fixed,
            activation_bytes=act,
            cut_bytes=cut,
            fwd_flops=fwd_flops,
            accumulate_us=3 * 4 * params / 1.555e12 / 0.8 * 1e6,  # [Note: gradient accumulation], A100-40GB
        )

    cut = 2 * seq * h
    layer_params = 12 * h * h
    layer_flops = 2 * layer_params * seq + 4 * seq * seq * h
    layer_act = seq * h * (34 + 5 * 16 * seq // h)
    blocks = [block("embed", vocab * h, 2.0 * seq * h, cut, cut, 20.0)]
    blocks += [block(f"layers.{i}", layer_params, layer_flops, layer_act, cut, 30.0) for i in range(layers)]
    head = block("head", 0, 2.0 * vocab * h * seq, 4 * seq * vocab, 4, 20.0)
    blocks.append(head)
    return ModelProfile(
        model=f"GPT{layers}",
        blocks=tuple(blocks),
        batch_size=1,
        input_bytes=8 * seq,
        tied=(TiedParam("embed.weight", 4 * vocab * h, (0, layers + 1)),),
        optimizer="adam",
        dtype="float32",
    )


def _cluster(devices: int) -> Cluster:
    nodes = max(1, devices // 8)
    return Cluster.from_spec("a100-40gb", devices=min(8, devices), nodes=nodes)


def main() -> None:
    """Run the benchmark rows and print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="only the 1,000-block / 1,024-device row")
    args = ap.parse_args()
    rows = (
        [(1000, 1024, 2048)]
        if args.quick
        else [
            (100, 64, 512),
            (100, 256, 512),
            (300, 256, 1024),
            (300, 1024, 2048),
            (1000, 256, 512),
            (1000, 1024, 2048),
        ]
    )
    print(
        "| blocks | devices | batch | seconds (median) | configs | DP runs | pruned (bound / relax) "
        "| plan (S x r, M, schedule) | step s | uniform | parameters | by-time |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for layers, devices, batch in rows:
        prof = transformer_profile(layers - 2)
        cl = _cluster(devices)
        times = []
        plan = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan = partition(prof, cl, batch)
            times.append(time.perf_counter() - t0)
        assert plan is not None
        st = plan.notes["search"]
        s = len(plan.stages) // plan.chunks_per_rank
        base = []
        for fn in (deepspeed_uniform, deepspeed_parameters, torchgpipe_balance_by_time):
            ev = evaluate(
                prof, cl, batch, fn(prof, len(plan.stages)), plan.replicas, plan.micro_batches, plan.schedule
            )
            base.append("OOM" if ev is None else f"{ev.step_us / 1e6:.3f}")
        print(
            f"| {prof.num_blocks} | {devices} | {batch} | {statistics.median(times):.3f} | {st['configs']} "
            f"| {st['dp_runs']} | {st['pruned_by_bound']} / {st['pruned_by_relaxation']} "
            f"| {s} x {plan.replicas}, {plan.micro_batches}, {plan.schedule} "
            f"| {plan.prediction.step_us / 1e6:.3f} | {base[0]} | {base[1]} | {base[2]} |"
        )


if __name__ == "__main__":
    main()
