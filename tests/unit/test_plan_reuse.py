"""Plan reuse in one process: the fingerprint of a capture is the fingerprint of its profile (so a plan saved by
``autopart plan`` or by the strategy matches the model that loads it), ``load_plan`` neither profiles nor plans,
and every mismatch (model, world size, batch, max_blocks, idle ranks, a pipeline depth that does not divide the
devices) names the difference and the fix."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_autopart.partition
import lightning_autopart.planner
from lightning_autopart.capture import capture
from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError, PlanMismatchError
from lightning_autopart.lightning.first_batch import PlanSettings, _make_plan, plan_for_batch
from lightning_autopart.lightning.hooks import ForwardCall, find_forward
from lightning_autopart.lightning.reuse import LoadedPlan
from lightning_autopart.plan import Plan, check_every_rank, planning_seconds
from lightning_autopart.planner import profile_model
from lightning_autopart.profile.records import capture_fingerprint
from tests.distributed.strategy_cases import Lit, dataset
from tests.models import example, make
from tests.unit.test_plan_io import make_plan

CPU = torch.device("cpu")

#: Zoo models with tied weights (called_twice, gpt), skips (residual), several inputs, structured outputs.
ZOO = ["mlp", "residual", "gpt", "resnet", "two_inputs", "called_twice", "structured", "huge_child"]


@pytest.mark.parametrize("name", ZOO)
def test_fingerprint_of_a_capture_is_that_of_its_profile(name: str) -> None:
    model, inputs = make(name), example(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # structured's dropped cache
        profiled = profile_model(model, inputs, profile="estimate", spec="a100-40gb", up_to=8).fingerprint()
        assert capture_fingerprint(capture(model, inputs)) == profiled
        # at another batch size too: the strategy checks a loaded plan on its capture at the micro-batch size
        half = tuple(x[:1] for x in inputs) if isinstance(inputs, tuple) else inputs[:1]
        assert capture_fingerprint(capture(model, half)) == profiled


def test_fingerprint_of_a_measured_profile_with_curves() -> None:
    model, inputs = make("gpt"), example("gpt")
    measured = profile_model(model, inputs, profile="measure", up_to=2, max_blocks=8)  # curves at 1 and 2
    assert capture_fingerprint(capture(model, inputs, max_blocks=8)) == measured.fingerprint()


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_fingerprint_of_a_hugging_face_capture(name: str) -> None:
    pytest.importorskip("transformers")
    from tests.hf_cases import build
    from tests.hf_cases import dataset as hf_dataset

    model, inputs = build(name), ((), dict(hf_dataset(name, 2).columns))
    with warnings.catch_warnings(), torch.enable_grad():
        warnings.simplefilter("ignore")  # the key/value cache is dropped
        profiled = profile_model(model, inputs, profile="estimate", spec="a100-40gb").fingerprint()
        fingerprint = capture_fingerprint(capture(model, inputs))
    assert fingerprint == profiled
    assert fingerprint["param_count"] == sum(p.numel() for p in model.parameters())  # tied weights once


def _call(model: Lit, samples: int = 4) -> ForwardCall:
    batch = list(dataset(model.name, samples).tensors)
    return find_forward(model, lambda: model.training_step(batch, 0))


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    """A 2-stage plan of Lit("mlp") for 2 ranks at 4 samples per replica, made by the strategy's planner."""
    model = Lit("mlp")
    made = _make_plan(PlanSettings(num_stages=2, micro_batches=2, profile="estimate"), model, _call(model), 4, 2, 1, CPU)
    assert isinstance(made, Plan)
    path = tmp_path / "plan.json"
    made.save(path)
    return path


def test_the_plan_records_how_long_planning_took(plan_file: Path) -> None:
    seconds = planning_seconds(Plan.load(plan_file))  # the file's validation accepts the note
    assert seconds is not None and 0 < seconds < 60


