"""Mixed precision on one GPU: autopart against Lightning's default strategy at the same precision.

``bf16-mixed`` runs autocast only; ``16-mixed`` adds Lightning's GradScaler, whose scale must follow the same
path on both sides: the same steps skipped for non-finite gradients, the same final scale. Several micro-batches
change which bfloat16/float16 matmuls run (half the rows each), so those comparisons use tolerances of the
precision; one micro-batch runs the same kernels as plain Lightning and is compared almost as tightly as float32.
The tier is single-GPU (see tests/gpu/__init__.py). ``check_*`` functions take the accelerator.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.gpu.harness import CASES, Case, Trained, assert_same_training, autopart, fit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 4
#: (rtol, atol, update_tol) of a comparison: one micro-batch (the same kernels: only a different order of
#: float32 work could tell the sides apart), several (other matmul shapes, so other bfloat16/float16 roundings).
ONE, SEVERAL = (1e-3, 1e-4, 0.05), (2e-2, 2e-3, 0.1)


def check_precision(
    case: Case,
    accelerator: str,
    precision: str,
    micro_batches: int | None = None,
    plugin: Any = None,
    steps: int = STEPS,
) -> tuple[Trained, Trained]:
    """Plain Lightning, then autopart, at ``precision`` (or with ``plugin()``, a fresh precision plugin per
    side); returns (autopart, plain)."""
    m = micro_batches or case.micro_batches
    sides = []
    for strategy in ("auto", autopart(m)):
        plugins = [plugin()] if plugin is not None else None
        sides.append(
            fit(
                case, strategy, accelerator=accelerator, precision=precision, plugins=plugins, max_steps=steps
            )
        )
    plain, pipelined = sides
    rtol, atol, update_tol = ONE if m == 1 else SEVERAL
    assert_same_training(pipelined, plain, rtol=rtol, atol=atol, update_tol=update_tol)
    assert all(t.dtype == torch.float32 for t in pipelined.params.values())  # mixed: float32 weights
    return pipelined, plain


@pytest.mark.parametrize(
    ("case", "micro_batches"), [("example_gpt", 4), ("gpt", 1), ("resnet", 1), ("tutorial", 2)]
)
def test_bf16_mixed_trains_like_plain_lightning(case: str, micro_batches: int) -> None:
    check_precision(CASES[case], "gpu", "bf16-mixed", micro_batches)


@pytest.mark.parametrize(("case", "micro_batches"), [("example_gpt", 4), ("resnet", 1), ("tutorial", 1)])
def test_fp16_mixed_with_grad_scaler_trains_like_plain_lightning(case: str, micro_batches: int) -> None:
    """Lightning's own GradScaler (initial scale 2**16): gradients must be scaled in backward and unscaled once."""
    _, plain = check_precision(CASES[case], "gpu", "16-mixed", micro_batches)
    assert len(plain.scales) == STEPS


def overflowing_scaler(device: str, init_scale: float) -> MixedPrecision:
    """``16-mixed`` with a GradScaler that starts at ``init_scale`` and doubles after every finite step: float16
    gradients overflow, so steps are skipped and the scale halves, then it grows back and overflows again."""
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=1)
    return MixedPrecision("16-mixed", device, scaler=scaler)


def check_skipped_steps_agree(case: Case, accelerator: str, init_scale: float, steps: int = 8) -> None:
    device = "cuda" if accelerator == "gpu" else accelerator
    _, plain = check_precision(
        case, accelerator, "16-mixed", 1, plugin=lambda: overflowing_scaler(device, init_scale), steps=steps
    )
    # The comparison means something: plain Lightning skipped steps (the scale fell) and took others (a finite
    # step grows the scale again).
    changes = list(zip([init_scale, *plain.scales[:-1]], plain.scales, strict=True))
    assert any(after < before for before, after in changes), plain.scales
    assert any(after > before for before, after in changes), plain.scales


#: Initial scales that make each model overflow on some steps and not on others (measured on CPU float16:
#: GPT 2**19, 2**18, 2**17, 2**16, 2**17, 2**16, 2**17, 2**18 after each step; tutorial alternating).
SKIPPING = [("gpt", 2.0**20), ("tutorial", 2.0**24)]


@pytest.mark.parametrize(
    ("case", "init_scale"), SKIPPING, ids=[f"{c}-2**{int(s).bit_length() - 1}" for c, s in SKIPPING]
)
def test_fp16_skipped_steps_agree(case: str, init_scale: float) -> None:
    """With one micro-batch both sides run the same float16 kernels, so they overflow on the same steps: the
    scale after every step (so which steps were skipped) and the final scale must agree."""
    check_skipped_steps_agree(CASES[case], "gpu", init_scale)
