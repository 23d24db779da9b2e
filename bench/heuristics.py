"""Plan quality: autopart's partition against DeepSpeed's and torchgpipe's balancing rules, on uneven models.

Every model is built on the meta device, captured and profiled with the roofline estimate of a named device,
then planned. Each heuristic re-cuts the model into the same number of (virtual) stages and is scored with the
planner's own cost model under the plan's configuration (replicas, micro-batches, schedule, layout), so the
only difference is where the cuts are. Prints a markdown table (predicted step time; lower is better).

Run: python bench/heuristics.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT
from examples.mlp import UnevenMLP
from examples.resnet import ResNet
from lightning_autopart.capture import capture
from lightning_autopart.cluster import Cluster
from lightning_autopart.partition import partition
from lightning_autopart.partition.heuristics import (
    deepspeed_parameters,
    deepspeed_uniform,
    torchgpipe_balance_by_time,
)
from lightning_autopart.partition.scoring import evaluate
from lightning_autopart.profile import profile
from lightning_autopart.profile.records import ModelProfile


@dataclass(frozen=True)
class Case:
    """One benchmark: a model factory, the cluster and the global batch."""

    name: str
    build: Callable[[], nn.Module]
    spec: str
    devices: int
    nodes: int
    batch_size: int
    optimizer: str
    #: Pipeline depths to force in addition to the planner's free choice (heuristics only make sense with S > 1).
    forced_stages: tuple[int, ...]


CASES = (
    Case(
        "GPT-xl (vocab 50257, tied head)",
        lambda: GPT.from_preset("xl"),
        "a100-40gb",
        8,
        2,
        512,
        "adam",
        (4, 8),
    ),
    Case("ResNet-152x8 (3.7B)", lambda: ResNet(152, 8), "v100-32gb", 8, 4, 1024, "sgd_momentum", (4, 8)),
    Case("Uneven MLP", lambda: UnevenMLP(), "v100-32gb", 8, 1, 1024, "adam", (3, 4, 8)),
)

HEURISTICS: dict[str, Callable[[ModelProfile, int], list[int]]] = {
    "DeepSpeed parameters": deepspeed_parameters,
    "DeepSpeed uniform": deepspeed_uniform,
    "torchgpipe balance_by_time": torchgpipe_balance_by_time,
}


def _profile(case: Case) -> ModelProfile:
    with torch.device("meta"):
        model = case.build()
        example = model.example_input_array  # type: ignore[attr-defined]
    captured = capture(model, example)
    return profile(captured, "estimate", spec=case.spec, optimizer=case.optimizer)


def _ms(us: float | None) -> str:
    return "does not fit" if us is None else f"{us / 1e3:.1f} ms"


def main() -> None:
    """Print one table row per (model, forced pipeline depth)."""
    print("| model | cluster | plan (S x r, M, schedule) | autopart | " + " | ".join(HEURISTICS) + " |")
    print("|---|---|---|---|" + "---|" * len(HEURISTICS))
    for case in CASES:
        t0 = time.perf_counter()
        prof = _profile(case)
        cluster = Cluster.from_spec(case.spec, devices=case.devices, nodes=case.nodes)
        for forced in (None, *case.forced_stages):
            plan = partition(prof, cluster, case.batch_size, num_stages=forced)
            cells = []
            for rule in HEURISTICS.values():
                v = plan.num_stages
                ev = evaluate(
                    prof,
                    cluster,
                    case.batch_size,
                    rule(prof, v),
                    plan.replicas,
                    plan.micro_batches,
                    plan.schedule,
                    plan.layout,
                )
                if ev is None or not ev.fits:
                    cells.append("does not fit")
                else:
                    cells.append(f"{_ms(ev.step_us)} ({ev.step_us / plan.prediction.step_us:.2f}x)")
            depth = plan.num_stages // plan.chunks_per_rank
            label = f"{depth} x {plan.replicas}, M={plan.micro_batches}, {plan.schedule}"
            label += "" if forced is None else " (S forced)"
            where = f"{case.nodes}x{case.devices} {case.spec}, batch {case.batch_size}, {case.optimizer}"
            print(
                f"| {case.name} | {where} | {label} | {_ms(plan.prediction.step_us)} | "
                + " | ".join(cells)
                + " |"
            )
        print(f"<!-- {case.name}: capture+profile+plans in {time.perf_counter() - t0:.1f} s -->")


if __name__ == "__main__":
    main()
