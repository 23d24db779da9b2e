"""Throughput of autopart with a forced 1-stage plan against Lightning's "ddp" on 2 CPU processes (gloo).

Usage: ``python bench/strategy_vs_ddp.py [--rounds 3] [--steps 30] [--warmup 5]``. Each round launches
``python bench/strategy_vs_ddp.py --worker ddp`` and ``--worker autopart`` one after the other (the order
alternates between rounds); Lightning's launcher starts the second process (``devices=2``), every process
runs 1 thread. Rank 0 times ``steps`` optimizer steps after ``warmup`` and prints a ``RESULT {json}`` line;
this driver prints a markdown table of the median samples/s and the ratio autopart / ddp. ``--with-raw`` adds a
third side per round: a hand-written ``DistributedDataParallel`` loop without Lightning (``torchrun``, the same
model, data, sampler and SGD), whose ratio ddp / raw is the share of the step that Lightning itself costs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

__all__ = ["MLP", "LitMLP", "Timer", "dataset", "launch", "median_table"]

#: Model and data of every run: width, layers, samples per process per step.
HIDDEN, LAYERS, BATCH = 512, 8, 64


class MLP(nn.Module):
    """``layers`` blocks of Linear + ReLU of width ``hidden``, then a linear head."""

    def __init__(self, hidden: int | None = None, layers: int = LAYERS) -> None:
        super().__init__()
        hidden = hidden or HIDDEN  # read at call time: bench/strategy_vs_pipelining.py --hidden sets it
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)
        )
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LitMLP(L.LightningModule):
    """:class:`MLP` trained with MSE and plain SGD."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MLP()
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def dataset(n: int) -> TensorDataset:
    """``n`` deterministic (input, target) pairs."""
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g))


class Timer(L.Callback):
    """Times optimizer steps ``warmup`` to ``warmup + steps`` on rank 0 (perf_counter around the batches).

    Every rank runs a full garbage collection as training starts: one falls due after setup (planning leaves
    some 500,000 objects to the oldest generation on rank 0) and takes 250-330 ms on the 2-core test machine.
    Landing in the timed window on some rank, it stalled the whole pipeline and added 6-10 ms to a 30-step
    mean; the steps timed are then the steady ones a prediction is about, on every side of a comparison."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup = warmup
        self.steps = steps
        self.start = 0.0
        self.elapsed = 0.0

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        gc.collect()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup + self.steps:
            self.elapsed = time.perf_counter() - self.start


def train(strategy: Any, warmup: int, steps: int, devices: int = 2) -> tuple[L.Trainer, Timer]:
    """Fit :class:`LitMLP` for ``warmup + steps`` steps of ``BATCH`` samples per process; returns the timer."""
    torch.set_num_threads(1)
    timer = Timer(warmup, steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    data = dataset(BATCH * devices * (warmup + steps))
    trainer.fit(LitMLP(), DataLoader(data, batch_size=BATCH, drop_last=True))
    return trainer, timer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(command: list[str], timeout: float = 300.0) -> dict[str, Any]:
    """Run ``command`` (a script that prints ``RESULT {json}``) in its own session; kill all of it afterwards."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    log = out.decode()
    for line in log.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"{' '.join(command)} printed no result (exit {proc.returncode}):\n{log[-4000:]}")


def median_table(results: dict[str, list[dict[str, Any]]], baseline: str, candidate: str) -> str:
    """A markdown table of every round's samples/s, the medians and the ratio candidate / baseline."""
    rows = ["| run | " + " | ".join(f"round {i + 1}" for i in range(len(results[baseline]))) + " | median |"]
    rows.append("|---|" + "---:|" * (len(results[baseline]) + 1))
    medians = {}
    for name in (baseline, candidate):
        values = [r["samples_per_s"] for r in results[name]]
        medians[name] = statistics.median(values)
        rows.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {medians[name]:.1f} |")
    pairs = [
        c["samples_per_s"] / b["samples_per_s"]
        for b, c in zip(results[baseline], results[candidate], strict=True)
    ]
    rows.append(
        f"\nratio {candidate} / {baseline} (medians): **{medians[candidate] / medians[baseline]:.3f}**; "
        f"median of the per-round ratios (each round's runs back to back): **{statistics.median(pairs):.3f}** "
        f"(range {min(pairs):.2f}-{max(pairs):.2f})"
    )
    return "\n".join(rows)


def _worker(kind: str, warmup: int, steps: int) -> None:
    from lightning_autopart import AutoPartitionStrategy

    strategy: Any = "ddp"
    if kind == "autopart":
        strategy = AutoPartitionStrategy(num_stages=1, micro_batches=1, schedule="GPipe")
    trainer, timer = train(strategy, warmup, steps)
    if trainer.is_global_zero:
        samples = steps * BATCH * trainer.world_size
        print(
            "RESULT "
            + json.dumps({"samples_per_s": samples / timer.elapsed, "step_s": timer.elapsed / steps})
        )
    sys.stdout.flush()
    os._exit(0)  # skip torch's slow interpreter teardown


def _raw(warmup: int, steps: int) -> None:
    """The same training without Lightning: DDP, a DistributedSampler over the same data, SGD, a plain loop."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = dataset(BATCH * world * (warmup + steps))
    loader = DataLoader(
        data, batch_size=BATCH, drop_last=True, sampler=DistributedSampler(data, shuffle=False)
    )
    start = 0.0
    gc.collect()  # as the Lightning side's Timer does
    for i, (x, y) in enumerate(loader):
        if i == warmup:
            start = time.perf_counter()
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(
            "RESULT "
            + json.dumps({"samples_per_s": steps * BATCH * world / elapsed, "step_s": elapsed / steps})
        )
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", choices=["ddp", "autopart", "raw"])
    parser.add_argument("--with-raw", action="store_true", help="also time DDP without Lightning (torchrun)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.worker == "raw":
        _raw(args.warmup, args.steps)
    if args.worker:
        _worker(args.worker, args.warmup, args.steps)
        return
    results: dict[str, list[dict[str, Any]]] = {"ddp": [], "autopart": [], "raw": []}
    for r in range(args.rounds):
        order = ["ddp", "autopart"] if r % 2 == 0 else ["autopart", "ddp"]
        if args.with_raw:
            order.insert(1, "raw")
        for kind in order:
            cmd = [sys.executable, __file__, "--worker", kind, "--steps", str(args.steps)]
            if kind == "raw":
                port = f"--master_port={_free_port()}"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", port, *cmd[1:]]
            result = launch([*cmd, "--warmup", str(args.warmup)])
            results[kind].append(result)
            print(f"round {r + 1} {kind}: {result['samples_per_s']:.1f} samples/s", file=sys.stderr)
    print(
        f"MLP {LAYERS + 1} x Linear({HIDDEN}), batch {BATCH} per process, 2 processes x 1 thread, gloo, "
        f"{args.steps} timed steps after {args.warmup} warm-up, {args.rounds} interleaved rounds\n"
    )
    print(median_table(results, "ddp", "autopart"))
    if args.with_raw:
        print("\n" + median_table(results, "raw", "ddp"))


if __name__ == "__main__":
    main()
