"""[Note: sample flow] on a GPU: a contrastive training step's loss is traced on fake CUDA tensors (the batch's
device), found to mix samples, and trained with one micro-batch as plain Lightning trains it."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_sample_flow import check_contrastive_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_contrastive_step_on_one_gpu_trains_as_plain_lightning() -> None:
    check_contrastive_step("gpu")
