"""Transparency of PipelineRunner on 2 and 4 gloo CPU ranks launched with torchrun: equal to one process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.launch import TIMED_OUT, free_port, run_job
from tests.distributed.runtime_cases import BATCH, batches, loss_fn
from tests.models import make

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_runtime_worker.py")
ROOT = Path(__file__).resolve().parents[2]

#: (stages, replicas) per world size.
LAYOUTS = {2: [(1, 2), (2, 1)], 4: [(4, 1), (2, 2)]}
#: gpt: a bool causal mask and a tied weight cross cuts; positional: int64 position ids and a bool mask reach
#: every layer.
MODELS = ("mlp", "residual", "gpt", "positional")
SCHEDULES = ("GPipe", "1F1B")
CASES = (
    [
        {"model": m, "stages": s, "replicas": r, "schedule": k}
        for world in LAYOUTS
        for s, r in LAYOUTS[world]
        for m in MODELS
        for k in SCHEDULES
    ]
    + [
        {"model": m, "stages": 4, "replicas": 1, "schedule": "Interleaved1F1B", "chunks": 2}
        for m in ("mlp", "gpt", "positional")
    ]
    + [  # gradient accumulation: sync=False steps, then one all-reduce per optimizer step
        {"model": m, "stages": s, "replicas": r, "schedule": k, "accumulate": a}
        for m, s, r, k, a in (
            ("mlp", 1, 2, "GPipe", 3),
            ("residual", 2, 1, "1F1B", 2),
            ("mlp", 2, 2, "GPipe", 2),
            ("gpt", 2, 2, "1F1B", 2),
        )
    ]
)


def _launch(world: int, cases: list[dict[str, Any]], out: Path, timeout: float = 150.0) -> dict[int, Any]:
    """Run the worker under torchrun on ``world`` ranks; return {rank: results}."""
    (out / "cases.json").write_text(json.dumps(cases))
    code, log = run_job([str(WORKER), str(out / "cases.json"), str(out)], world, "torchrun", timeout)
    if code == TIMED_OUT:
        pytest.fail(f"torchrun on {world} ranks timed out after {timeout} s:\n{log[-4000:]}")
    assert code == 0, f"torchrun on {world} ranks failed:\n{log[-4000:]}"
    return {r: torch.load(out / f"rank{r}.pt") for r in range(world)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[int, Any]]:
    """Results of every case, by world size then rank (one torchrun launch per world size)."""
    return {world: _launch(world, CASES, tmp_path_factory.mktemp(f"world{world}")) for world in LAYOUTS}


def _reference(model_name: str, accumulate: int = 1) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Parameters and losses after the same SGD steps in one process on the global batches."""
    model = make(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of = loss_fn(model_name)
    losses = []
    for x, y in batches(model_name, BATCH * accumulate):
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def _case_id(index: int) -> str:
    case = CASES[index]
    return "{model}-{stages}x{replicas}-{schedule}".format(**case) + (
        f"-accumulate{case['accumulate']}" if "accumulate" in case else ""
    )


@pytest.mark.parametrize("index", range(len(CASES)), ids=_case_id)
def test_pipeline_equals_single_process(runs: dict[int, dict[int, Any]], index: int) -> None:
    case = CASES[index]
    world = case["stages"] * case["replicas"] // case.get("chunks", 1)
    ranks = runs[world]
    expected, expected_losses = _reference(case["model"], case.get("accumulate", 1))
    seen: set[str] = set()
    for rank, results in ranks.items():
        got = results[index]
        for name, value in got["params"].items():
            ref = expected[name]
            error = ((value - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert error < 1e-5, f"rank {rank}: {name} differs (relative error {error:.2e})"
            seen.add(name)
    assert seen == set(expected), f"parameters held by no rank: {sorted(set(expected) - seen)}"
    last = [r[index]["losses"] for r in ranks.values() if r[index]["losses"][0] is not None]
    assert len(last) == case["replicas"]
    losses = [sum(step) / len(step) for step in zip(*last, strict=True)]
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    if "accumulate" in case:  # one all-reduce round per optimizer step, none while accumulating
        for rank, results in ranks.items():
            counts = results[index]["all_reduces"]
            assert counts[False] == 0, f"rank {rank} all-reduced {counts[False]} times in sync=False steps"
            assert (counts[True] > 0) == (case["replicas"] > 1), f"rank {rank}: {counts[True]} all-reduces"


@pytest.mark.parametrize("index", range(len(CASES)), ids=_case_id)
def test_the_last_stage_keeps_no_output_its_loss_does_not_save(runs: dict[int, dict[int, Any]], index: int) -> None:
    """A cross entropy saves none of the logits: once a micro-batch's loss is computed, nothing holds them (the
    schedules' own references dropped, [Note: the last stage's outputs]). GPipe kept every one till backward."""
    case = CASES[index]
    if loss_fn(case["model"]) is F.mse_loss:
        pytest.skip("a mean squared error saves its input for backward")
    world = case["stages"] * case["replicas"] // case.get("chunks", 1)
    for rank, results in runs[world].items():
        got = results[index]
        if got["losses"][0] is not None:  # the last stage
            assert got["outputs_alive"] == 0, f"rank {rank}: {got['outputs_alive']} earlier outputs alive at a loss"


@pytest.fixture
def single_process_pg() -> None:
    """A gloo process group of one rank in this process (torn down by conftest)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)


@pytest.mark.usefixtures("single_process_pg")
def test_one_rank_step_eval_and_batch_check() -> None:
    from lightning_autopart.capture import capture
    from lightning_autopart.errors import ConfigError
    from lightning_autopart.runtime.runner import PipelineRunner
    from tests.distributed.runtime_cases import make_case_plan, micro_example

    model = make("residual")
    captured = capture(model, micro_example("residual"), method="export")
    case = {"model": "residual", "stages": 1, "replicas": 1, "schedule": "1F1B"}
    runner = PipelineRunner(
        make_case_plan(case, captured.num_blocks), captured, 0, "cpu", loss_fn("residual")
    )
    (x, y), _, _ = batches("residual")
    expected = loss_fn("residual")(model(x), y)
    loss = runner.step(x, y)
    assert loss is not None and loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(runner.eval_step(x), model(x))
    with pytest.raises(ConfigError, match="needs 8 samples per replica"):
        runner.step(x[:6], y[:6])


@pytest.mark.usefixtures("single_process_pg")
def test_buckets_hold_grads_as_views_and_keep_autograd_semantics() -> None:
    from torch import nn

    from lightning_autopart.runtime.buckets import make_buckets

    torch.manual_seed(0)
    used, unused, half = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64)
    params = [*used.parameters(), *unused.parameters(), *half.parameters()]
    group = torch.distributed.group.WORLD
    buckets = make_buckets(params, micro_batches=2, group=group)
    assert sorted(len(b.params) for b in buckets) == [2, 4]  # one dtype per bucket
    assert all(p.dtype == b.flat.dtype for b in buckets for p in b.params)
    earlier = torch.ones(4, dtype=torch.float64)
    half.bias.grad = earlier.clone()  # a gradient from before the step (accumulation), not a view
    for b in buckets:
        b.attach(active=True)
    x = torch.randn(3, 4)
    for micro in x.split([2, 1]):
        (used(micro).sum() + half(micro.double()).sum()).backward()
    expected = {n: p.grad.clone() for n, p in [("w", used.weight), ("b", half.bias)]}
    for b in buckets:
        for p, view in zip(b.params, b.views, strict=True):
            assert p.grad is None or p.grad.data_ptr() == view.data_ptr()
        b.finish(replicas=2)  # one rank: the sum is the gradient itself, then halved
    torch.testing.assert_close(used.weight.grad, expected["w"] / 2)
    torch.testing.assert_close(half.bias.grad, expected["b"] / 2)
    assert expected["b"][0].item() == pytest.approx(
        earlier[0].item() + 3
    )  # 1 + three samples' d(sum)/d(bias)
    assert unused.weight.grad is None and unused.bias.grad is None  # no gradient, none before: left None
    for p in params:  # zero_grad(set_to_none=False): views stay and are zeroed in place
        if p.grad is not None:
            p.grad.zero_()
    pointers = [p.grad.data_ptr() if p.grad is not None else None for p in params]
    for b in buckets:
        b.attach(active=False)
    assert all(ptr is None or p.grad.data_ptr() == ptr for p, ptr in zip(params, pointers, strict=True))
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in params)
    for p in params:  # zero_grad(): a local (sync=False) step leaves unused parameters' gradients None
        p.grad = None
    for b in buckets:
        b.attach(active=False)
    used(x).sum().backward()
    for b in buckets:
        b.finish(replicas=2, sync=False)  # no all-reduce, no averaging
    torch.testing.assert_close(used.bias.grad, torch.full((4,), 3.0))
    assert all(p.grad is None for p in [*unused.parameters(), *half.parameters()])
