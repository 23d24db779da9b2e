"""Hugging Face architectures beyond the test tier, pipelined for real: each trained under AutoPartitionStrategy
on 2 gloo ranks (2 stages, 4 micro-batches) against plain one-process Lightning on the same batches.

Usage: ``python bench/pipeline_sweep.py [--schedules 1F1B Interleaved1F1B] [--parts] [--spec cpu] [-- NAME ...]``
(default: every architecture of tests/hf_architectures.py and bench/hf_sweep.py). ``--spec cpu`` prices the
CPU's own kernels (its attention, its autocast lists); the strategy's estimate on a CPU job prices an A100's. Configs only (random weights, dropout off,
nothing downloaded). The step is generic (the mean square of the model's first output, as a user's own loss
on logits would read it). Per architecture and schedule it prints the largest relative difference of the
logged losses and of the trained parameters (``|p - q| / (|q| + 1e-6 sqrt(n))``: a key projection's bias has a
gradient of rounding noise, as softmax ignores a shift shared by all keys), and each rank's measured step peak
(tensor bytes, receive buffers included) over its predicted memory. A model with BatchNorm differs by design
(each micro-batch is normalized on its own; the strategy warns). One launch runs every case; a case failing on every rank
is reported and the launch goes on; a rank failing alone ends the launch, which starts again after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__: list[str] = []

STEPS, LOCAL_BATCH, MICRO = 3, 8, 4


def _row(name: str) -> Any:
    from bench.hf_sweep import SWEEP
    from tests.hf_architectures import ARCHITECTURES

    return ARCHITECTURES[name] if name in ARCHITECTURES else SWEEP[name]


def _data(name: str) -> Any:
    """``STEPS * LOCAL_BATCH`` samples of the architecture's inputs (ids below 50, some padding, features)."""
    from tests.hf_cases import DictDataset

    n, g, columns = STEPS * LOCAL_BATCH, torch.Generator().manual_seed(3), {}
    for key, shape in _row(name).shapes.items():
        full = (n, *shape[1:])
        if key.endswith("_ids"):
            columns[key] = torch.randint(0, 50, full, generator=g)
        elif key == "attention_mask":
            columns[key] = torch.ones(full, dtype=torch.long)
            columns[key][::3, -3:] = 0
        else:
            columns[key] = torch.randn(full, generator=g)
    return DictDataset(**columns)


def _module(name: str) -> Any:
    import lightning as L

    from tests.hf_architectures import build

    class Generic(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(_row(name), "cpu", dropout=False)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            out = self.model(**batch)
            first = out.logits if getattr(out, "logits", None) is not None else out[0]
            loss = first.float().square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Generic()


def _fit(name: str, strategy: Any, devices: int, probe: Any = None) -> tuple[Any, list[float]]:
    import lightning as L
    from torch.utils.data import DataLoader

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))

    model, losses = _module(name), Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[losses, *([probe] if probe is not None else [])],
    )  # fmt: skip
    data = _data(name)
    if strategy == "auto":  # Lightning shuffles a distributed job's data (DistributedSampler, seed 0)
        from torch.utils.data import Subset

        data = Subset(data, torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist())
    trainer.fit(model, DataLoader(data, batch_size=LOCAL_BATCH))
    return model, losses.losses


def _pipelined(case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_autopart.lightning.strategy import AutoPartitionStrategy
    from lightning_autopart.runtime.topology import place
    from tests.step_peak import StepPeak, stage_buffers

    if case.get("spec"):  # the spec a CPU job's estimate prices (the strategy's default is a GPU's)
        import lightning_autopart.lightning.first_batch as first_batch

        first_batch._ESTIMATE_SPEC = case["spec"]
    strategy = AutoPartitionStrategy(
        num_stages=2, micro_batches=MICRO, schedule=case["schedule"], profile="estimate"
    )
    probe = StepPeak(1, STEPS, extra=lambda trainer: stage_buffers(strategy._runner._schedules.values()))
    model, losses = _fit(case["name"], strategy, 2, probe)
    local = {id(p) for p in strategy._params}
    assert strategy.plan is not None
    placement = place(strategy.plan, dist.get_rank())
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in local},
        "losses": losses,
        "peak": max(probe.peaks),
        "predicted": sum(strategy.plan.stages[s].memory_bytes for s in placement.stages),
        "parts": [
            {k: getattr(strategy.plan.stages[s], k) for k in (
                "block_start", "block_end", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "in_flight",
                "transient_bytes", "io_bytes", "memory_bytes")}
            for s in placement.stages
        ],
    }


