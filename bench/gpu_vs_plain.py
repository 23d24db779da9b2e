"""One GPU: autopart with a 1-stage plan against Lightning's default strategy, throughput and peak memory.

Usage: ``python bench/gpu_vs_plain.py [--rounds 3] [--steps 20] [--warmup 5] [--micro-batches 1 4] [--cases ...]
[--json out.json]``; a smoke test without a GPU: ``python bench/gpu_vs_plain.py --accelerator cpu --tiny``.

Each case trains one of the examples' models for ``warmup + steps + 1`` optimizer steps, once per side per
round, in one process: ``Trainer(accelerator=..., devices=1)`` with ``strategy="auto"`` (plain) or
``AutoPartitionStrategy(num_stages=1, micro_batches=m)`` (autopart), each with a fresh model, strategy and
Trainer; the order alternates between rounds (plain first in odd rounds). Both sides read the same few
pre-generated batches from the CPU (so data generation costs neither side), SGD, no logger, no checkpoints.

After ``warmup`` steps a callback synchronises the device, resets the peak-memory statistics and records an
event at the start of every step (a CUDA event on a GPU, ``perf_counter`` on the CPU; events cost no host
sync); at the start of step ``warmup + steps`` it synchronises again. A step's time is the interval between two
step starts, so Lightning's whole per-step work counts. samples/s = batch / the median step time over every
round's steady steps; the ratio is autopart / plain (goal >= 0.98). Peak memory is
``torch.cuda.max_memory_allocated()`` over the steady steps, less what was allocated before the fit (what CUDA
keeps for the process, made by a warm-up before the first run; the previous runs are freed), median over
rounds; the ratio is autopart / plain (goal <= 1.03). On the CPU memory is not measured.

The driver prints a markdown table (device name, torch and Lightning versions, settings in its header) and,
per case, every round's samples/s with ``strategy_vs_ddp.median_table``; ``--json`` also writes every step
time of every run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from strategy_vs_ddp import median_table  # noqa: E402

from examples.data import SyntheticImages, SyntheticRegression, SyntheticTokens  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from examples.resnet import ResNet  # noqa: E402
from examples.tutorial import Net  # noqa: E402

__all__ = ["CASES", "TINY", "BenchCase", "StepClock", "main", "run_side", "warm_up_cuda"]

#: Goals of the ratios autopart / plain.
SPEED_GOAL, MEMORY_GOAL = 0.98, 1.03
#: Distinct batches each run cycles through.
POOL = 4


@dataclass(frozen=True)
class BenchCase:
    """A model, its data and its batch: ``model()`` builds the LightningModule, ``data(n)`` ``n`` samples."""

    name: str
    model: Callable[[], L.LightningModule]
    data: Callable[[int], Dataset[Any]]
    batch: int
    precision: str = "32-true"


def _tutorial(hidden: int, layers: int, batch: int, precision: str = "32-true") -> BenchCase:
    return BenchCase(
        f"tutorial Net({hidden}, {layers})",
        lambda: Net(hidden, layers, lr=0.01, batch_size=batch),
        lambda n: SyntheticRegression(n, hidden, seed=0),
        batch,
        precision,
    )


def _gpt(preset: str, batch: int, precision: str, **overrides: Any) -> BenchCase:
    config = {**_gpt_presets()[preset], **overrides}
    return BenchCase(
        f"GPT {preset} (d{config['d_model']} x {config['n_layers']}, seq {config['seq_len']})",
        lambda: GPT(**config, lr=0.01, batch_size=batch),
        lambda n: SyntheticTokens(n, config["seq_len"], config["vocab_size"], seed=0),
        batch,
        precision,
    )


def _gpt_presets() -> dict[str, dict[str, int]]:
    from examples.gpt import PRESETS

    return PRESETS


def _resnet(depth: int, image: int, classes: int, batch: int, precision: str) -> BenchCase:
    return BenchCase(
        f"ResNet-{depth} ({image}px)",
        lambda: ResNet(depth, 1, num_classes=classes, image_size=image, lr=0.01, batch_size=batch),
        lambda n: SyntheticImages(n, size=image, classes=classes, seed=0),
        batch,
        precision,
    )


#: The GPU cases: the RaNNC tutorial model at 600M parameters (float32 and bf16-mixed), the seed's 2.5B one,
#: GPT-2 small (124M, tied head), ResNet-50.
CASES: dict[str, BenchCase] = {
    "tutorial": _tutorial(5000, 24, 512),
    "tutorial-bf16": _tutorial(5000, 24, 512, "bf16-mixed"),
    "seed": _tutorial(5000, 100, 64),
    "gpt2-small": _gpt("small", 8, "bf16-mixed"),
    "resnet50": _resnet(50, 224, 1000, 64, "bf16-mixed"),
}

#: ``--tiny``: the same kinds of models, small enough for a CPU smoke test.
TINY: dict[str, BenchCase] = {
    "tutorial": _tutorial(256, 4, 32),
    "tutorial-bf16": _tutorial(256, 4, 32, "bf16-mixed"),
    "seed": _tutorial(128, 10, 16),
    "gpt2-small": _gpt("tiny", 4, "bf16-mixed"),
    "resnet50": _resnet(26, 32, 10, 8, "32-true"),
}


class _Batches(Dataset[Any]):
    """``length`` items cycling through ``POOL`` pre-collated batches (one item is a whole batch)."""

    def __init__(self, data: Dataset[Any], batch: int, length: int) -> None:
        loader = DataLoader(data, batch_size=batch, drop_last=True)
        self.pool = [b for b, _ in zip(loader, range(POOL), strict=False)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.pool[index % len(self.pool)]


class StepClock(L.Callback):
    """Times steps ``warmup`` .. ``warmup + steps - 1`` from one step start to the next (see the module doc)."""

    def __init__(self, warmup: int, steps: int, cuda: bool) -> None:
        self.warmup, self.steps, self.cuda = warmup, steps, cuda
        self.marks: list[Any] = []
        self.window_s = 0.0
        self.peak = 0
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.warmup <= batch_idx <= self.warmup + self.steps:
            return
        last = batch_idx == self.warmup + self.steps
        if self.cuda and batch_idx == self.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        if batch_idx == self.warmup:
            self._start = time.perf_counter()
        if last:
            if self.cuda:
                torch.cuda.synchronize()
                self.peak = torch.cuda.max_memory_allocated()
            self.window_s = time.perf_counter() - self._start

    def step_seconds(self) -> list[float]:
        """Seconds of every timed step (call after the window closed)."""
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


@dataclass
class Run:
    """One side's run of one case: step seconds, window seconds, peak bytes above the pre-fit allocation."""

    side: str
    steps_s: list[float]
    window_s: float
    peak: int
    samples_per_s: float = field(default=0.0)


