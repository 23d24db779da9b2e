"""The strategy's planning step: one rank plans (or loads) the plan for the first batch, every rank receives it."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import AutopartError, ConfigError, PlanError
from lightning_autopart.lightning.hooks import ForwardCall
from lightning_autopart.lightning.input_checks import check_stages, empty_loader_message
from lightning_autopart.lightning.load import PlanningProbe, planning_load
from lightning_autopart.lightning.reuse import (
    LoadedPlan,
    capture_at_micro_batch,
    load_for_job,
    loaded_message,
)
from lightning_autopart.plan import Plan, with_planning_time
from lightning_autopart.profile.loader import read_aside, single_stream
from lightning_autopart.profile.loss import LossFn
from lightning_autopart.profile.optimizer_probe import describe_optimizer
from lightning_autopart.profile.optimizers import optimizer_state_factor, optimizer_transient_factor
from lightning_autopart.profile.readback import LoopFacts, with_readback
from lightning_autopart.runtime.checkpoint import free_elsewhere
from lightning_autopart.runtime.runner import move_in_place
from lightning_autopart.runtime.stages import tied_groups
from lightning_autopart.runtime.topology import place

__all__ = [
    "PlanSettings",
    "capture_for_plan",
    "choose_micro_batches",
    "first_batch",
    "keep_local",
    "lightning_syncs_each_step",
    "loop_facts",
    "optimizer_spec",
    "plan_for_batch",
]

#: Spec of the roofline estimate when the device has none of its own.
_ESTIMATE_SPEC = "a100-40gb"


@dataclass(frozen=True)
class PlanSettings:
    """What the strategy's user asked for (see ``AutoPartitionStrategy``'s arguments)."""

    num_stages: int | None = None
    micro_batches: int | None = None
    schedule: str = "auto"
    device_memory: int | str | None = None
    profile: str = "measure"
    load_plan: str | None = None
    save_plan: str | None = None
    max_blocks: int = 64
    #: Optimizer whose state the memory model counts (see :func:`optimizer_spec`).
    optimizer: str = "sgd"
    #: Training precision the cost model prices (Lightning's names: "32-true", "bf16-mixed", ...).
    precision: str | None = None
    #: Trainer(accumulate_grad_batches): above 1, gradients live through every step (priced as such).
    accumulate: int = 1
    #: The training loader, whose batches rank 0 times when it plans ([Note: loader time]); None: not priced.
    loader: Any = None
    #: What the fit loop reads back, how often ([Note: reads back]); None: every step.
    loop: LoopFacts | None = None


def optimizer_spec(optimizers: Iterable[Any], gpu: bool) -> str:
    """The spec the memory model prices the user's optimizers by, each measured as it steps on a GPU (``gpu``) or
    the CPU ([Note: measured optimizers]): with several, the one with the most state and temporaries."""
    specs = [str(describe_optimizer(optimizer, gpu)) for optimizer in optimizers]
    return max(specs, key=lambda s: optimizer_state_factor(s) + optimizer_transient_factor(s), default="sgd")


def loop_loader(trainer: Any, hook: str) -> Any:
    """The loader of the loop running ``hook`` (its first, when it has several); None when it has none."""
    loop = {
        "training_step": "fit_loop",
        "validation_step": "validate_loop",
        "test_step": "test_loop",
        "predict_step": "predict_loop",
    }[hook]
    loaders = getattr(trainer, loop)._data_source.dataloader()
    if isinstance(loaders, Mapping):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def loop_facts(trainer: Any, sigterm_broadcast: bool = True) -> LoopFacts:
    """What ``trainer``'s fit loop reads back from the device, how often ([Note: reads back]): its progress bar's
    refresh rate, its loggers' ``log_every_n_steps``, whether a gradient scaler checks every step and whether
    the loop itself exchanges a value between its processes every step (Lightning's SIGTERM flag, unless
    ``sigterm_broadcast`` says autopart's pre-emption leaves that out)."""
    bar = trainer.progress_bar_callback
    shown = bar is not None and bool(getattr(bar, "is_enabled", True))
    logged = bool(trainer.loggers)
    return LoopFacts(
        progress_every=max(0, int(getattr(bar, "refresh_rate", 1))) if shown else 0,
        log_every=max(0, int(trainer.log_every_n_steps)) if logged else 0,
        scaler=getattr(trainer.precision_plugin, "scaler", None) is not None,
        synced=sigterm_broadcast and lightning_syncs_each_step(int(trainer.world_size)),
    )


def lightning_syncs_each_step(world_size: int) -> bool:
    """Whether the installed Lightning's training loop reads a value broadcast between the ranks before every
    batch of a job of ``world_size`` processes (its SIGTERM flag, ``_broadcast_sigterm_tensor``; [Note: reads
    back])."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    return world_size > 1 and hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")


def first_batch(loaders: Any, hook: str) -> Any:
    """The first batch of ``loaders``, the loader of the loop running ``hook`` (:func:`loop_loader`)."""
    name, call = _LOOPS[hook]
    if loaders is None:
        raise ConfigError(
            f"autopart plans from the first batch of the {name} loop, but it has no dataloader; pass one to "
            f"trainer.{call}(...) or define {name}_dataloader()"
        )
    dataset = getattr(loaders, "dataset", None)
    stream = None if getattr(loaders, "num_workers", 0) else single_stream(dataset)  # workers read fresh copies
    if stream is not None:
        raise ConfigError(
            f"the {name} dataloader's dataset ({type(dataset).__name__}) is a single stream: its __iter__ returns "
            f"{stream} each time, so the first batch that autopart reads to plan would be missing from the {name} "
            "loop (and a later epoch would find the stream spent); make __iter__ start over at each call, e.g. a "
            "generator function (def __iter__(self): yield from ...)"
        )
    try:
        with read_aside(loaders):  # the dataset's own generators and position stay as training finds them
            return next(iter(loaders))
    except StopIteration:
        raise ConfigError(empty_loader_message(name, loaders)) from None


#: Each step hook's loop as users name it: its loader's name ("train": ``train_dataloader``) and Trainer method.
_LOOPS = {
    "training_step": ("train", "fit"),
    "validation_step": ("val", "validate"),
    "test_step": ("test", "test"),
    "predict_step": ("predict", "predict"),
}


def choose_micro_batches(requested: int | None, local_batch: int) -> int | None:
    """``requested``, or the largest divisor of ``local_batch`` below it (with a warning); None stays None."""
    if requested is None or local_batch % requested == 0:
        return requested
    chosen = max(d for d in range(1, min(requested, local_batch) + 1) if local_batch % d == 0)
    warnings.warn(
        f"micro_batches={requested} does not divide the batch of {local_batch} samples per replica; "
        f"using {chosen} equal micro-batches instead",
        stacklevel=2,
    )
    return chosen


def plan_for_batch(
    settings: PlanSettings,
    root: nn.Module,
    call: ForwardCall,
    local_batch: int,
    *,
    rank: int,
    world_size: int,
    num_nodes: int,
    device: torch.device,
    loss: LossFn | None = None,
) -> tuple[Plan, CapturedModel | None]:
    """The plan for ``root`` fed batches of ``local_batch`` samples per replica, made on rank 0, sent to all.

    ``loss(output, samples)`` is the training loss computed from the model's output, profiled on the last block
    (see [Note: the loss]). With ``load_plan``, rank 0 neither profiles nor plans: it reads the file and checks
    it against this job and the model captured at the plan's micro-batch size, the capture the runtime needs
    anyway; that capture is returned on rank 0 for :func:`capture_for_plan` (None on other ranks, and when
    planning). A failure on rank 0 (no plan fits, a mismatched ``load_plan``) is raised on every rank.
    """
    result: list[Any] = [None]
    loaded: LoadedPlan | None = None
    measured = settings.profile == "measure" and not settings.load_plan
    with planning_load(rank, world_size, world_size // max(1, num_nodes), device, measured) as probe:
        if rank == 0:
            try:
                made = _make_plan(
                    settings, root, call, local_batch, world_size, num_nodes, device, loss, probe
                )
                loaded = made if isinstance(made, LoadedPlan) else None
                result[0] = made.plan if isinstance(made, LoadedPlan) else made
            except Exception as error:  # sent to every rank, then raised everywhere
                result[0] = error
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], BaseException):
        raise result[0]
    plan: Plan = result[0]
    if rank == 0:
        from lightning_autopart.plan.report import print_plan

        print_plan(plan)
        for key in ("batch_statistics", "batch_mixing", "loss_growth", "loss_transformed", "log_transformed"):
            if isinstance(note := plan.notes.get(key), str):
                warnings.warn(f"autopart: {note}", stacklevel=2)
        if loaded is not None:
            print(loaded_message(loaded), flush=True)
        if settings.save_plan:
            plan.save(settings.save_plan)
    return plan, loaded.captured if loaded is not None else None


def capture_for_plan(
    plan: Plan,
    root: nn.Module,
    call: ForwardCall,
    local_batch: int,
    rank: int,
    captured: CapturedModel | None = None,
) -> tuple[CapturedModel, list[tuple[str, tuple[int, ...]]], set[int], set[int]]:
    """The model captured at the plan's micro-batch size (the runtime builds this rank's stages from it: export
    bakes the batch size into reshapes); ``captured`` when given (rank 0's check of a loaded plan made it).

    Returns the capture, the tied parameters (FQN, stages), the ids of the tied parameters whose gradient another
    rank counts in the global norm (a tie counts on its first stage), and the ids of every parameter and buffer
    some block of the model uses.
    """
    if captured is None:
        captured = capture_at_micro_batch(plan, root, call, local_batch)
    if captured.num_blocks != plan.stages[-1].block_end:
        raise ConfigError(
            f"the plan splits {plan.stages[-1].block_end} blocks, but the model captured at micro-batch size "
            f"{plan.micro_batch_size} has {captured.num_blocks}; the plan is for another model: re-plan"
        )
    tied = tied_groups(plan, captured)
    mine = place(plan, rank).stages
    elsewhere = {id(captured.module.get_parameter(fqn)) for fqn, stages in tied if min(stages) not in mine}
    in_blocks = {id(root.get_parameter(fqn)) for block in captured.blocks for fqn in block.params}
    in_blocks |= {id(root.get_buffer(fqn)) for block in captured.blocks for fqn in block.buffers}
    return captured, tied, elsewhere, in_blocks


def keep_local(
    module: nn.Module,
    root_name: str,
    stages: dict[int, nn.Module],
    in_blocks: set[int],
    optimizers: Iterable[Any],
    device: torch.device,
) -> list[nn.Parameter]:
    """Keep only this rank's ``stages``: optimizers over their parameters, the others' tensors freed (left on
    the ``meta`` device, shapes kept), the rest moved to ``device``; returns the local parameters.

    ``in_blocks`` holds the ids of every parameter and buffer the pipelined module (``root_name``) uses; an
    optimized parameter outside it would never get a gradient, so it is refused. Checkpoints hold every rank's
    tensors by name (see :mod:`lightning_autopart.lightning.checkpoints`).
    """
    optimizers = list(optimizers)
    optimized = {id(q) for o in optimizers for g in o.param_groups for q in g["params"]}
    # Meta parameters are other ranks' stages (an earlier split replaced them by new objects): not outside.
    outside = [
        n for n, p in module.named_parameters() if id(p) not in in_blocks and id(p) in optimized and not p.is_meta
    ]
    if outside:
        raise ConfigError(
            f"parameters {', '.join(outside[:5])} are optimized but not used by the pipelined model "
            f"({root_name or type(module).__name__}.forward); autopart trains only what the forward uses: "
            "move them into the model's forward, or leave them out of configure_optimizers"
        )
    params = list(dict.fromkeys(p for m in stages.values() for p in m.parameters()))
    local = {id(p) for p in params}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]
    held = local | {id(b) for m in stages.values() for b in m.buffers()}
    free_elsewhere(module, in_blocks - held)
    move_in_place(module, device)
    return params


def _make_plan(
    settings: PlanSettings,
    root: nn.Module,
    call: ForwardCall,
    local_batch: int,
    world_size: int,
    num_nodes: int,
    device: torch.device,
    loss: LossFn | None = None,
    probe: PlanningProbe | None = None,
) -> Plan | LoadedPlan:
    """Capture, profile and partition ``root`` (the plan records how long that took), or load ``load_plan``;
    ``probe`` measures the host time of a CPU pipeline's actions (see [Note: pipeline probe])."""
    from lightning_autopart.partition import partition
    from lightning_autopart.planner import profile_model
    from lightning_autopart.profile import calibrate_cpu
    from lightning_autopart.profile.loader import time_loader, with_loader

    if world_size % num_nodes:
        raise ConfigError(
            f"world size {world_size} is not a multiple of the {num_nodes} nodes; start the same number of "
            "processes (devices) on every node"
        )
    if settings.load_plan:
        return load_for_job(settings.load_plan, root, call, local_batch, world_size)
    start = time.perf_counter()
    check_stages(settings.num_stages, world_size)
    spec = _spec(device, settings.profile)
    # "cpu": the probed spec, whose host overheads are this machine's ([Note: host overhead] in cost.py).
    cluster = Cluster.from_spec(
        calibrate_cpu() if spec == "cpu" else spec,
        devices=world_size // num_nodes,
        nodes=num_nodes,
        device_memory=settings.device_memory,
    )
    prof = profile_model(
        root,
        (call.args, call.kwargs),
        profile=settings.profile,
        spec=spec,
        optimizer=settings.optimizer,
        max_blocks=settings.max_blocks,
        up_to=local_batch,
        loss=loss,
        dtype=_profile_dtype(settings.precision),
    )
    if settings.loader is not None and loss is not None:  # fitting: the step fetches a batch each time
        # the loss has run by now: what the step reads back is known
        prof = with_loader(prof, with_readback(time_loader(settings.loader, local_batch), loss, settings.loop))
    if settings.num_stages is not None and settings.num_stages > prof.num_blocks:
        why = "".join(f"; {note}" for note in prof.meta.get("capture_notes", ()))
        raise ConfigError(
            f"num_stages={settings.num_stages} is more than the {prof.num_blocks} blocks the model splits into; "
            f"use at most {prof.num_blocks} stages{why}"
        )
    candidates = (
        [settings.num_stages]
        if settings.num_stages is not None
        else [s for s in range(1, world_size + 1) if world_size % s == 0 and s <= prof.num_blocks]
    )
    micro = choose_micro_batches(settings.micro_batches, local_batch)
    if probe is not None and spec == "cpu" and settings.num_stages != 1:  # one stage runs no schedule actions
        cluster = probe.tune(cluster, prof, local_batch, micro)
    schedules = None if settings.schedule == "auto" else [settings.schedule]
    best: Plan | None = None
    failure: AutopartError | None = None
    for stages in candidates:
        try:
            plan = partition(
                prof,
                cluster,
                local_batch * (world_size // stages),
                num_stages=stages,
                micro_batches=micro,
                schedules=schedules,
                persistent_grads=settings.accumulate > 1,
            )
        except (PlanError, ConfigError) as error:
            failure = error
            continue
        if best is None or plan.prediction.samples_per_s > best.prediction.samples_per_s:
            best = plan
    if best is None:
        assert failure is not None
        raise failure
    if best.world_size != world_size:  # every candidate divides the world: the planner fills every rank
        raise ConfigError(
            f"the planner's plan runs on {best.world_size} of the {world_size} ranks; every rank must hold a "
            f"stage: pass a num_stages that divides {world_size}"
        )
    probed = {"pipeline_probe": probe.measured} if probe is not None and probe.measured else {}
    best = dataclasses.replace(best, notes={**best.notes, "max_blocks": settings.max_blocks, **probed})
    return with_planning_time(best, time.perf_counter() - start)


def _profile_dtype(precision: str | None) -> str | None:
    """The profile dtype of a Lightning precision; None (the parameters' own dtype) for "32-true" and for
    precisions the cost model does not know (they are priced as the parameters' dtype)."""
    from lightning_autopart.profile.precision import known_precisions

    return precision if precision in known_precisions() and precision not in ("32", "32-true") else None


def _spec(device: torch.device, profile: str) -> str:
    if device.type == "cuda":
        from lightning_autopart.profile import resolve_spec

        return resolve_spec(None, device).name
    return "cpu" if profile == "measure" else _ESTIMATE_SPEC
