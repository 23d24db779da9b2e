"""The strategy's single-GPU path: only this rank's tensors reach the device, training equals plain Lightning."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lightning_autopart.partitioning import move_in_place
from tests.distributed.launch import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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


def test_one_gpu_trains_like_plain_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_autopart import AutoPartitionStrategy
    from tests.distributed.strategy_cases import dataset, make_lit

    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(free_port()))
    results = []
    for strategy in (AutoPartitionStrategy(num_stages=1, micro_batches=2), "auto"):
        model = make_lit({"model": "gpt"})
        trainer = L.Trainer(
            accelerator="gpu",
            devices=1,
            strategy=strategy,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(dataset("gpt", 12), batch_size=4))
        assert all(p.is_cuda for p in model.parameters())
        results.append({n: p.detach().cpu() for n, p in model.named_parameters()})
    pipelined, plain = results
    for name, ref in plain.items():
        torch.testing.assert_close(pipelined[name], ref, rtol=1e-4, atol=1e-5, msg=name)
