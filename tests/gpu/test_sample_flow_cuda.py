"""[Note: sample flow], [Note: a loss that grows] and [Note: statistics transformed] on a GPU: a contrastive
training step's loss and a root-mean-square loss are traced on fake CUDA tensors (the batch's device) and a
summed loss run on random CUDA outputs; each is found, and trained as plain Lightning trains it. What a step
returns beside its loss reaches ``on_train_batch_end`` merged over micro-batches ([Note: a step's other
outputs])."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_sample_flow import check_contrastive_step
from tests.unit.test_step_checks import check_summed_loss
from tests.unit.test_step_outputs import _RaggedReturns, check_step_outputs
from tests.unit.test_transformed_loss import _Rmse, check_transformed_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_contrastive_step_on_one_gpu_trains_as_plain_lightning() -> None:
    check_contrastive_step("gpu")


def test_a_summed_loss_on_one_gpu_trains_as_plain_lightning() -> None:
    check_summed_loss("gpu")


def test_a_root_mean_square_loss_on_one_gpu_keeps_one_micro_batch() -> None:
    check_transformed_loss(_Rmse, "sqrt", "gpu")


def test_a_steps_other_outputs_on_one_gpu_reach_on_train_batch_end() -> None:
    check_step_outputs(_RaggedReturns, "gpu")
