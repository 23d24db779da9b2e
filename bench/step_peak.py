"""Estimate mode's predicted peak of a whole training step against plain Lightning's, on the CPU, for every
architecture of ``tests/hf_architectures.py``.

Usage: ``python bench/step_peak.py [--widen 8] [--precisions 32-true bf16-true] [--optimizer adamw]
[--archs qwen3 bart ...] [--sweep] [--spec h100|cpu]`` (about 3 minutes for all, on two cores). ``--sweep`` runs
the 133 architectures of ``bench/hf_sweep.py`` instead (models the test tier does not build). Either way the
architectures ``bench/hf_more.py``'s ``UNWIDENED`` names are left out (their configs do not widen; ``--archs``
runs them). ``--spec cpu`` prices the CPU's own attention kernels and autocast lists, the ones the measurement
runs (a GPU's autocast keeps ``pow``, softmax and norms in float32; a CPU's does not).

Each architecture is built from its tiny config with its widths multiplied by ``--widen`` (hidden sizes and
feed-forward sizes), every dropout off, at a batch of 8 with its token sequences doubled. A LightningModule
trains it with a loss on its logits (or its first output: a last hidden state, CLIP's image-text logits) and
the optimizer run as on a GPU (``foreach=True``; the CPU's default loops one tensor at a time). Predicted: ``tests/unit/test_step_peak.predicted_peak`` (one
device of ``--spec``, planned as the strategy plans, the optimizer measured). Measured: the peak tensor bytes
of plain Lightning's batches 2 and 3 (``tests.step_peak.StepPeak``: what ``torch.cuda.max_memory_allocated``
sees, on any device). Prints a markdown table and the worst ratio; the goal is issue 9's 10% for estimate mode.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.hf_more import UNWIDENED
from bench.hf_sweep import SWEEP
from tests.hf_architectures import ARCHITECTURES, Architecture, build
from tests.unit.test_step_peak import measured_peak, predicted_peak

BATCH = 8
_WIDTHS = (
    "hidden_size", "n_embd", "d_model", "dim", "intermediate_size", "ffn_dim", "hidden_dim", "encoder_ffn_dim",
    "decoder_ffn_dim", "embed_dim", "embedding_size",
)  # fmt: skip


def widened(arch: Architecture, factor: int) -> Architecture:
    """``arch`` with its widths times ``factor`` and its token sequences twice as long (where its positions
    allow)."""
    settings = dict(arch.settings)
    for key in _WIDTHS:
        if key in settings:
            settings[key] *= factor
    if "hidden_sizes" in settings:
        settings["hidden_sizes"] = [h * factor for h in settings["hidden_sizes"]]
    limit = min((settings[k] for k in ("max_position_embeddings", "n_positions") if k in settings), default=1 << 30)
    shapes = {
        k: (BATCH, *((2 * d if (k.endswith("_ids") or k == "attention_mask") and 2 * d <= limit else d) for d in v[1:]))
        for k, v in arch.shapes.items()
    }
    return arch._replace(settings=settings, shapes=shapes)


class Inputs(Dataset[dict[str, torch.Tensor]]):
    """The architecture's inputs, drawn per index; attention masks pad the last 4 positions of odd samples."""

    def __init__(self, arch: Architecture) -> None:
        self.arch = arch

    def __len__(self) -> int:
        return 4 * BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g, out = torch.Generator().manual_seed(i), {}
        for key, shape in self.arch.shapes.items():
            if key.endswith("_ids"):
                out[key] = torch.randint(0, 50, shape[1:], generator=g)
            elif key == "attention_mask":
                out[key] = (torch.arange(shape[1]) < shape[1] - 4 * (i % 2)).long()
            else:
                out[key] = torch.randn(shape[1:], generator=g)
        return out


class Trained(L.LightningModule):
    """The model trained on the mean square of its logits (or last hidden state), by a foreach optimizer."""

    def __init__(self, arch: Architecture, optimizer: str) -> None:
        super().__init__()
        self.model = build(arch, str(torch.empty(0).device), dropout=False)
        self.optimizer = optimizer

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)
        y = out.logits if getattr(out, "logits", None) is not None else out[0]  # else its first output
        return y.float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self.optimizer]
        return cls(self.parameters(), lr=1e-4, foreach=True)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widen", type=int, default=8)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-true"])
    parser.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="adamw")
    parser.add_argument("--archs", nargs="+", choices=[*ARCHITECTURES, *SWEEP])
    parser.add_argument("--sweep", action="store_true", help="every architecture of bench/hf_sweep.py")
    parser.add_argument("--spec", default="h100", help="the device priced: h100 (its kernels and autocast lists) "
                        "or cpu (the CPU's, which the measurement runs)")
    args = parser.parse_args(argv)
    known = {**ARCHITECTURES, **SWEEP}
    names = args.archs or [n for n in (SWEEP if args.sweep else ARCHITECTURES) if n not in UNWIDENED]
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}; estimate mode ({args.spec} spec) against plain Lightning on the CPU\n")
    print("| architecture | precision | predicted MB | measured MB | ratio |\n|---|---|---:|---:|---:|")
    rows: list[dict[str, Any]] = []
    for name in names:
        arch = widened(known[name], args.widen)
        batch = next(iter(DataLoader(Inputs(arch), batch_size=BATCH)))
        for precision in args.precisions:
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    make = partial(Trained, arch, args.optimizer)
                    predicted = predicted_peak(make, batch, precision, args.spec)
                    measured = measured_peak(make, DataLoader(Inputs(arch), batch_size=BATCH), precision)
            except Exception as error:  # one architecture's failure leaves the others their row
                print(f"| {name} | {precision} | {type(error).__name__}: {str(error)[:80]} | | |")
                continue
            ratio = predicted / measured
            rows.append({"arch": name, "precision": precision, "ratio": ratio})
            print(f"| {name} | {precision} | {predicted / 1e6:.2f} | {measured / 1e6:.2f} | {ratio:.3f} |", flush=True)
    if rows:
        worst = max(rows, key=lambda r: abs(math.log(r["ratio"])))
        print(f"\nworst: {worst['arch']} {worst['precision']} {worst['ratio']:.3f} (goal +-10%)")
    return rows


if __name__ == "__main__":
    main()
