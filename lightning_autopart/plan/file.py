"""The Plan: stages, replicas, ranks, micro-batches, schedule and predictions; the JSON boundary of planning.

Format and fields: docs/plan-format.md. A plan is immutable; ``save``/``load`` round-trip it exactly. Its checks
against a model and a job are in :mod:`lightning_autopart.plan.checks`.
"""

from __future__ import annotations

import difflib
import json
import os
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import PlanFileError

__all__ = [
    "LAYOUTS",
    "PROFILE_MODES",
    "SCHEDULES",
    "SCHEMA_VERSION",
    "Plan",
    "Prediction",
    "StagePlan",
    "load_plan",
    "save_plan",
]

#: Version of the plan file format; bumped on any incompatible change.
SCHEMA_VERSION = 1

#: Schedule names a plan may carry (names of torch.distributed.pipelining schedules without "Schedule").
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")

#: Values of ``Plan.profile_mode``.
PROFILE_MODES = ("measure", "estimate")

#: Values of ``Plan.layout``.
LAYOUTS = ("pipeline-major", "stage-major")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous range of blocks, replicated on ``len(ranks)`` devices."""

    #: Stage index in pipeline order (with interleaving, the virtual stage index).
    index: int
    #: First block of the stage (inclusive).
    block_start: int
    #: One past the last block of the stage.
    block_end: int
    #: Names of the blocks, in order.
    blocks: tuple[str, ...]
    #: FQNs of the modules the stage instantiates.
    modules: tuple[str, ...]
    #: Global ranks holding a replica of this stage, one per data-parallel replica.
    ranks: tuple[int, ...]
    #: Whether activations are recomputed in backward (activation checkpointing).
    checkpoint: bool
    #: Parameter elements in the stage (tied parameters counted in every stage that holds a copy).
    param_count: int
    #: Forward time of one micro-batch, microseconds (recompute not included).
    fwd_us: float
    #: Backward time of one micro-batch, microseconds (recompute included when checkpointing).
    bwd_us: float
    #: Point-to-point time per micro-batch charged to this stage (send activations, send input gradients).
    p2p_us: float
    #: Gradient all-reduce time among the stage's replicas, once per step.
    allreduce_us: float
    #: Parameter bytes on one device.
    param_bytes: int
    #: Gradient bytes on one device.
    grad_bytes: int
    #: Optimizer-state bytes on one device.
    optimizer_bytes: int
    #: Activation bytes at peak (in-flight micro-batches of the schedule) on one device.
    activation_bytes: int
    #: Micro-batches whose activations the stage holds at peak under the schedule.
    in_flight: int
    #: Predicted peak memory on one device: params + grads + optimizer + activations + transient + buffers
    #: + batch and pipeline buffers.
    memory_bytes: int
    #: Backward's transient peak on one device (one micro-batch's gradients and temporaries).
    transient_bytes: int = 0
    #: The replica's batch on the device and the pipeline's receive buffers and held outputs, at the
    #: activations' peak (see [Note: pipeline buffers] in partition/cost.py).
    io_bytes: int = 0
    #: The optimizer step over the stage's parameters, once per step, microseconds.
    optimizer_us: float = 0.0

    @property
    def replicas(self) -> int:
        """Number of data-parallel replicas of the stage."""
        return len(self.ranks)


@dataclass(frozen=True)
class Prediction:
    """Predicted time of one optimizer step (one global batch) and its parts, in microseconds."""

    #: Whole step.
    step_us: float
    #: Compute of the bottleneck stage over all micro-batches.
    compute_us: float
    #: Pipeline fill and drain (idle time of the bottleneck stage).
    bubble_us: float
    #: Point-to-point communication of the bottleneck stage not hidden by compute.
    p2p_us: float
    #: Gradient all-reduce at the end of the step.
    allreduce_us: float
    #: Global samples per second.
    samples_per_s: float
    #: Largest predicted per-device memory over all stages.
    peak_memory_bytes: int
    #: Optimizer step of the bottleneck stage, after its all-reduce.
    optimizer_us: float = 0.0
    #: Host time not hidden behind the math: the bottleneck's per-action overheads and the step's fixed work.
    host_us: float = 0.0
    #: The training loader's time in the step: what of a batch made by the training process the device's work
    #: does not hide, or what its workers' pace adds (see [Note: loader in the step] in partition/cost.py).
    data_us: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A complete partition plan for one model on one cluster at one global batch size."""

    #: What identifies the model: ``ModelProfile.fingerprint()``.
    fingerprint: dict[str, Any]
    #: The cluster the plan is for.
    cluster: Cluster
    #: Global batch size (samples per optimizer step over all replicas).
    batch_size: int
    #: Micro-batches per replica per step.
    micro_batches: int
    #: Samples in one micro-batch: batch_size / (replicas * micro_batches).
    micro_batch_size: int
    #: Schedule name, one of :data:`SCHEDULES`.
    schedule: str
    #: Model chunks per rank (1, or 2+ for interleaved schedules).
    chunks_per_rank: int
    #: Stages in pipeline order.
    stages: tuple[StagePlan, ...]
    #: Predicted step time and memory.
    prediction: Prediction
    #: Optimizer the memory figures assume.
    optimizer: str = "sgd"
    #: "measure" or "estimate": how the profile was taken.
    profile_mode: str = "estimate"
    #: Device the times refer to.
    device: str = "cpu"
    #: How ranks were laid out: "pipeline-major" (a pipeline's stages on consecutive ranks) or "stage-major".
    layout: str = "pipeline-major"
    #: Plan file schema version.
    schema_version: int = SCHEMA_VERSION
    #: Free-form notes from the planner (search statistics, why checkpointing was turned on, ...).
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        """Number of (virtual) pipeline stages."""
        return len(self.stages)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas per stage (the same for every stage in schema version 1)."""
        return self.stages[0].replicas

    @property
    def world_size(self) -> int:
        """Ranks the plan uses."""
        return len({r for s in self.stages for r in s.ranks})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see docs/plan-format.md)."""
        return asdict(self)

    def to_json(self) -> str:
        """Pretty JSON: ``schema_version`` first, every other key sorted, two-space indent, newline at the end."""
        data = _sorted(self.to_dict())
        data = {"schema_version": data.pop("schema_version"), **data}
        try:
            return json.dumps(data, indent=2, allow_nan=False) + "\n"
        except ValueError as err:  # NaN or infinity in a prediction
            raise PlanFileError(
                f"cannot write plan as JSON: {err} (a predicted time or size is NaN or infinite, so the profile "
                "it came from is broken); profile again, with the other profile mode if it repeats"
            ) from None

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Inverse of :meth:`to_dict`, checking every field's presence and type (raises :class:`PlanFileError`)."""
        if not isinstance(data, dict):
            raise PlanFileError(f"a plan must be a JSON object, got {type(data).__name__}")
        _check_schema_version(data)
        plan = _build(cls, data, "")
        assert isinstance(plan, Plan)
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan to ``path`` as JSON (atomically: a temporary file is renamed over it)."""
        text = self.to_json()
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise PlanFileError(
                f"cannot write plan file {target}: {err.strerror or err}; give a path in an existing, writable "
                "directory"
            ) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file written by :meth:`save` (raises :class:`PlanFileError`)."""
        source = Path(path)
        try:
            text = source.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PlanFileError(
                f"plan file {source} does not exist; check the path, or write the plan first "
                "(`autopart plan ... -o PLAN.json`, or the strategy's save_plan)"
            ) from None
        except UnicodeDecodeError as err:
            raise PlanFileError(f"cannot read plan file {source}: {err}; {_rewrite_hint(source)}") from None
        except OSError as err:
            raise PlanFileError(
                f"cannot read plan file {source}: {err.strerror or err}; give a readable JSON file written by "
                "`autopart plan -o` or the strategy's save_plan"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanFileError(
                f"plan file {source} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
                + _rewrite_hint(source)
            ) from None
        if isinstance(data, dict):
            try:  # a version this release does not read: its own fix (upgrade, or re-plan)
                _check_schema_version(data)
            except PlanFileError as err:
                raise PlanFileError(f"plan file {source}: {err}") from None
        try:
            plan = cls.from_dict(data)
            plan.validate()
        except PlanFileError as err:
            raise PlanFileError(f"plan file {source}: {err}; {_rewrite_hint(source)}") from None
        return plan

    def validate(self) -> None:
        """Check the plan's structure; raise :class:`PlanFileError` listing every problem found."""
        from lightning_autopart.plan.checks import structure_problems  # checks imports this module

        problems = structure_problems(self)
        if problems:
            raise PlanFileError("invalid plan: " + "; ".join(problems))


def _rewrite_hint(source: Path) -> str:
    """The fix of a plan file that does not read as a plan (edited by hand, truncated, or not a plan at all)."""
    return (
        f"it is not a plan as lightning_autopart writes one (edited, truncated or another file): re-plan and "
        f"save it again (`autopart plan ... -o {source}`, or the strategy's save_plan)"
    )


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` to ``path`` (see :meth:`Plan.save`)."""
    plan.save(path)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan file (see :meth:`Plan.load`)."""
    return Plan.load(path)


def _sorted(value: Any) -> Any:
    """``value`` with every dict's keys sorted (recursively) and tuples turned into lists."""
    if isinstance(value, dict):
        return {str(k): _sorted(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


def _check_schema_version(data: dict[str, Any]) -> None:
    """Refuse files without a schema version, or written by a newer lightning_autopart."""
    version = data.get("schema_version")
    if version is None:
        raise PlanFileError(
            "missing field 'schema_version'; is this a plan file written by `autopart plan -o`?"
        )
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise PlanFileError(f"schema_version must be a positive integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise PlanFileError(
            f"schema_version {version} is newer than this lightning_autopart reads (up to {SCHEMA_VERSION}); "
            "upgrade lightning_autopart or re-plan with this version"
        )
    if version < SCHEMA_VERSION:
        raise PlanFileError(
            f"schema_version {version} is older than this lightning_autopart reads ({SCHEMA_VERSION}); re-plan"
        )


def _build(cls: type, data: Any, where: str) -> Any:
    """Instantiate dataclass ``cls`` from a JSON object, checking fields; ``where`` names it in messages."""
    if not isinstance(data, dict):
        raise PlanFileError(f"{where or 'plan'} must be a JSON object, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (known fields: {', '.join(sorted(known))})"
        raise PlanFileError(f"unknown field {_join(where, unknown[0])!r}{hint}")
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        name = _join(where, f.name)
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints[f.name], name)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise PlanFileError(f"missing field {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise PlanFileError(f"{where or 'plan'}: {err}") from None


def _convert(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against type ``hint`` (JSON lists become tuples, ints become floats where needed)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if hint in _SCALARS:
        what, types = _SCALARS[hint]
        valid = isinstance(value, types) and (hint is bool or not isinstance(value, bool))
        if not valid:
            raise PlanFileError(f"{where} must be {what}, got {_describe(value)}")
        return float(value) if hint is float else value
    if origin is tuple:
        if not isinstance(value, list):
            raise PlanFileError(f"{where} must be a list, got {_describe(value)}")
        return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise PlanFileError(f"{where} must be a JSON object, got {_describe(value)}")
        return value
    return _build(hint, value, where)


#: JSON scalar types by field type: what the message calls them, and the Python types JSON decodes them to.
_SCALARS: dict[Any, tuple[str, tuple[type, ...]]] = {
    bool: ("true or false", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
}


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _describe(value: Any) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    text = json.dumps(value)
    return f"{kind.get(type(value), 'a number')} {text if len(text) <= 40 else text[:37] + '...'}"
