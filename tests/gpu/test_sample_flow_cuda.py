"""[Note: sample flow] and [Note: a loss that grows] on a GPU: a contrastive training step's loss is traced on
fake CUDA tensors (the batch's device) and a summed loss run on random CUDA outputs; each is found, and trained
with one micro-batch as plain Lightning trains it."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_sample_flow import check_contrastive_step
from tests.unit.test_step_checks import check_summed_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_contrastive_step_on_one_gpu_trains_as_plain_lightning() -> None:
    check_contrastive_step("gpu")


def test_a_summed_loss_on_one_gpu_trains_as_plain_lightning() -> None:
    check_summed_loss("gpu")
