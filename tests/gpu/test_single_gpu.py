"""The strategy on one GPU: only this rank's tensors reach the device, and training equals plain Lightning.

Each comparison trains the same model, from the same seed, on the same batches in the same order, once with
Lightning's default strategy and once with ``AutoPartitionStrategy(num_stages=1, micro_batches=m)``, both with
``Trainer(accelerator="gpu", devices=1)``, and compares the logged losses, the final parameters and buffers and
each parameter's update. The tier is single-GPU: a 2-stage plan needs two ranks, and one GPU cannot host two
NCCL ranks (``tests/distributed`` runs pipelines on CPU processes).

``check_*`` functions take the accelerator, so they can be tried without a GPU (``accelerator="cpu"``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopart.runtime.runner import move_in_place
from tests.gpu.harness import CASES, Case, Trained, assert_same_training, autopart, fit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: Optimizer steps per side.
STEPS = 4


def check_training_equals_plain_lightning(
    case: Case, accelerator: str, micro_batches: int | None = None, steps: int = STEPS
) -> tuple[Trained, Trained]:
    """Plain Lightning, then autopart's 1-stage plan, on one device: equal in float32 (see the module doc).

    Returns both sides' records (autopart's first)."""
    plain = fit(case, "auto", accelerator=accelerator, max_steps=steps)
    pipelined = fit(
        case, autopart(micro_batches or case.micro_batches), accelerator=accelerator, max_steps=steps
    )
    device = "cuda" if accelerator == "gpu" else accelerator
    assert plain.devices == pipelined.devices == {device}, (plain.devices, pipelined.devices)
    assert_same_training(pipelined, plain, rtol=1e-4, atol=1e-5)
    return pipelined, plain


def test_move_in_place_keeps_the_tensors_stage_modules_share() -> None:
    model = nn.BatchNorm1d(3)
    model.weight.grad = torch.ones(3)
    stage = nn.Module()  # a stage module built over the same tensors, as build_stage_module does
    stage.register_parameter("weight", model.weight)
    stage.register_buffer("running_mean", model.running_mean)
    before = [id(t) for t in (*model.parameters(), *model.buffers())]
    move_in_place(model, torch.device("cuda"))
    assert [id(t) for t in (*model.parameters(), *model.buffers())] == before
    assert all(t.is_cuda for t in (*model.parameters(), *model.buffers()))
    assert model.weight.grad is not None and model.weight.grad.is_cuda
    assert stage.running_mean is model.running_mean and stage.running_mean.is_cuda


def test_one_gpu_trains_like_plain_lightning() -> None:
    """tests/models.py GPT (mask and position ids made on ``x.device`` in forward, tied head), 2 micro-batches."""
    check_training_equals_plain_lightning(CASES["gpt"], "gpu")


def test_example_gpt_trains_like_plain_lightning() -> None:
    """examples/gpt.py (scaled_dot_product_attention, mask on ``x.device``, tied head), 4 micro-batches."""
    check_training_equals_plain_lightning(CASES["example_gpt"], "gpu")


def test_resnet_with_batchnorm_trains_like_plain_lightning() -> None:
    """BatchNorm: one micro-batch, so its statistics are the batch's; running statistics must end equal too
    (``assert_same_training`` compares every buffer: running means and variances, ``num_batches_tracked``)."""
    check_resnet(CASES["resnet"], "gpu")


def check_resnet(case: Case, accelerator: str) -> None:
    pipelined, plain = check_training_equals_plain_lightning(case, accelerator)
    counts = {n: int(t) for n, t in pipelined.buffers.items() if n.endswith("num_batches_tracked")}
    assert counts and set(counts.values()) == {STEPS}, (
        counts
    )  # every BatchNorm ran in training mode each step
    means = [t for n, t in plain.buffers.items() if n.endswith("running_mean")]
    assert all(
        bool(t.abs().sum() > 0) for t in means
    )  # the statistics moved, so comparing them means something


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_tutorial_net_trains_like_plain_lightning(micro_batches: int) -> None:
    check_training_equals_plain_lightning(CASES["tutorial"], "gpu", micro_batches)


def test_step_readout_times_the_device_steps() -> None:
    """[Note: step readout] on CUDA: CUDA events at the step ends (no host sync), read once done."""
    check_step_readout(CASES["tutorial"], "gpu")


def check_step_readout(case: Case, accelerator: str) -> None:
    from lightning_autopart.lightning.readout import COUNT, START

    strategy = autopart(case.micro_batches)
    fit(case, strategy, accelerator=accelerator, max_steps=START + COUNT + 1, log_steps=False)
    readout = strategy.step_readout
    assert readout is not None and readout.step_ms is not None and readout.ratio is not None
    assert 0 < readout.step_ms < 10_000
