"""Two ranks with different string hash seeds (PYTHONHASHSEED unset gives each process its own) and models that
loop over a set of strings, as transformers' Gemma 3 does: where only the order of independent values differs,
the pipeline trains exactly as one process does, and so do replicas whose backward readies their gradients in
another order; where the blocks differ, every rank refuses with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed._hash_order_script import KINDS, Heads, Tables, fit
from tests.distributed.launch import hash_seeds_apart, run_job

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_hash_order_script.py")


def test_ranks_that_run_the_forward_in_another_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seed, child = hash_seeds_apart(KINDS, KINDS[:4])
    monkeypatch.setenv("PYTHONHASHSEED", str(seed))
    code, log = run_job([str(SCRIPT), str(tmp_path), str(child)], 2, "lightning", 180)
    assert code == 0, log[-6000:]
    got = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)}
    assert got[0]["order"] != got[1]["order"], "the ranks ran the loop in one order: the test proves nothing"

    model, losses = fit(Tables, "auto", 1)  # the reference: one process
    expected = dict(model.named_parameters())
    for rank, result in got.items():
        assert result["losses"] == pytest.approx(losses, rel=1e-6), f"rank {rank}: the losses differ"
        for name, value in result["params"].items():
            assert torch.allclose(value, expected[name].detach(), rtol=1e-5, atol=1e-7), f"rank {rank}: {name}"
    assert set(got[0]["params"]) | set(got[1]["params"]) == set(expected)

    model, losses = fit(Heads, "auto", 1, replicas=2)  # two replicas whose stages list their heads apart
    expected = dict(model.named_parameters())
    heads = [torch.load(tmp_path / f"heads{rank}.pt") for rank in range(2)]
    assert [sum(pair) / 2 for pair in zip(heads[0]["losses"], heads[1]["losses"], strict=True)] == pytest.approx(
        losses, rel=1e-5
    )
    for rank, result in enumerate(heads):
        for name, value in result["params"].items():
            assert torch.allclose(value, expected[name].detach(), rtol=1e-5, atol=1e-7), f"rank {rank}: {name}"

    for rank in range(2):  # other blocks on each rank: refused on every rank, with the fix
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "the ranks captured different graphs of Branches (ranks [1] differ from rank 0)" in message, message
        assert "PYTHONHASHSEED=0" in message
