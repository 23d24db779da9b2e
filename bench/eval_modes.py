"""Pipelined evaluation against eager evaluation on Hugging Face architectures, default dropouts on.

Usage: ``python bench/eval_modes.py [NAME ...]`` (default: the 40 architectures of tests/hf_architectures.py
and bench/hf_sweep.py). One process on the CPU, configs only (random weights, nothing downloaded). Each model
is captured in training mode as the strategy captures it (``check_eval=True``), then run in evaluation mode
as three stage modules in a chain, and its outputs compared with the eager model's in evaluation mode:
"equal", "differ" (silently wrong), or "refused" (a pipelined evaluation step would be refused, with the
reason). See [Note: Python branches on the mode] in capture/modes.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hf_sweep import SWEEP, sweep_report
from lightning_autopart.capture import capture
from tests.eager import run_stages
from tests.hf_architectures import ARCHITECTURES, build, inputs

__all__: list[str] = []


def check(name: str) -> tuple[str, str]:
    """("equal" | "differ" | "refused", detail) for architecture ``name``."""
    arch = ARCHITECTURES.get(name) or SWEEP[name]
    torch.manual_seed(0)
    model, batch = build(arch, "cpu", dropout=True), inputs(arch, "cpu")
    start = time.perf_counter()
    captured = capture(model, batch, check_eval=True)
    took = f"{time.perf_counter() - start:.2f} s, {captured.method}"
    branches = ", ".join(captured.eval_branches[:2])
    if not captured.evaluates:
        return "refused", f"{took}; {branches}"
    model.eval()
    with torch.no_grad():
        got = run_stages(captured, 3, *batch.values())
        want = model(**batch)
    mine, theirs = dict(got), dict(want)  # tensors by output name (an eager cache object aside)
    pairs = [(mine[k], theirs[k]) for k in mine if isinstance(mine[k], torch.Tensor) and k in theirs]
    worst = max((float((g - w).abs().max()) for g, w in pairs), default=float("nan"))
    detail = f"{took}; {captured.num_blocks} blocks; branches: {branches or 'none'}"
    return ("equal" if worst <= 1e-5 else "differ"), f"{detail}; max |difference| {worst:.2e}"


def main(names: list[str]) -> None:
    sweep_report(check, names)


if __name__ == "__main__":
    main(sys.argv[1:])
