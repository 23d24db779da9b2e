"""Pipelined stages under autocast against the eager model under autocast, on Hugging Face architectures.

Usage: ``python bench/autocast_stages.py [NAME ...]`` (default: the 40 architectures of
tests/hf_architectures.py and bench/hf_sweep.py). One process on the CPU, configs only (random weights, nothing
downloaded), dropout off. Each model is captured in float32 as the strategy captures it, then run under
``torch.autocast("cpu", dtype=torch.bfloat16)`` as three stage modules in a chain and as the eager model, and
their floating outputs compared: "equal" (no difference), "close" (within 2 % of the output's largest
magnitude: bf16 rounding in an operation the eager code orders otherwise), "differ", or "error" (the stage
raised, as DeBERTa-v2's did before [Note: dtype extremes]). A backward through the stages must give finite
gradients. Both runs start from the same seeds (wav2vec2 draws its SpecAugment mask with numpy).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy
import torch
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hf_sweep import SWEEP, sweep_report
from lightning_autopart.capture import capture
from tests.eager import run_stages
from tests.hf_architectures import ARCHITECTURES, build, inputs

__all__: list[str] = []


def _floats(out: object) -> list[torch.Tensor]:
    out = out.to_tuple() if hasattr(out, "to_tuple") else out
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _seed() -> None:
    torch.manual_seed(1)
    numpy.random.seed(1)


def check(name: str, dtype: torch.dtype = torch.bfloat16) -> tuple[str, str]:
    """("equal" | "close" | "differ", detail) for architecture ``name`` under autocast to ``dtype``."""
    arch = ARCHITECTURES.get(name) or SWEEP[name]
    torch.manual_seed(0)
    model, batch = build(arch, "cpu", dropout=False), inputs(arch, "cpu")
    captured = capture(model, batch)
    with torch.autocast("cpu", dtype=dtype):
        _seed()
        want = _floats(model(**batch))
        _seed()  # the same draws for both runs (wav2vec2 masks its input with numpy's)
        got = _floats(run_stages(captured, 3, *batch.values()))
    if len(got) != len(want):
        return "differ", f"{len(got)} floating outputs against {len(want)}"
    worst = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want, strict=True))
    scale = max(float(w.float().abs().max()) for w in want) or 1.0
    model.zero_grad(set_to_none=True)
    sum(g.float().mean() for g in got).backward()  # type: ignore[union-attr]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = all(bool(g.isfinite().all()) for g in grads)
    status = "equal" if worst == 0 else "close" if worst <= 0.02 * scale else "differ"
    if not finite:
        status = "differ"
    detail = f"{captured.method}, {captured.num_blocks} blocks; max |difference| {worst:.2e} of {scale:.2e}"
    return status, f"{detail}; {len(grads)} gradients, {'finite' if finite else 'NOT finite'}"


def main(names: list[str]) -> None:
    sweep_report(check, names)


if __name__ == "__main__":
    main(sys.argv[1:])
