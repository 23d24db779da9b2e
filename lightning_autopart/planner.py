"""Planning a model end to end: capture, then profile, then partition, as the CLI and the strategy call it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_autopart.cluster import Cluster
from lightning_autopart.devices import DeviceSpec, device_spec_names
from lightning_autopart.errors import ConfigError
from lightning_autopart.plan import SCHEDULES, Plan
from lightning_autopart.records import ModelProfile

if TYPE_CHECKING:
    from lightning_autopart.graph import CapturedModel
    from lightning_autopart.profile.loss import LossCost, LossFn

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
) -> ModelProfile:
    """Capture ``model`` on ``example_inputs`` and profile its blocks (``profile`` is "estimate" or "measure").

    With ``up_to`` (the largest micro-batch a plan may use), "measure" captures and times the model at the sizes
    of :func:`~lightning_autopart.profile.curves.curve_sizes` (the example's samples sliced or repeated) and
    gives every block a cost curve (see [Note: cost curves]). ``loss(output, samples)``, when given, is the
    training loss computed from the model's output; it is profiled at each size and added to the last block
    (see [Note: the loss]); a loss that fails there is left unpriced and ``meta["loss_error"]`` says why.
    """
    from lightning_autopart.capture import capture
    from lightning_autopart.profile import profile as profile_blocks
    from lightning_autopart.profile.curves import curve_sizes, join_curves, resize_batch
    from lightning_autopart.profile.loss import profile_loss

    if profile not in ("estimate", "measure"):
        raise ConfigError(f"unknown profile mode {profile!r}; use 'estimate' or 'measure'")
    captured = capture(model, example_inputs, max_blocks=max_blocks)
    b0 = captured.batch_size
    sizes = curve_sizes(up_to) if profile == "measure" and up_to is not None else [b0]
    profiles: dict[int, ModelProfile] = {}
    losses: dict[int, LossCost] = {}
    loss_error = None
    for size in sizes:
        inputs = example_inputs if size == b0 else resize_batch(example_inputs, b0, size)
        at = captured if size == b0 else capture(model, inputs, max_blocks=max_blocks)
        profiles[size] = profile_blocks(
            at, mode=profile, spec=spec, optimizer=optimizer, progress=progress if size == sizes[-1] else None
        )
        if loss is not None and loss_error is None:
            try:
                estimate = profile == "estimate"
                output = _example_output(at, "meta" if estimate else profiles[size].device)
                roofline = _roofline_of(profiles[size]) if estimate else None
                losses[size] = profile_loss(loss, output, size, roofline=roofline)
            except Exception as error:  # user code: the loss stays unpriced, and the profile says why
                loss_error = f"{type(error).__name__}: {error}"
                losses = {}
    result = join_curves(profiles, losses or None) if len(sizes) > 1 or losses else profiles[b0]
    notes: dict[str, Any] = {"capture_notes": list(captured.notes)} if captured.notes else {}
    if loss_error is not None:
        notes["loss_error"] = loss_error
    return dataclasses.replace(result, meta={**result.meta, **notes}) if notes else result


def _example_output(captured: CapturedModel, device: str) -> Any:
    """A stand-in for the model's output at the capture's batch size, on ``device`` (random floats; values do not
    change what a loss costs), in the structure the forward returns."""
    tensors = []
    for info in captured.cuts[-1]:
        dtype = getattr(torch, info.dtype)
        if dtype.is_floating_point:
            tensors.append(torch.randn(info.shape, dtype=dtype, device=device))
        else:
            tensors.append(torch.zeros(info.shape, dtype=dtype, device=device))
    return captured.output.rebuild(tensors)


def _roofline_of(prof: ModelProfile) -> Any:
    """The roofline an estimate profile priced its blocks with (its spec's figures are in its meta)."""
    from lightning_autopart.profile.opcount import Roofline

    meta = prof.meta
    return Roofline(
        flops_per_us=meta["peak_flops"] * meta["flops_efficiency"] / 1e6,
        bytes_per_us=meta["memory_bw"] * meta["bw_efficiency"] / 1e6,
        launch_us=meta["launch_us"],
    )


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
        micro_batches: Micro-batches per replica per step (None: searched).
        schedules: Schedules to consider, from :data:`~lightning_autopart.plan.SCHEDULES` (None: all).
        max_blocks: Finest block count capture may split the model into.
        progress: Called as ``progress(done, total, block_name)`` while profiling.

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
    )
    plan = partition(
        prof,
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