def _strategy(side: str, micro_batches: int, profile: str) -> Any:
    if side == "plain":
        return "auto"
    from lightning_autopart import AutoPartitionStrategy

    return AutoPartitionStrategy(num_stages=1, micro_batches=micro_batches, profile=profile)


def run_side(
    case: BenchCase,
    side: str,
    data: Dataset[Any],
    *,
    accelerator: str,
    micro_batches: int,
    warmup: int,
    steps: int,
    profile: str = "measure",
) -> Run:
    """Fit ``case`` with one side's strategy for ``warmup + steps + 1`` steps; everything freed afterwards."""
    cuda = accelerator == "gpu"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    model = case.model()
    clock = StepClock(warmup, steps, cuda)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=_strategy(side, micro_batches, profile),
        precision=case.precision,  # type: ignore[arg-type]
        max_steps=warmup + steps + 1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(model, DataLoader(data, batch_size=None, shuffle=False))
    seconds = clock.step_seconds()
    if len(seconds) != steps:
        raise RuntimeError(f"{case.name} ({side}) timed {len(seconds)} steps, expected {steps}")
    run = Run(side, seconds, clock.window_s, max(clock.peak - before, 0) if cuda else 0)
    run.samples_per_s = case.batch / statistics.median(seconds)
    del trainer, model, clock
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return run


def warm_up_cuda() -> None:
    """Make what CUDA keeps for the whole process before any run is measured: the cuBLAS/cuBLASLt handles and
    workspaces of this thread (forward) and of autograd's device thread (backward), in float32 and under
    bfloat16 autocast. Made during the first run, they would count in its peak memory alone."""
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    b = torch.randn(64, device="cuda", requires_grad=True)
    torch.nn.functional.linear(x, w, b).sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = torch.nn.functional.linear(x, w, b)
    out.float().sum().backward()
    torch.cuda.synchronize()


