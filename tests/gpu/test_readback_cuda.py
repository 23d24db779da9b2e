"""CUDA twins of ``tests/unit/test_readback.py``: a step's value reads are seen on real device tensors, and the
strategy's plan on a GPU says how often its loop reads back ([Note: reads back])."""

from __future__ import annotations

import pytest
import torch

from lightning_autopart.lightning.step_loss import step_loss
from lightning_autopart.profile.readback import LoopFacts, readback_every
from tests.unit.test_readback import Logged, _fit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_read_of_a_cuda_value_is_seen_and_the_step_still_runs() -> None:
    module = Logged(read=True).cuda()
    batch = next(iter(module.train_dataloader()))
    loss = step_loss(module, "", batch, 8)
    output = torch.randn(8, 1, device="cuda", requires_grad=True)
    loss(output, 8).backward()  # the read works on the device: the loss is priced, and the read recorded
    assert loss.reads.seen and loss.reads.values == ["item"]
    assert readback_every(loss.reads, LoopFacts(progress_every=0, log_every=0)) == 1


@pytest.mark.usefixtures("master_port")
def test_the_plan_on_a_gpu_says_how_often_the_loop_reads_back() -> None:
    quiet = _fit(Logged(prog_bar=True), accelerator="gpu")
    assert quiet.plan is not None and quiet.plan.notes["loader"].endswith("reads back never")
    read = _fit(Logged(read=True), accelerator="gpu")
    assert read.plan is not None and read.plan.notes["loader"].endswith("reads back every step")