def worker(cases_path: str, out: str, first: int) -> None:
    """One rank of a launch: run cases ``first``, ``first + 1``, ... and save each result as it comes."""
    import torch.distributed as dist

    from tests.distributed._hf_script import everyone_finished
    from tests.distributed.job import end_job

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cases = json.loads(Path(cases_path).read_text())
    results: dict[int, Any] = {}
    for i, case in enumerate(cases[first:], first):
        try:
            results[i] = _pipelined(case)
        except Exception:
            results[i] = {"error": traceback.format_exc()}
            torch.set_grad_enabled(True)
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
        torch.save(results, Path(out) / f"rank{rank}-from{first}.pt")
        if not everyone_finished(i, 2):
            os._exit(1)
    end_job()


def _compare(case: dict[str, Any], ranks: dict[int, Any], parts: bool = False) -> str:
    errors = {r: got["error"].strip().splitlines()[-1] for r, got in ranks.items() if "error" in got}
    if errors:
        return f"FAILED {errors}"
    ref_model, ref_losses = _fit(case["name"], "auto", 1)
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ranks[0]["losses"], ref_losses, strict=True))
    ref = dict(ref_model.named_parameters())
    worst = 0.0
    for got in ranks.values():
        for n, p in got["params"].items():
            want = ref[n].detach()  # a key bias's gradient is rounding noise (softmax ignores a shared shift)
            d = float((p - want).norm() / (want.norm() + 1e-6 * want.numel() ** 0.5))
            worst = max(worst, d)
    if parts:  # each rank's stages as the plan prices them
        for r, got in sorted(ranks.items()):
            print(f"rank {r} peak {got['peak']}", *got["parts"], sep="\n  ")
    peaks = ", ".join(f"{got['peak'] / got['predicted']:.3f}" for _, got in sorted(ranks.items()))
    return f"losses {loss_diff:.1e}, params {worst:.1e}, measured/predicted peak {peaks}"


def main() -> None:
    from bench.hf_sweep import SWEEP
    from tests.distributed.launch import run_job
    from tests.hf_architectures import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "Interleaved1F1B"])
    parser.add_argument("--parts", action="store_true", help="print each rank's stages as the plan prices them")
    parser.add_argument("--spec", help="the device spec the estimate prices (default: the strategy's)")
    parser.add_argument("--worker", nargs=3, metavar=("CASES", "OUT", "FIRST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    names = args.names or [*ARCHITECTURES, *(n for n in SWEEP if n not in ARCHITECTURES)]
    cases = [{"name": n, "schedule": s, "spec": args.spec} for n in names for s in args.schedules]
    out = Path(tempfile.mkdtemp(prefix="pipeline_sweep-"))
    (out / "cases.json").write_text(json.dumps(cases))
    first = 0
    while first < len(cases):
        script = [str(Path(__file__).resolve()), "--worker", str(out / "cases.json"), str(out), str(first)]
        code, log = run_job(script, 2, "lightning", 900)
        done: dict[int, dict[int, Any]] = {}
        for rank in range(2):
            path = out / f"rank{rank}-from{first}.pt"
            for i, got in (torch.load(path) if path.exists() else {}).items():
                done.setdefault(i, {})[rank] = got
        started = first
        while first < len(cases) and len(done.get(first, {})) == 2:
            case = cases[first]
            print(f"{case['name']:18s} {case['schedule']:16s} {_compare(case, done[first], args.parts)}", flush=True)
            first += 1
        if first < len(cases) and (first == started or done.get(first)):
            case = cases[first]
            print(f"{case['name']:18s} {case['schedule']:16s} LAUNCH STOPPED (code {code}): {log[-1500:]}")
            first += 1


if __name__ == "__main__":
    main()
