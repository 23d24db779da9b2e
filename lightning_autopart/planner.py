"""Planning a model end to end: capture, then profile, then partition, as the CLI and the strategy call it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_autopart.cluster import Cluster
from lightning_autopart.devices import DeviceSpec, device_spec_names
from lightning_autopart.errors import CaptureError, ConfigError, ProfileError
from lightning_autopart.plan import SCHEDULES, Plan
from lightning_autopart.profile.loader import LoaderCost, with_loader
from lightning_autopart.profile.readback import LoopFacts, with_readback
from lightning_autopart.profile.records import ModelProfile

if TYPE_CHECKING:
    from lightning_autopart.capture.graph import CapturedModel
    from lightning_autopart.profile.loss import LossFn

__all__ = ["check_settings", "example_inputs_of", "meta_inputs", "plan_model", "profile_model"]

#: ``progress(done, total, block_name)`` after each profiled block.
Progress = Callable[[int, int, str], None]


def example_inputs_of(model: nn.Module) -> Any:
    """The model's example inputs: ``model.example_input_array`` (the LightningModule convention).

    Raises:
        ConfigError: The model has no ``example_input_array``.
    """
    inputs = getattr(model, "example_input_array", None)
    if inputs is None:
        raise ConfigError(
            f"{type(model).__name__} has no example_input_array; set self.example_input_array to an example "
            "batch in its __init__ (a tensor, a tuple of positional inputs or a dict of keyword inputs), "
            "or pass --input-shape (e.g. --input-shape 64,512)"
        )
    return inputs


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    profile: str = "estimate",
    spec: str | DeviceSpec | None = None,
    optimizer: str = "sgd",
    max_blocks: int = 64,
    progress: Progress | None = None,
    up_to: int | None = None,
    loss: LossFn | None = None,
    loss_samples: int | None = None,
    dtype: str | None = None,
) -> ModelProfile:
    """Capture ``model`` on ``example_inputs`` and profile its blocks (``profile`` is "estimate" or "measure").

    With ``up_to`` (the largest micro-batch a plan may use), every block gets a cost curve (see [Note: cost
    curves]): "measure" captures and times the model at the sizes of
    :func:`~lightning_autopart.profile.curves.curve_sizes` (the example's samples sliced or repeated);
    "estimate" captures it at two sizes and prices every kernel at each size of
    :func:`~lightning_autopart.profile.curves.estimate_sizes`. ``loss(output, samples)``, when given, is the
    training loss computed from the model's output; it is profiled at each size up to ``loss_samples`` (default
    ``up_to``: the samples the loss has labels for) and added to the last block (see [Note: the loss]); a loss
    that fails there is left unpriced and ``meta["loss_error"]`` says why. ``dtype`` is the training precision
    ("32-true", "bf16-mixed", "16-mixed", "bf16-true", ...; default: the parameters' dtype).
    """
    from lightning_autopart.capture import capture as capture_model
    from lightning_autopart.capture.batch_stats import batch_statistics, mixed_samples
    from lightning_autopart.profile import profile as profile_blocks
    from lightning_autopart.profile.curves import (
        add_loss,
        curve_sizes,
        estimate_sizes,
        join_curves,
        resize_batch,
    )
    from lightning_autopart.profile.loss import batch_bytes, loss_context, profile_loss
    from lightning_autopart.profile.step_checks import loss_findings

    if profile not in ("estimate", "measure"):
        raise ConfigError(f"unknown profile mode {profile!r}; use 'estimate' or 'measure'")
    model, example_inputs, default_dtype = _as_trained(model, example_inputs, dtype)

    def capture(inputs: Any, max_blocks: int) -> CapturedModel:
        with _default_dtype(default_dtype):
            return capture_model(model, inputs, max_blocks=max_blocks)

    captured = capture(example_inputs, max_blocks=max_blocks)
    reads = _loss_reads(captured, loss) if loss is not None else None
    _mark_dead_outputs(captured, reads)
    b0 = captured.batch_size
    notes: dict[str, Any] = {"capture_notes": list(captured.notes)} if captured.notes else {}
    if stats := batch_statistics(captured):  # [Note: batch statistics]: the plan says so
        notes["batch_statistics"] = list(stats)
    settings: dict[str, Any] = {"mode": profile, "spec": spec, "optimizer": optimizer, "dtype": dtype}
    outputs: dict[int, Any] = {}
    if profile == "estimate" and up_to is not None:
        twin = capture(resize_batch(example_inputs, b0, 2 * b0), max_blocks=max_blocks)
        _mark_dead_outputs(twin, reads)
        if twin.batch_size != 2 * b0 or twin.num_blocks != captured.num_blocks:
            raise ProfileError(
                f"the model captured at batch {2 * b0} has {twin.num_blocks} blocks (batch {twin.batch_size}), at "
                f"batch {b0} {captured.num_blocks}: its structure depends on the batch size; use profile='measure'"
            )
        if mixed := mixed_samples(captured, twin):  # [Note: values that mix samples]
            notes["batch_mixing"] = list(mixed)
        sizes = estimate_sizes(up_to)
        result = profile_blocks(captured, **settings, progress=progress, twin=twin, sizes=sizes)
        dtypes = result.meta.get("output_dtypes")
        outputs = {n: _example_output(captured, "meta", _shapes_at(captured, twin, n), dtypes) for n in sizes}
    else:
        sizes = curve_sizes(up_to) if profile == "measure" and up_to is not None else [b0]
        profiles: dict[int, ModelProfile] = {}
        for size in sizes:
            last = size == sizes[-1]
            try:
                at = captured if size == b0 else capture(resize_batch(example_inputs, b0, size), max_blocks)
                if at is not captured and "batch_mixing" not in notes and (mixed := mixed_samples(captured, at)):
                    notes["batch_mixing"] = list(mixed)  # [Note: values that mix samples]
                _mark_dead_outputs(at, reads)
                profiles[size] = profile_blocks(at, **settings, progress=progress if last else None)
            except (CaptureError, ProfileError) as error:
                if last or size >= b0 or profiles:  # only the smallest sizes may fail (BatchNorm of 1 value)
                    raise
                notes.setdefault("curve_skipped", []).append(f"{size}: {type(error).__name__}: {error}"[:300])
                continue
            device = "meta" if profile == "estimate" else profiles[size].device
            outputs[size] = _example_output(at, device, dtypes=profiles[size].meta.get("output_dtypes"))
        result = join_curves(profiles) if len(profiles) > 1 else next(iter(profiles.values()))
    if loss is not None:
        per_sample = batch_bytes(loss, default_dtype)
        if per_sample is not None:
            notes["batch_bytes"] = per_sample
        roofline = _roofline_of(result) if profile == "estimate" else None
        limit = loss_samples if loss_samples is not None else (up_to or b0)
        context = loss_context(result, estimate=profile == "estimate")
        try:
            losses = {
                n: profile_loss(loss, out, n, roofline=roofline, context=context)
                for n, out in outputs.items()
                if n <= limit
            }
            result = add_loss(result, losses)
        except Exception as error:  # user code: the loss stays unpriced, and the profile says why
            notes["loss_error"] = f"{type(error).__name__}: {error}"
        for key, finding in loss_findings(loss, outputs, limit).items():  # what micro-batches would change
            notes.setdefault(key, finding)
    return dataclasses.replace(result, meta={**result.meta, **notes}) if notes else result


def _as_trained(model: nn.Module, example_inputs: Any, dtype: str | None) -> tuple[nn.Module, Any, torch.dtype | None]:
    """The model, its inputs and the default dtype as Lightning trains them at a "-true" precision.

    Lightning's true-precision plugins convert the module and the floating inputs to the precision's dtype and
    run the forward with it as the default dtype. A model built in float32 and planned for "bf16-true" must be
    captured so too: a graph traced in float32 keeps a Llama's RMSNorm and rotary tables in float32 (their casts
    to the input's dtype vanish from it), and every activation after them. So a model whose floating parameters
    are not in that dtype is captured as a converted copy (free on meta; on real weights a copy). One already
    converted (the strategy's) is captured as it is."""
    from lightning_autopart.profile.precision import parse_precision

    precision = parse_precision(dtype, model) if dtype is not None else None
    target = precision.param if precision is not None and not precision.mixed else None
    if target is None:
        return model, example_inputs, None
    if any(p.dtype != target for p in model.parameters() if p.is_floating_point()):  # not converted yet
        model = copy.deepcopy(model).to(target)

    def cast(t: Any) -> Any:
        return t.to(target) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return model, tree_map(cast, example_inputs), target


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """``torch.set_default_dtype(dtype)`` inside (nothing for None), restored after."""
    before = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _loss_reads(captured: CapturedModel, loss: LossFn) -> tuple[bool, ...] | None:
    """Which of the model's outputs (``cuts[-1]``) the training loss reads, found by differentiating it on meta
    stand-ins; None when the loss cannot run there (then every output counts as read)."""
    leaves: list[torch.Tensor] = []
    for info in captured.cuts[-1]:
        dtype = getattr(torch, info.dtype)
        grad = dtype.is_floating_point
        leaves.append(torch.empty(info.shape, dtype=dtype, device="meta", requires_grad=grad))
    floating = [t for t in leaves if t.requires_grad]
    try:
        value = loss(captured.output.rebuild(leaves), captured.batch_size)
        if not (isinstance(value, torch.Tensor) and value.requires_grad) or not floating:
            return None
        grads = iter(torch.autograd.grad(value, floating, allow_unused=True))
    except Exception:  # user code that needs values: profile_loss reports it where it matters
        return None
    return tuple(next(grads) is not None if t.requires_grad else True for t in leaves)


def _mark_dead_outputs(captured: CapturedModel, reads: tuple[bool, ...] | None) -> None:
    """Set each block's ``dead_outputs`` and ``dead_inputs`` (see ``Block``): the model outputs that ``reads`` says the
    loss does not read, and the values that only blocks with no live output use (a pooling head the loss
    skips, split over several blocks; a value the forward computes and never uses, whose last block has no
    output at all: CANINE's upsampling beside its classification), unless a block with a live output uses them
    too."""
    outputs = captured.cuts[-1]
    if reads is None or len(reads) != len(outputs):
        return
    read = {info.name for info, r in zip(outputs, reads, strict=True) if r}
    needed: set[str] = set()  # what the live blocks after this one read
    for block in reversed(captured.blocks):
        live = {o.name for o in block.outputs if o.name in read or o.name in needed}
        block.dead_outputs = frozenset(o.name for o in block.outputs if o.name not in live)
        if live:
            needed.update(t.name for t in block.inputs)
    dead = {name for block in captured.blocks for name in block.dead_outputs}
    for block in captured.blocks:
        block.dead_inputs = frozenset(t.name for t in block.inputs if t.name in dead)


def _shapes_at(a: CapturedModel, b: CapturedModel, n: int) -> list[tuple[int, ...]]:
    """The shapes of the model's outputs at ``n`` samples, each dimension on the line through two captures."""
    sa, sb = a.batch_size, b.batch_size
    return [
        tuple(x + (y - x) * (n - sa) // (sb - sa) for x, y in zip(p.shape, q.shape, strict=True))
        for p, q in zip(a.cuts[-1], b.cuts[-1], strict=True)
    ]


def _example_output(
    captured: CapturedModel,
    device: str,
    shapes: list[tuple[int, ...]] | None = None,
    dtypes: list[str] | None = None,
) -> Any:
    """A stand-in for the model's output (at the capture's batch size, or of ``shapes``; in the capture's dtypes,
    or in ``dtypes``: autocast's) on ``device`` (random floats; values do not change what a loss costs), in the
    structure the forward returns."""
    tensors = []
    for k, info in enumerate(captured.cuts[-1]):
        dtype = getattr(torch, dtypes[k] if dtypes is not None else info.dtype)
        shape = shapes[k] if shapes is not None else info.shape
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, dtype=dtype, device=device))
        else:
            tensors.append(torch.zeros(shape, dtype=dtype, device=device))
    return captured.output.rebuild(tensors)


def _roofline_of(prof: ModelProfile) -> Any:
    """The roofline an estimate profile priced its blocks with (the spec it names, its compute dtype)."""
    from lightning_autopart.profile import resolve_spec
    from lightning_autopart.profile.opcount import Roofline

    return Roofline.of(resolve_spec(prof.meta["spec"]), prof.meta["compute_dtype"], waves=True)


def plan_model(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    batch_size: int,
    *,
    profile: str = "estimate",
    spec: str | DeviceSpec | None = None,
    optimizer: str = "sgd",
    num_stages: int | None = None,
    replicas: int | None = None,
    micro_batches: int | None = None,
    schedules: Sequence[str] | None = None,
    max_blocks: int = 64,
    progress: Progress | None = None,
    dtype: str | None = None,
    loss: LossFn | None = None,
    loss_samples: int | None = None,
    loader: LoaderCost | None = None,
    loop: LoopFacts | None = None,
) -> Plan:
    """Plan ``model`` for ``cluster`` at global ``batch_size``: capture -> profile -> partition.

    Args:
        model: The model (an ``nn.Module`` or ``LightningModule``); on the meta device for ``profile="estimate"``.
        example_inputs: An example batch, as for :func:`lightning_autopart.capture.capture`; see
            :func:`example_inputs_of`.
        cluster: The devices to plan for.
        batch_size: Global samples per optimizer step.

    Keyword Args:
        profile: "estimate" (roofline of ``spec``, no compute) or "measure" (timed on the local device).
        spec: Device spec of the estimate ("a100-40gb", ...); None means the cluster's own device
            (``cluster.device``) when it names a known spec. In "measure", only kernel launch costs.
        optimizer: Optimizer whose state the memory figures count ("sgd", "sgd_momentum", "adam", "adamw").
        num_stages: Pipeline stages (None: searched).
        replicas: Data-parallel replicas of every stage (None: searched; ``world // num_stages`` with stages).
        micro_batches: Micro-batches per replica per step (None: searched; 1 where the forward mixes samples).
        schedules: Schedules to consider, from :data:`~lightning_autopart.plan.SCHEDULES` (None: all).
        max_blocks: Finest block count capture may split the model into.
        progress: Called as ``progress(done, total, block_name)`` while profiling.
        dtype: Training precision ("32-true", "bf16-mixed", "16-mixed", "bf16-true"; default: the parameters').
        loss: The training loss as a function of the model's output (see :func:`profile_model`).
        loss_samples: The most samples ``loss`` has labels for.
        loader: The training loader's time per batch (:func:`~lightning_autopart.profile.loader.time_loader`),
            priced in the step ([Note: loader in the step]); None prices no data loading.
        loop: What the training loop around the step reads back from the device, and how often
            ([Note: reads back]); with what ``loss`` records of the step's own reads (its ``reads``), it decides
            whether the loader's fetch overlaps the device's work. None: a default Trainer's loop.

    Blocks get cost curves up to the largest micro-batch a plan may use: the global batch in "estimate" (meta
    runs cost nothing); in "measure", the per-device share of it (what each rank would load, as the strategy
    profiles), beyond which the curves extend along their last two points.

    Raises:
        ConfigError: A setting is invalid (the message names it and the fix).
        CaptureError: The model cannot be captured.
        PlanError: No plan fits; the error carries the closest plan.
    """
    from lightning_autopart.partition import partition

    check_settings(
        cluster, batch_size, num_stages=num_stages, micro_batches=micro_batches, schedules=schedules
    )
    if spec is None and profile == "estimate" and cluster.device in device_spec_names():
        spec = cluster.device
    prof = profile_model(
        model,
        example_inputs,
        profile=profile,
        spec=spec,
        optimizer=optimizer,
        max_blocks=max_blocks,
        progress=progress,
        up_to=batch_size if profile == "estimate" else max(1, batch_size // cluster.world_size),
        loss=loss,
        loss_samples=loss_samples,
        dtype=dtype,
    )
    plan = partition(
        with_loader(prof, with_readback(loader, loss, loop)),  # the loss has run: the step's reads are known
        cluster,
        batch_size,
        num_stages=num_stages,
        replicas=replicas,
        micro_batches=micro_batches,
        schedules=list(schedules) if schedules is not None else None,
    )
    # Recorded so that a later check can capture the model into the same blocks (see check_compatible).
    return dataclasses.replace(plan, notes={**plan.notes, "max_blocks": max_blocks})



def check_settings(
    cluster: Cluster,
    batch_size: int,
    *,
    num_stages: int | None = None,
    replicas: int | None = None,
    micro_batches: int | None = None,
    schedules: Sequence[str] | None = None,
) -> None:
    """Refuse settings no plan can satisfy before capture and profiling start (the partitioner checks the rest)."""
    world = cluster.world_size
    if batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {batch_size}; pass --batch-size N")
    if micro_batches is not None and micro_batches < 1:
        raise ConfigError(f"micro-batches must be at least 1, got {micro_batches}")
    for name in schedules or ():
        if name not in SCHEDULES:
            raise ConfigError(f"unknown schedule {name!r}; use one of: {', '.join(SCHEDULES)}")
    if num_stages is not None and not 1 <= num_stages <= world:
        raise ConfigError(f"--num-stages must be between 1 and the {world} devices, got {num_stages}")
    if replicas is None and num_stages is not None:
        replicas = world // num_stages
    if replicas is not None and batch_size < replicas:
        how = f" ({world} devices / {num_stages} stages)" if num_stages is not None else ""
        raise ConfigError(
            f"batch size {batch_size} is smaller than the {replicas} data-parallel replicas{how}: every replica "
            f"needs at least one sample; raise --batch-size to at least {replicas} or use more stages"
        )


def meta_inputs(inputs: Any) -> Any:
    """``inputs`` (a tensor, tuple, list or dict of them) with every tensor moved to the meta device."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to("meta")
    if isinstance(inputs, tuple | list):
        return type(inputs)(meta_inputs(x) for x in inputs)
    if isinstance(inputs, dict):
        return {k: meta_inputs(v) for k, v in inputs.items()}
    return inputs
