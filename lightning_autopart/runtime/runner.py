"""One rank's share of a training step: the plan's pipeline schedule, then the gradient all-reduces.

[Note: gradient semantics] The loss of each micro-batch is divided by the number of micro-batches before
its backward (the schedule's own ``scale_grads`` is off), so with a mean loss each replica accumulates the
gradient of the mean over its shard, and adds it to ``.grad`` as ``loss.backward()`` does. The runtime then
averages gradients over the replicas of each stage, which gives the gradient of the mean over the global batch,
as a single process would compute it. A tied parameter (held by several stages) is summed over the stages that
hold a copy and averaged over replicas, in one all-reduce over all its holders.

[Note: fixed shapes] Every step must bring exactly ``plan.batch_size / replicas`` samples per replica, split
evenly into ``plan.micro_batches`` micro-batches (the plan guarantees divisibility): the stages are captured at
the micro-batch size and the shapes sent between them are fixed. Another batch size raises
:class:`~lightning_autopart.errors.ConfigError` before any communication starts. (The Lightning strategy
pads a smaller last batch up to this size and weights its losses by real samples: [Note: ragged batches].)

[Note: one stage] A 1-stage plan (pure data parallelism) runs each micro-batch's forward, loss and backward
directly, in order, with the same slicing and loss scaling as the schedules: torch.distributed.pipelining would
add ~1 ms of per-step bookkeeping on this path (measured on CPU, docs/benchmarks.md) and has nothing to
overlap with one stage.

[Note: accumulation] Like DDP's ``no_sync``, a step with ``sync=False`` only accumulates this replica's local
gradient (into the bucket views); the next ``sync=True`` step all-reduces the buffers, which then hold the
window's whole local sum, and a tied parameter's total is summed over its holders once, at the end. So an
accumulation window of k steps costs one all-reduce of the stage's gradients, not k. Zero the gradients after
each optimizer step, as usual (``set_to_none`` or not: views are re-attached or kept).

[Note: lazy schedules] A schedule is built at its first use, inside the caller's context (autocast for mixed
precision), once :func:`~lightning_autopart.runtime.wire.infer_wire_metadata` has found the dtypes its stages send;
every rank of a pipeline reaches its first training (and first evaluation) step together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from lightning_autopart.capture.graph import CapturedModel, OutputSpec
from lightning_autopart.errors import ConfigError
from lightning_autopart.plan import Plan
from lightning_autopart.runtime.buckets import GradBucket, all_reduce_mean, make_buckets
from lightning_autopart.runtime.gradients import keep_contiguous
from lightning_autopart.runtime.outputs import release_outputs
from lightning_autopart.runtime.recompute import Recompute, log_recompute
from lightning_autopart.runtime.stages import (
    build_stage_module,
    parameters_in_order,
    stage_inputs,
    stage_outputs,
    tied_groups,
)
from lightning_autopart.runtime.topology import build_groups, place, tied_ranks
from lightning_autopart.runtime.wire import WireStage, infer_wire_metadata, touch

__all__ = ["LossFn", "PipelineRunner", "move_in_place"]

#: ``loss_fn(output, target)``: the loss of one micro-batch; ``output`` is the model's output, as its forward
#: returns it (a tensor, a tuple, a dict, a ``ModelOutput``...), ``target`` that micro-batch's slice of the target.
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class PipelineRunner:
    """Runs one rank's stages of ``plan`` over torch.distributed.pipelining, with data-parallel replicas.

    Args:
        plan: The plan; every rank must build its runner with the same plan.
        captured: The model captured at the plan's micro-batch size; this rank's stage modules are built from
            it (they hold the user's own parameters) and moved to ``device`` in place.
        rank: This process's global rank.
        device: The device of the stage modules.
        loss_fn: The training loss of one micro-batch (see :data:`LossFn`), a mean over its samples; it may also
            be set later, as the attribute ``loss_fn``.

    Keyword Args:
        tied: Tied parameters as (FQN, stage indices); derived from ``captured`` when None.
        groups: Process groups from :func:`~lightning_autopart.runtime.topology.build_groups`; when None they are
            created here, so every rank must then construct its runner at the same point.
    """

    def __init__(
        self,
        plan: Plan,
        captured: CapturedModel,
        rank: int,
        device: torch.device | str,
        loss_fn: LossFn | None = None,
        *,
        tied: Sequence[tuple[str, Sequence[int]]] | None = None,
        groups: Mapping[tuple[int, ...], dist.ProcessGroup] | None = None,
    ) -> None:
        self.plan = plan
        self.placement = place(plan, rank)
        self.device = torch.device(device)
        if tied is None:
            tied = tied_groups(plan, captured)
        if groups is None:
            groups = build_groups(plan, tied)
        #: How the model's output is rebuilt from the last stage's tensors.
        self.output: OutputSpec = captured.output
        #: This rank's stage modules by stage index (the user's parameters under their original names).
        self.modules: dict[int, nn.Module] = {}
        self._wire: dict[int, WireStage] = {}
        last = plan.num_stages - 1
        for s in self.placement.stages:
            stage = plan.stages[s]
            module = keep_contiguous(build_stage_module(captured, stage.block_start, stage.block_end))
            move_in_place(module, self.device)
            self.modules[s] = module
            received = None if s == 0 else stage_inputs(captured, stage.block_start)
            sent = None if s == last else stage_outputs(captured, stage.block_end)
            self._wire[s] = WireStage(Recompute(module) if stage.checkpoint else module, received, sent)
        log_recompute([s.index for s in plan.stages if s.checkpoint], plan.num_stages, rank)
        self._pp_group = groups[tuple(sorted(self.placement.pp_ranks))]
        self._dp_group = groups.get(self.placement.dp_ranks)
        self._tied = self._tied_params(tied, captured, groups)
        tied_ids = {id(p) for p, _ in self._tied}
        mine = parameters_in_order(captured, self.modules.values())
        self._params = [p for p in mine if p.requires_grad and id(p) not in tied_ids]
        #: The training loss of one micro-batch (see :data:`LossFn`).
        self.loss_fn = loss_fn
        self._each: Callable[[Any, torch.Tensor], None] | None = None
        self._scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._reported: list[torch.Tensor] = []  # this step's unscaled micro-batch losses
        self._buckets: list[GradBucket] = []
        if plan.replicas > 1 and self._dp_group is not None:
            self._buckets = make_buckets(self._params, plan.micro_batches, self._dp_group)
        self._schedules: dict[str, Any] = {}

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The process group of this rank's pipeline."""
        return self._pp_group

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's stage replicas (None with one replica)."""
        return self._dp_group

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (``step`` needs its inputs)."""
        return self.placement.is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (``step`` needs its target and returns the loss)."""
        return self.placement.is_last(self.plan.num_stages)

    @property
    def local_batch_size(self) -> int:
        """Samples per step on one replica: ``plan.batch_size / replicas``."""
        return self.plan.batch_size // self.plan.replicas

    def step(
        self,
        inputs: Any = None,
        target: torch.Tensor | None = None,
        *,
        sync: bool = True,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of one step on this replica's shard; gradients add to ``.grad`` as autograd's do
        (see [Note: gradient semantics]).

        Args:
            inputs: The model's tensor inputs (a Tensor or a sequence of them, in ``CapturedModel.inputs``
                order), first stage only; others pass None.
            target: The loss target (any tensor whose dim 0 is the batch), last stage only.
            sync: Whether to all-reduce the gradients among the replicas after this step (see
                [Note: accumulation]); pass False on every step of an accumulation window but the last.
            scale: Applied to each micro-batch's loss before its backward only (a gradient scaler's
                ``scale``); the returned loss is unscaled.

        Returns:
            On the last stage the mean of the micro-batch losses (detached, on the device); elsewhere None.
        """
        if self.is_last and (target is None or self.loss_fn is None):
            raise ConfigError(
                f"rank {self.placement.rank} holds the last stage: step needs the target and a loss_fn"
            )
        args = self._check(inputs, target)
        for bucket in self._buckets:
            bucket.attach(active=sync)
        self._scale = scale
        self._reported = []
        try:
            if self.plan.num_stages == 1:
                self._run_direct(args, target)
            else:
                kwargs: dict[str, Any] = {"target": target, "losses": []} if self.is_last else {}
                self._schedule("train", args).step(*args, return_outputs=False, **kwargs)
        finally:
            self._scale = None
            losses, self._reported = self._reported, []
            for bucket in self._buckets:
                bucket.active = False
        for bucket in self._buckets:
            bucket.finish(self.plan.replicas, sync)
        if sync:
            self._reduce_tied()
        # Each micro-batch's loss was divided by the micro-batches: their sum is the mean loss.
        return torch.stack(losses).sum() if self.is_last else None

    @torch.no_grad()
    def eval_step(
        self,
        inputs: Any = None,
        target: torch.Tensor | None = None,
        each: Callable[[Any, torch.Tensor], None] | None = None,
    ) -> Any:
        """Forward only. On the last stage, ``each(output, target_slice)`` is called for every micro-batch in
        order (``target`` defaults to the sample indices); without ``each``, the outputs are returned merged along
        dim 0. Returns None on other stages, and when ``each`` is given."""
        args = self._check(inputs, target)
        if target is None:
            target = torch.arange(self.local_batch_size, device=self.device)
        outputs: list[Any] = []
        self._each = each if each is not None else lambda output, _: outputs.append(output)
        try:
            if self.plan.num_stages == 1:
                for chunk, target_chunk in zip(self._chunks(args), self._split(target), strict=True):
                    self._each(self._rebuild(self._wire[0](*chunk)), target_chunk)
            else:
                kwargs = {"target": target, "losses": []} if self.is_last else {}
                self._schedule("eval", args).eval(*args, return_outputs=False, **kwargs)
        finally:
            self._each = None
        if each is not None or not self.is_last:
            return None
        return _merge(outputs)

    def _rebuild(self, outputs: Sequence[torch.Tensor]) -> Any:
        return self.output.rebuild(outputs)

    def _split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.tensor_split(tensor, self.plan.micro_batches))

    def _chunks(self, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        """The micro-batches of ``tensors``: dim-0 slices, as pipelining makes them."""
        split = [self._split(t) for t in tensors]
        return list(zip(*split, strict=True))

    def _run_direct(self, args: tuple[torch.Tensor, ...], target: torch.Tensor | None) -> None:
        """A 1-stage step: forward, loss and backward of each micro-batch in turn, as the schedule would."""
        assert target is not None  # the only stage is the last: step() checked it
        stage = self._wire[0]
        for chunk, target_chunk in zip(self._chunks(args), self._split(target), strict=True):
            self._train_loss(stage(*chunk), target_chunk).backward()

    def _train_loss(self, output: Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the user's loss / micro-batches, reported unscaled, then scaled."""
        assert self.loss_fn is not None  # step() checked it
        loss = self.loss_fn(self._rebuild(output), target) / self.plan.micro_batches
        self._reported.append(loss.detach())
        if self._scale is not None:
            loss = self._scale(loss)
        return touch(loss, self._wire[self.plan.num_stages - 1].untouched)

    def _eval_hook(self, output: Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """The eval schedule's "loss": hands each micro-batch's output to ``each``."""
        assert self._each is not None
        self._each(self._rebuild(output), target)
        return torch.zeros((), device=self.device)

    def _check(self, inputs: Any, target: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The first stage's inputs (contiguous), after checking that batch sizes match the plan."""
        expected = self.local_batch_size
        checks: list[tuple[str, Any]] = []
        args: tuple[torch.Tensor, ...] = ()
        if self.is_first:
            if inputs is None:
                raise ConfigError(f"rank {self.placement.rank} holds the first stage: step needs the inputs")
            args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            checks += [(f"input {i}", t) for i, t in enumerate(tree_leaves(args))]
            args = tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in args)
        if self.is_last and target is not None:
            checks.append(("target", target))
        for what, t in checks:
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != expected):
                size = tuple(t.shape)
                raise ConfigError(
                    f"{what} has shape {size}, but the plan needs {expected} samples per replica "
                    f"(batch size {self.plan.batch_size} / {self.plan.replicas} replicas) in "
                    f"{self.plan.micro_batches} micro-batches; pipelined shapes are fixed, so use drop_last=True "
                    f"or re-plan for this batch size"
                )
        return args

    def release(self, kind: str) -> None:
        """Drop the ``kind`` schedule and its stages: torch.distributed.pipelining keeps a receive buffer per
        micro-batch for as long as a stage lives, so an evaluation's would stay through training (``M`` x the cut's
        bytes; see [Note: pipeline buffers] in partition/cost.py). Every rank of the pipeline releases together;
        the next use builds it again."""
        self._schedules.pop(kind, None)

    def _schedule(self, kind: str, args: tuple[torch.Tensor, ...]) -> Any:
        """The plan's ``kind`` ("train" or "eval") schedule over this rank's stages, built at first use (see
        [Note: lazy schedules])."""
        if kind in self._schedules:
            return self._schedules[kind]
        first = self._chunks(args)[0] if self.is_first else None
        ranks = {s.index: s.ranks[self.placement.replica] for s in self.plan.stages}
        metas = infer_wire_metadata(
            self._wire, self.plan.num_stages, first, self.device, self._pp_group, ranks
        )
        stages: list[Any] = [
            PipelineStage(
                self._wire[s],
                s,
                self.plan.num_stages,
                self.device,
                input_args=metas[s].inputs,
                output_args=metas[s].outputs,
                group=self._pp_group,
            )
            for s in self.placement.stages
        ]
        hook = self._train_loss if kind == "train" else self._eval_hook
        last = next((st for st in stages if st.is_last), None)

        def loss(output: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
            value = hook(output, target)
            release_outputs(last, output)  # [Note: the last stage's outputs]
            return value

        # The loss is scaled by 1 / micro-batches before backward; see [Note: gradient semantics].
        options: dict[str, Any] = {"loss_fn": loss, "scale_grads": False}
        n = self.plan.micro_batches
        name = self.plan.schedule
        if name == "Interleaved1F1B":
            schedule: Any = ScheduleInterleaved1F1B(stages, n, **options)
        elif len(stages) != 1:
            raise ConfigError(f"schedule {name} runs one stage per rank; rank holds {len(stages)}")
        elif name == "1F1B" and n >= self.plan.num_stages:
            schedule = Schedule1F1B(stages[0], n, **options)
        elif name in ("GPipe", "1F1B"):
            schedule = ScheduleGPipe(stages[0], n, **options)
        else:
            raise ConfigError(f"unknown schedule {name!r}; use GPipe, 1F1B or Interleaved1F1B")
        self._schedules[kind] = schedule
        return schedule

    def _tied_params(
        self,
        tied: Sequence[tuple[str, Sequence[int]]],
        captured: CapturedModel,
        groups: Mapping[tuple[int, ...], dist.ProcessGroup],
    ) -> list[tuple[nn.Parameter, dist.ProcessGroup | None]]:
        """This rank's tied parameters, each with the group its gradient is summed over."""
        out: list[tuple[nn.Parameter, dist.ProcessGroup | None]] = []
        for fqn, stages in tied:
            if not set(stages) & set(self.placement.stages):
                continue
            param = captured.module.get_parameter(fqn)
            ranks = tied_ranks(self.plan, stages)
            out.append((param, groups[ranks] if len(ranks) > 1 else None))
        return out

    def _reduce_tied(self) -> None:
        """Sum each tied gradient over the stages holding it, averaged over replicas (one all-reduce each)."""
        for param, group in self._tied:
            if param.grad is not None and group is not None:
                all_reduce_mean([param.grad], group, self.plan.replicas)


def _merge(outputs: list[Any]) -> Any:
    """Micro-batch outputs (the model's output structure) with every tensor concatenated along dim 0."""
    leaves = [tree_flatten(o) for o in outputs]
    spec = leaves[0][1]
    merged = [
        torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0]
        for parts in zip(*(flat for flat, _ in leaves), strict=True)
    ]
    return tree_unflatten(merged, spec)


def move_in_place(module: nn.Module, device: torch.device) -> None:
    """Move every parameter, gradient and buffer of ``module`` to ``device`` keeping each tensor object.

    ``Module.to`` replaces buffers by new tensors, which would part the stage modules (built over the same
    tensors) from the user's model; setting ``.data`` keeps them one tensor.
    """
    for p in module.parameters():
        if p.device != device and p.device.type != "meta":  # meta: another rank's stage holds it
            p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
    for b in module.buffers():
        if b.device != device and b.device.type != "meta":
            b.data = b.data.to(device)
