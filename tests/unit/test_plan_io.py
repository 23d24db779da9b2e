"""Plan files: save/load round trip, structural validation, compatibility checks and corrupt files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import PlanFileError, PlanMismatchError
from lightning_autopart.plan import (
    SCHEMA_VERSION,
    Plan,
    Prediction,
    StagePlan,
    check_compatible,
    load_plan,
    save_plan,
)

HIDDEN = 512


def make_fingerprint(layers: int = 4, hidden: int = HIDDEN, model: str = "Net") -> dict[str, Any]:
    """The fingerprint of a stack of ``layers`` square linear layers, as ModelProfile.fingerprint() makes it."""
    count = hidden * hidden + hidden
    blocks = [
        {"name": f"layers.{i}", "param_count": count, "shapes_sha256": f"{hidden:016x}"}
        for i in range(layers)
    ]
    return {"model": model, "param_count": count * layers, "blocks": blocks}


def make_plan(
    num_stages: int = 2,
    replicas: int = 2,
    layers: int = 4,
    micro_batches: int = 4,
    schedule: str = "1F1B",
    batch_size: int = 64,
    stride_ranks: bool = False,
) -> Plan:
    """A consistent plan for ``make_fingerprint(layers)`` on ``num_stages * replicas`` a100-40gb devices."""
    fp = make_fingerprint(layers)
    cluster = Cluster.from_spec("a100-40gb", devices=num_stages * replicas)
    per = layers // num_stages
    stages = []
    for i in range(num_stages):
        start, end = i * per, (i + 1) * per if i < num_stages - 1 else layers
        ranks = (
            tuple(i + num_stages * r for r in range(replicas))
            if stride_ranks
            else tuple(range(i * replicas, (i + 1) * replicas))
        )
        count = sum(b["param_count"] for b in fp["blocks"][start:end])
        stages.append(
            StagePlan(
                index=i,
                block_start=start,
                block_end=end,
                blocks=tuple(f"layers.{k}" for k in range(start, end)),
                modules=tuple(f"layers.{k}" for k in range(start, end)),
                ranks=ranks,
                checkpoint=i == 0,
                param_count=count,
                fwd_us=1500.0 + 250.0 * i,
                bwd_us=3000.0 + 500.0 * i,
                p2p_us=120.5,
                allreduce_us=980.25,
                param_bytes=4 * count,
                grad_bytes=4 * count,
                optimizer_bytes=0,
                activation_bytes=3_000_000,
                in_flight=num_stages - i,
                memory_bytes=8 * count + 3_000_000,
            )
        )
    mbs = batch_size // (replicas * micro_batches)
    prediction = Prediction(
        step_us=40_000.0,
        compute_us=30_000.0,
        bubble_us=7_000.0,
        p2p_us=2_000.0,
        allreduce_us=1_000.0,
        samples_per_s=batch_size / 0.04,
        peak_memory_bytes=max(s.memory_bytes for s in stages),
    )
    return Plan(
        fingerprint=fp,
        cluster=cluster,
        batch_size=batch_size,
        micro_batches=micro_batches,
        micro_batch_size=mbs,
        schedule=schedule,
        chunks_per_rank=1,
        stages=tuple(stages),
        prediction=prediction,
        notes={"search_s": 0.25},
    )


def test_round_trip_is_exact(tmp_path: Path) -> None:
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    save_plan(plan, tmp_path / "again.json")
    assert load_plan(tmp_path / "again.json") == plan
    assert (tmp_path / "again.json").read_text() == path.read_text()


def test_json_is_pretty_sorted_with_schema_version_first() -> None:
    text = make_plan().to_json()
    assert text.startswith('{\n  "schema_version": 1,\n')
    data = json.loads(text)
    keys = list(data)
    assert keys[0] == "schema_version" and keys[1:] == sorted(keys[1:])
    assert list(data["stages"][0]) == sorted(data["stages"][0])
    assert Plan.from_dict(data) == make_plan()


def test_valid_plan_validates() -> None:
    make_plan().validate()
    make_plan(num_stages=4, replicas=1, layers=8, stride_ranks=True).validate()


def _replace_stage(plan: Plan, index: int, **changes: Any) -> Plan:
    stages = list(plan.stages)
    stages[index] = dataclasses.replace(stages[index], **changes)
    return dataclasses.replace(plan, stages=tuple(stages))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: _replace_stage(p, 1, block_start=3), "stage 1 starts at block 3, not at block 2"),
        (lambda p: _replace_stage(p, 0, block_start=1, blocks=("layers.1",)), "not at the first block"),
        (lambda p: _replace_stage(p, 1, block_end=3, blocks=("layers.2",)), "the model has 4 blocks"),
        (lambda p: _replace_stage(p, 1, ranks=(2, 9)), "ranks [9] outside the world size 4"),
        (lambda p: _replace_stage(p, 1, ranks=(2,)), "stage 1 has 1 replicas, stage 0 has 2"),
        (lambda p: _replace_stage(p, 1, ranks=(0, 1)), "rank 0 holds 2 stages"),
        (lambda p: _replace_stage(p, 1, fwd_us=-1.0), "stage 1: fwd_us is negative"),
        (lambda p: dataclasses.replace(p, micro_batch_size=3), "= 24, not the batch size 64"),
        (lambda p: dataclasses.replace(p, schedule="ZeroBubble"), "unknown schedule 'ZeroBubble'"),
        (lambda p: dataclasses.replace(p, schema_version=0), "schema_version is 0"),
        (lambda p: dataclasses.replace(p, stages=()), "the plan has no stages"),
        (lambda p: dataclasses.replace(p, fingerprint={"model": "Net"}), "fingerprint must hold model"),
    ],
)
def test_validation_names_the_problem(change: Any, message: str) -> None:
    with pytest.raises(PlanFileError, match="invalid plan") as info:
        change(make_plan()).validate()
    assert message in str(info.value)


def test_world_size_mismatch_names_both_values() -> None:
    plan = make_plan(num_stages=2, replicas=4)
    check_compatible(plan, world_size=8, batch_size=64, fingerprint=make_fingerprint())
    with pytest.raises(PlanMismatchError) as info:
        check_compatible(plan, world_size=4)
    assert str(info.value) == (
        "plan was made for world size 8, this job has 4 ranks; re-plan for 4 ranks with "
        "`autopart plan ... --devices 4 -o PLAN.json`"
    )  # `autopart show` checks too: load_plan, the strategy's option, is not named
    with pytest.raises(PlanMismatchError) as info:
        check_compatible(plan, world_size=4, loading=True)
    assert str(info.value).endswith(
        "re-plan for 4 ranks: drop load_plan (the strategy then plans for this job; save_plan keeps the new "
        "plan), or make a plan with `autopart plan ... --devices 4 -o PLAN.json`"
    )


def test_batch_size_mismatch() -> None:
    with pytest.raises(
        PlanMismatchError, match=r"global batch size 64, this job uses 32; re-plan for batch 32 with `autopart plan "
        r"\.\.\. --batch-size 32 -o PLAN\.json`$"
    ):
        check_compatible(make_plan(), batch_size=32)


def test_model_mismatch_names_block_and_counts() -> None:
    plan = make_plan()
    with pytest.raises(PlanMismatchError) as info:
        check_compatible(plan, fingerprint=make_fingerprint(hidden=256))
    assert "block 0 'layers.0' has 262,656 parameters in the plan, 65,792 in this model" in str(info.value)
    assert "the plan is for another model" in str(info.value)
    with pytest.raises(PlanMismatchError, match="plan has 4 blocks, this model has 6"):
        check_compatible(plan, fingerprint=make_fingerprint(layers=6))
    with pytest.raises(PlanMismatchError, match="plan was made for model 'Net', this model is 'Other'"):
        check_compatible(plan, fingerprint=make_fingerprint(model="Other"))
    renamed = make_fingerprint()
    renamed["blocks"][2]["name"] = "head"
    with pytest.raises(PlanMismatchError, match=r"block 2 is 'layers\.2' in the plan, 'head' in this model"):
        check_compatible(plan, fingerprint=renamed)
    reshaped = make_fingerprint()
    reshaped["blocks"][1]["shapes_sha256"] = "0" * 16
    with pytest.raises(PlanMismatchError, match=r"block 1 'layers\.1' has parameters of other shapes"):
        check_compatible(plan, fingerprint=reshaped)


def _write(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(content)
    return path


def _mutated(edit: Any) -> str:
    data = json.loads(make_plan().to_json())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("this is not json", "is not valid JSON (Expecting value at line 1, column 1)"),
        ("[1, 2]", "a plan must be a JSON object, got list"),
        ("{}", "missing field 'schema_version'"),
        (
            _mutated(lambda d: d.update(schema_version=SCHEMA_VERSION + 1)),
            "newer than this lightning_autopart",
        ),
        (_mutated(lambda d: d.update(schema_version="1")), "schema_version must be a positive integer"),
        (_mutated(lambda d: d.pop("prediction")), "missing field 'prediction'"),
        (_mutated(lambda d: d["stages"][1].pop("fwd_us")), "missing field 'stages[1].fwd_us'"),
        (_mutated(lambda d: d["stages"][0].update(fwd_us="fast")), "stages[0].fwd_us must be a number"),
        (_mutated(lambda d: d["stages"][0].update(ranks=[0, 1.5])), "stages[0].ranks[1] must be an integer"),
        (
            _mutated(lambda d: d["stages"][0].update(checkpoint=1)),
            "stages[0].checkpoint must be true or false",
        ),
        (_mutated(lambda d: d.update(stages={})), "stages must be a list, got an object"),
        (_mutated(lambda d: d["stages"][0].update(checkpointing=True)), "did you mean 'checkpoint'?"),
        (_mutated(lambda d: d["cluster"].update(nodes=0)), "cluster: a cluster needs at least one node"),
        (_mutated(lambda d: d.update(batch_size=65)), "not the batch size 65"),
    ],
)
def test_corrupt_file_names_path_and_problem(tmp_path: Path, content: str, message: str) -> None:
    path = _write(tmp_path, content)
    with pytest.raises(PlanFileError) as info:
        Plan.load(path)
    assert not isinstance(info.value, PlanMismatchError)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_missing_file_and_unwritable_path(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match="does not exist"):
        load_plan(tmp_path / "nope.json")
    with pytest.raises(PlanFileError, match="cannot write plan file"):
        save_plan(make_plan(), tmp_path / "no-such-dir" / "plan.json")
    assert list(tmp_path.iterdir()) == []


def test_nan_prediction_cannot_be_saved(tmp_path: Path) -> None:
    plan = make_plan()
    bad = dataclasses.replace(
        plan, prediction=dataclasses.replace(plan.prediction, samples_per_s=float("nan"))
    )
    with pytest.raises(PlanFileError, match="cannot write plan as JSON"):
        bad.save(tmp_path / "plan.json")


def test_example_in_the_docs_is_a_valid_plan() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "plan-format.md").read_text()
    example = text.split("```json\n", 1)[1].split("```", 1)[0]
    plan = Plan.from_dict(json.loads(example))
    plan.validate()
    assert plan.to_json() == example