def test_load_plan_captures_once_and_neither_profiles_nor_plans(
    plan_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("load_plan must not profile or plan")

    monkeypatch.setattr(lightning_autopart.planner, "profile_model", refuse)
    monkeypatch.setattr(lightning_autopart.partition, "partition", refuse)
    model = Lit("mlp")
    settings = PlanSettings(load_plan=str(plan_file))
    loaded = _make_plan(settings, model, _call(model), 4, 2, 1, CPU)
    assert isinstance(loaded, LoadedPlan)
    assert loaded.plan == Plan.load(plan_file)
    assert loaded.captured.batch_size == loaded.plan.micro_batch_size == 2  # the capture the stages are built from
    # plan_for_batch on rank 0 (no process group: one process) hands that capture on and logs what it skipped
    plan, captured = plan_for_batch(
        settings, model, _call(model), 4, rank=0, world_size=2, num_nodes=1, device=CPU
    )
    assert plan == loaded.plan and captured is not None and captured.batch_size == 2
    out = capsys.readouterr().out
    made = planning_seconds(plan)
    assert made is not None
    assert (
        f"autopart: loaded plan {plan_file} (2 stages x 1 replica, {plan.schedule}); skipped capture, profiling "
        "and planning "
        f"({made:.1f} s when it was made; loading and checking took "
    ) in out


def test_another_model_is_refused(plan_file: Path) -> None:
    other = Lit("residual")
    with pytest.raises(PlanMismatchError) as info:
        _make_plan(PlanSettings(load_plan=str(plan_file)), other, _call(other), 4, 2, 1, CPU)
    message = str(info.value)
    assert message.startswith(f"load_plan {plan_file}: ")
    assert "the plan is for another model; re-plan for this model: drop load_plan (the strategy" in message


def test_another_world_size_is_refused(plan_file: Path) -> None:
    model = Lit("mlp")
    with pytest.raises(
        PlanMismatchError,
        match=r"plan was made for world size 2, this job has 4 ranks; re-plan for 4 ranks: drop load_plan .* "
        r"`autopart plan \.\.\. --devices 4 -o PLAN\.json`$",
    ):
        _make_plan(PlanSettings(load_plan=str(plan_file)), model, _call(model, 8), 8, 4, 1, CPU)


def test_another_batch_is_refused(plan_file: Path) -> None:
    model = Lit("mlp")
    with pytest.raises(PlanMismatchError) as info:
        _make_plan(PlanSettings(load_plan=str(plan_file)), model, _call(model, 8), 8, 2, 1, CPU)
    assert str(info.value) == (
        f"load_plan {plan_file}: the plan was made for a global batch of 4 samples (4 per replica x 1 replica), "
        "this job's loader gives batches of 8 (8 in all); set the DataLoader's batch_size to 4, or re-plan for "
        "this batch: drop load_plan (save_plan writes the new plan)"
    )


def test_another_max_blocks_is_refused(plan_file: Path, tmp_path: Path) -> None:
    model = Lit("residual")
    call = _call(model)
    made = _make_plan(PlanSettings(num_stages=2, micro_batches=2, profile="estimate"), model, call, 4, 2, 1, CPU)
    assert isinstance(made, Plan)
    blocks = len(made.fingerprint["blocks"])
    edited = tmp_path / "edited.json"
    dataclasses.replace(made, notes={**made.notes, "max_blocks": 2}).save(edited)  # as if planned with --max-blocks 2
    with pytest.raises(PlanMismatchError, match=rf"the plan has {blocks} blocks, this model has 1 \(or was captured "
                       r"with another --max-blocks\)"):  # fmt: skip
        _make_plan(PlanSettings(load_plan=str(edited)), model, call, 4, 2, 1, CPU)


def test_a_plan_leaving_ranks_idle_is_refused() -> None:
    plan = make_plan(num_stages=2, replicas=2)
    check_every_rank(plan)
    wider = dataclasses.replace(plan, cluster=Cluster.from_spec("a100-40gb", devices=8))
    with pytest.raises(
        PlanMismatchError,
        match=r"the plan runs on 4 of the 8 ranks it was made for \(2 stages x 2 replicas\) and every rank of a job "
        r"must hold a stage; re-plan with stages x replicas = 8 \(leave --replicas out\), or with --devices 4",
    ):
        check_every_rank(wider)


def test_stages_that_do_not_divide_the_devices_are_refused() -> None:
    model = Lit("mlp")
    settings = PlanSettings(num_stages=2, profile="estimate")
    with pytest.raises(
        ConfigError,
        match=r"num_stages=2 does not divide the 3 devices: every stage runs on the same number of replicas, so 1 "
        r"device\(s\) would hold no stage; use a multiple of 2 devices \(2 or 4\), or num_stages=1 or 3$",
    ):
        _make_plan(settings, model, _call(model), 4, 3, 1, CPU)


@pytest.mark.parametrize("accumulate", [1, 4])
def test_gradient_accumulation_is_planned_with_persistent_gradients(
    accumulate: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer(accumulate_grad_batches > 1) keeps gradients through every step: the planner prices them
    ([Note: fresh gradients] in partition/cost.py); without accumulation they start each step absent."""
    import lightning_autopart.partition as partition_module

    seen: list[bool] = []
    real = partition_module.partition

    def spy(*args: Any, **kwargs: Any) -> Plan:
        seen.append(kwargs["persistent_grads"])
        return real(*args, **kwargs)

    monkeypatch.setattr(partition_module, "partition", spy)
    model = Lit("mlp")
    settings = PlanSettings(num_stages=2, micro_batches=2, profile="estimate", accumulate=accumulate)
    assert isinstance(_make_plan(settings, model, _call(model), 4, 2, 1, CPU), Plan)
    assert seen == [accumulate > 1]
