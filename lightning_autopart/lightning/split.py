"""This rank's split of a LightningModule: plan from one batch, capture at the micro-batch size, build the runner.

The split stays on the module (:data:`PARTITION_ATTRIBUTE`), so every later loop on it runs on the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.capture.keys import layout_digest, registration_digest
from lightning_autopart.capture.modes import modules_of
from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.first_batch import PlanSettings, capture_for_plan, plan_for_batch
from lightning_autopart.lightning.hooks import batch_size_of, find_forward
from lightning_autopart.lightning.input_checks import check_trainable
from lightning_autopart.lightning.log_channel import open_log_channel
from lightning_autopart.lightning.ragged import batchless_outputs
from lightning_autopart.lightning.step_loss import step_loss
from lightning_autopart.lightning.steps import PipelinedSteps
from lightning_autopart.plan import Plan
from lightning_autopart.runtime.materialize import Materialized, has_meta_tensors, materialize
from lightning_autopart.runtime.runner import PipelineRunner
from lightning_autopart.runtime.topology import build_groups, place

__all__ = ["PARTITION_ATTRIBUTE", "Partition", "split_module"]

#: The attribute of a LightningModule holding its :class:`Partition` once a strategy split it.
PARTITION_ATTRIBUTE = "_autopart_partition"


@dataclass
class Partition:
    """A module split by a plan on this rank: the plan, the step glue over its runner and what the strategy needs
    for clipping and optimizers. It stays on the module (``PARTITION_ATTRIBUTE``), so a later ``validate``,
    ``test``, ``predict`` or ``fit``, by this Trainer or another, runs on the same split without re-planning."""

    plan: Plan
    steps: PipelinedSteps
    #: Ids of every parameter and buffer the pipelined module's blocks use.
    in_blocks: set[int]
    #: Ids of tied parameters whose gradient another rank counts in the global norm.
    counted_elsewhere: set[int]
    pp_group: Any
    world_size: int
    #: What materialising a model built on the meta device did on this rank (None: it was not on meta).
    materialized: Materialized | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # process groups and schedules do not copy; a copied module re-plans

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(None), ())

    def check_job(self, world_size: int, device: torch.device) -> None:
        """Refuse a job this earlier split cannot run: another world size or device, with the fix."""
        if self.world_size != world_size or self.steps.device != device:
            raise ConfigError(
                f"this model was split for {self.world_size} ranks on {self.steps.device} by an earlier run; "
                f"this Trainer has {world_size} ranks on {device}: load it from a checkpoint "
                "into a fresh model, or use the same devices"
            )


def split_module(
    module: Any,
    batch: Any,
    hook: str,
    settings: PlanSettings,
    *,
    fitting: bool,
    rank: int,
    world_size: int,
    num_nodes: int,
    device: torch.device,
    init_rng: torch.Tensor | None = None,
) -> Partition:
    """Plan ``module`` (a LightningModule) for ``batch`` of the loop running ``hook``, then build this rank's
    stages; the model the step calls first is pipelined, and only fitting prices the step's loss. A model built
    on the meta device is materialised here, this rank's share only, from the random state ``init_rng`` (see
    [Note: meta init] in :mod:`lightning_autopart.runtime.materialize`)."""
    call = find_forward(module, lambda: getattr(module, hook)(batch, 0))
    root = module.get_submodule(call.name) if call.name else module
    if fitting:  # every rank refuses alike, before any capture or profile
        check_trainable(root, call.name, module)
    size = batch_size_of(batch)
    plan, checked = plan_for_batch(
        settings,
        root,
        call,
        size,
        rank=rank,
        world_size=world_size,
        num_nodes=num_nodes,
        device=device,
        loss=step_loss(module, call.name, batch, size) if fitting else None,
    )
    captured, tied, elsewhere, in_blocks = capture_for_plan(plan, root, call, size, rank, checked)
    _check_same_layout(captured, plan, world_size, device)
    materialized = None
    if has_meta_tensors(module):  # built on meta: allocate and initialise only this rank's share
        materialized = materialize(module, _kept(module, plan, captured, rank, in_blocks), init_rng)
    groups = build_groups(plan, tied)
    runner = PipelineRunner(plan, captured, rank, device, tied=tied, groups=groups)
    channel = open_log_channel(plan, rank, device)
    shapes = tuple(t.shape for t in captured.inputs)
    steps = PipelinedSteps(module, call.name, runner, channel, device, captured.constant_inputs, shapes)
    steps.batchless = batchless_outputs(captured.cuts[-1], plan.micro_batch_size)
    if captured.evaluates and captured.eval_branches:
        steps.branch_modules = modules_of(captured.module, captured.eval_branches)
    elif not captured.evaluates:
        steps.eval_branches = captured.eval_branches
    pp_group = groups[tuple(sorted(runner.placement.pp_ranks))]
    return Partition(plan, steps, in_blocks, elsewhere, pp_group, world_size, materialized)


def _check_same_layout(captured: CapturedModel, plan: Plan, world_size: int, device: torch.device) -> None:
    """Refuse, on every rank alike, a job whose pipeline ranks captured different blocks (their stages would
    exchange tensors that do not match) or whose ranks registered the parameters in different orders (the
    replicas' gradient buckets would not match); see [Note: rank-independent values] in capture/keys.py."""
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return
    layout = int(layout_digest(captured)[:15], 16) if plan.num_stages > 1 else 0
    registration = int(registration_digest(captured.module)[:15], 16) if plan.replicas > 1 else 0
    mine = torch.tensor([layout, registration], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    # Only a pipeline's stages exchange tensors: each rank's capture is compared with its pipeline's first rank.
    pipeline = [place(plan, r).replica for r in range(world_size)]
    checks = (
        ("captured different graphs of", [pipeline.index(p) for p in pipeline]),
        ("registered the parameters in another order in", [0] * world_size),
    )
    for i, (what, against) in enumerate(checks):
        apart = [r for r in range(world_size) if int(every[r][i]) != int(every[against[r]][i])]
        if apart:
            raise ConfigError(
                f"the ranks {what} {type(captured.module).__name__} (ranks {apart} differ from rank "
                f"{against[apart[0]]}), so their pipeline stages and replicas would not fit together. Its code "
                "runs in an order that changes from process to process, usually a loop over a set of strings, "
                "whose order follows Python's per-process hash seed. Give every rank the same seed: set "
                "PYTHONHASHSEED=0 in the job's environment before Python starts"
            )


def _kept(module: Any, plan: Plan, captured: Any, rank: int, in_blocks: set[int]) -> set[int]:
    """Ids of the tensors this rank keeps: its stages' and every tensor outside the pipelined blocks."""
    root = captured.module
    stages = [plan.stages[s] for s in place(plan, rank).stages]
    blocks = [b for stage in stages for b in captured.blocks[stage.block_start : stage.block_end]]
    mine = {id(root.get_parameter(f)) for b in blocks for f in b.params}
    mine |= {id(root.get_buffer(f)) for b in blocks for f in b.buffers}
    outside = {id(t) for t in (*module.parameters(), *module.buffers()) if id(t) not in in_blocks}
    return mine | outside
