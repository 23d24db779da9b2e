"""Leanness on one GPU: a 1-stage autopart step costs no more device memory and no more host syncs than
Lightning's default strategy on the same model, data and seed.

Per side, one fit: ``WARMUP`` steps, then a memory window (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` at its first step, compared above what was allocated before the fit, so nothing an
earlier test left counts), then a sync window (``tests.census.SyncCounter``: calls of
``aten._local_scalar_dense``, the op behind ``.item()``, ``float(t)``, ``int(t)``, ``if t:``; and
device-to-host copies). Windows run from one ``on_train_batch_start`` to the next, so Lightning's own per-step
work (its metric updates after ``on_train_batch_end``) is inside on both sides. The tier is single-GPU (see
tests/gpu/__init__.py); ``check_*`` functions take the accelerator (memory is only measured on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from examples.data import SyntheticRegression, SyntheticTokens
from examples.gpt import GPT
from examples.tutorial import Net
from tests.gpu.harness import Case, CudaPeak, SyncWindow, autopart, fit, ordered_loader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: First steps left out (planning, allocator warm-up), then the memory window, then the sync window, then one
#: more step, so that the sync window closes at a step start like the memory window, not at the end of training.
WARMUP, MEMORY_STEPS, SYNC_STEPS = 3, 3, 3
STEPS = WARMUP + MEMORY_STEPS + SYNC_STEPS + 1
#: Peak device memory of autopart over plain Lightning's, at most.
PEAK_RATIO = 1.03

#: Models whose parameters, gradients and activations all weigh: the tutorial Net at 8 x 2048 (134 MB of weights,
#: as much of gradients, 16 MB of activations at batch 256) and a GPT (tied 2048 x 256 embedding, attention).
LEAN_CASES: dict[str, Case] = {
    "tutorial": Case(
        lambda: Net(2048, 8, lr=0.01, batch_size=256),
        lambda: ordered_loader(SyntheticRegression(256 * STEPS, 2048, seed=0), 256),
        1,
    ),
    "gpt": Case(
        lambda: GPT(vocab_size=2048, seq_len=128, d_model=256, n_layers=4, n_heads=4, lr=0.01),
        lambda: ordered_loader(SyntheticTokens(16 * STEPS, 128, 2048, seed=0), 16),
        1,
    ),
}


@dataclass
class Lean:
    """One side's measurements: bytes above the pre-fit allocation (steady state between steps, and peak), and
    host syncs and device-to-host copies per step."""

    live: int
    peak: int
    syncs: float
    to_host: float


def measure(case: Case, strategy: Any, accelerator: str) -> Lean:
    from tests.census import SyncCounter  # the census module is shared with the CPU probes

    memory_start = WARMUP
    sync_start = memory_start + MEMORY_STEPS
    cuda = accelerator == "gpu"
    memory = CudaPeak(memory_start, sync_start)
    syncs = SyncWindow(SyncCounter, sync_start, sync_start + SYNC_STEPS)
    # The memory window closes before the sync window opens (callbacks run in list order).
    windows = [memory, syncs] if cuda else [syncs]
    run = fit(case, strategy, accelerator=accelerator, max_steps=STEPS, callbacks=windows, log_steps=False)
    assert syncs.closed and (memory.closed or not cuda)
    live = peak = 0
    if cuda:
        live, peak = memory.base - run.allocated_before, memory.peak - run.allocated_before
    return Lean(live, peak, syncs.count / syncs.steps, syncs.to_host / syncs.steps)


def check_lean(case: Case, micro_batches: int, accelerator: str) -> tuple[Lean, Lean]:
    """Both sides measured; every shortfall is reported together. Returns (autopart, plain).

    A first, unmeasured plain fit makes what the device keeps for the whole process (cuBLAS workspaces of the
    forward's thread and of autograd's backward thread, cuDNN handles) before either side is measured: made
    during the first measured fit, they would count against that side alone.
    """
    if accelerator == "gpu":
        fit(case, "auto", accelerator=accelerator, max_steps=2, log_steps=False)
    plain = measure(case, "auto", accelerator)
    pipelined = measure(case, autopart(micro_batches), accelerator)
    problems = []
    if accelerator == "gpu":
        assert plain.peak > 0
        ratio = pipelined.peak / plain.peak
        if ratio > PEAK_RATIO:
            problems.append(
                f"peak memory {pipelined.peak / 2**20:.1f} MB is {ratio:.3f}x plain Lightning's "
                f"{plain.peak / 2**20:.1f} MB (allowed {PEAK_RATIO}x); between steps "
                f"{pipelined.live / 2**20:.1f} MB against {plain.live / 2**20:.1f} MB"
            )
    if pipelined.syncs > plain.syncs:
        problems.append(
            f"{pipelined.syncs:g} host syncs (_local_scalar_dense) per step, plain Lightning {plain.syncs:g}"
        )
    if pipelined.to_host > plain.to_host:
        problems.append(
            f"{pipelined.to_host:g} device-to-host copies per step, plain Lightning {plain.to_host:g}"
        )
    assert not problems, f"micro_batches={micro_batches}: " + "; ".join(problems)
    return pipelined, plain


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("case", sorted(LEAN_CASES))
def test_one_stage_step_is_as_lean_as_plain_lightning(case: str, micro_batches: int) -> None:
    check_lean(LEAN_CASES[case], micro_batches, "gpu")