def _set_rendezvous() -> None:
    """autopart opens a process group even for one device: a local address and a free port."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _device_name(accelerator: str) -> str:
    if accelerator == "gpu":
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _summary(case: BenchCase, m: int, runs: dict[str, list[Run]], cuda: bool) -> dict[str, Any]:
    step = {side: statistics.median(s for r in rs for s in r.steps_s) for side, rs in runs.items()}
    speed = {side: case.batch / t for side, t in step.items()}
    row: dict[str, Any] = {
        "case": case.name,
        "precision": case.precision,
        "batch": case.batch,
        "micro_batches": m,
        "plain_samples_per_s": speed["plain"],
        "autopart_samples_per_s": speed["autopart"],
        "speed_ratio": speed["autopart"] / speed["plain"],
        "per_round_ratios": [
            a.samples_per_s / p.samples_per_s for p, a in zip(runs["plain"], runs["autopart"], strict=True)
        ],
    }
    if cuda:
        peak = {side: statistics.median(r.peak for r in rs) for side, rs in runs.items()}
        row.update(plain_peak=peak["plain"], autopart_peak=peak["autopart"])
        row["memory_ratio"] = peak["autopart"] / peak["plain"] if peak["plain"] else float("nan")
    row["runs"] = {side: [asdict(r) for r in rs] for side, rs in runs.items()}
    return row


def _table(rows: list[dict[str, Any]], cuda: bool) -> str:
    lines = [
        "| case | precision | batch | micro-batches | plain samples/s | autopart samples/s | ratio (>= 0.98) "
        "| plain peak | autopart peak | ratio (<= 1.03) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speed = f"**{r['speed_ratio']:.3f}**" + ("" if r["speed_ratio"] >= SPEED_GOAL else " (not met)")
        memory = ["-", "-", "-"]
        if cuda:
            mark = "" if r["memory_ratio"] <= MEMORY_GOAL else " (not met)"
            memory = [_gib(r["plain_peak"]), _gib(r["autopart_peak"]), f"**{r['memory_ratio']:.3f}**{mark}"]
        lines.append(
            f"| {r['case']} | {r['precision']} | {r['batch']} | {r['micro_batches']} "
            f"| {r['plain_samples_per_s']:.1f} | {r['autopart_samples_per_s']:.1f} | {speed} | "
            + " | ".join(memory)
            + " |"
        )
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--tiny", action="store_true", help="small models (a CPU smoke test)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument(
        "--micro-batches", nargs="+", type=int, default=[1], help="autopart's m, one row each"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument(
        "--profile", choices=["measure", "estimate"], default="measure", help="autopart's profiler"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run's step times here")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --accelerator cpu (with --tiny for a quick run)")
    if min(args.rounds, args.steps, args.warmup, *args.micro_batches) < 1:
        parser.error("--rounds, --steps, --warmup and --micro-batches must be at least 1")
    _set_rendezvous()
    warnings.filterwarnings("ignore", module=r"lightning\.")  # Lightning's tips; autopart's warnings stay
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_autopart"):
        logging.getLogger(name).setLevel(logging.ERROR)
    cuda = args.accelerator == "gpu"
    if cuda:
        warm_up_cuda()
    cases = TINY if args.tiny else CASES
    rows = []
    for key in args.cases:
        case = cases[key]
        data = _Batches(case.data(case.batch * POOL), case.batch, args.warmup + args.steps + 1)
        for m in args.micro_batches:
            runs: dict[str, list[Run]] = {"plain": [], "autopart": []}
            for r in range(args.rounds):
                for side in ("plain", "autopart") if r % 2 == 0 else ("autopart", "plain"):
                    with contextlib.redirect_stdout(
                        sys.stderr
                    ):  # the plan autopart prints: stdout is the report
                        run = run_side(
                            case, side, data, accelerator=args.accelerator, micro_batches=m,
                            warmup=args.warmup, steps=args.steps, profile=args.profile,
                        )  # fmt: skip
                    runs[side].append(run)
                    peak = f", peak {_gib(run.peak)}" if cuda else ""
                    print(
                        f"{case.name} m={m} round {r + 1} {side}: {run.samples_per_s:.1f} samples/s{peak}",
                        file=sys.stderr,
                    )
            rows.append(_summary(case, m, runs, cuda))
    header = (
        f"{_device_name(args.accelerator)}; torch {torch.__version__}, lightning {L.__version__}; "
        f"{args.steps} timed steps after {args.warmup} warm-up, {args.rounds} interleaved rounds, "
        f"autopart profile={args.profile}; float32 matmul precision {torch.get_float32_matmul_precision()}"
    )
    print(f"{header}\n\n{_table(rows, cuda)}")
    for row in rows:
        rounds = {
            side: [{"samples_per_s": r["samples_per_s"]} for r in row["runs"][side]] for side in row["runs"]
        }
        print(f"\n{row['case']}, {row['precision']}, m={row['micro_batches']}:\n")
        print(median_table(rounds, "plain", "autopart"))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
