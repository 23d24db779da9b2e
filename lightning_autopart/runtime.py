"""One rank's share of a training step: the plan's pipeline schedule, then the gradient all-reduces.

[Note: gradient semantics] The loss of each micro-batch is divided by the number of micro-batches before
its backward (the schedule's own ``scale_grads`` is off), so with a mean loss each replica accumulates the
gradient of the mean over its shard, and adds it to ``.grad`` as ``loss.backward()`` does. The runtime then
averages gradients over the replicas of each stage, which gives the gradient of the mean over the global batch,
as a single process would compute it. A tied parameter (held by several stages) is summed over the stages that
hold a copy and averaged over replicas, in one all-reduce over all its holders.

[Note: fixed shapes] torch.distributed.pipelining infers the shapes sent between stages from the first
micro-batch and keeps them: every step must bring exactly ``plan.batch_size / replicas`` samples per replica,
split evenly into ``plan.micro_batches`` micro-batches (the plan guarantees divisibility). Another batch
size raises :class:`~lightning_autopart.errors.ConfigError` before any communication starts.

[Note: one stage] A 1-stage plan (pure data parallelism) runs each micro-batch's forward, loss and backward
directly, in order, with the same slicing and loss scaling as the schedules: torch.distributed.pipelining would
add ~1 ms of per-step bookkeeping on this path (measured on CPU, docs/benchmarks.md) and has nothing to
overlap with one stage.

[Note: accumulation] Like DDP's ``no_sync``, a step with ``sync=False`` only accumulates this replica's local
gradient (into the bucket views); the next ``sync=True`` step all-reduces the buffers, which then hold the
window's whole local sum, and a tied parameter's total is summed over its holders once, at the end. So an
accumulation window of k steps costs one all-reduce of the stage's gradients, not k. Zero the gradients after
each optimizer step, as usual (``set_to_none`` or not: views are re-attached or kept).
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
from torch.utils._pytree import tree_leaves

from lightning_autopart.buckets import GradBucket, all_reduce_mean, make_buckets
from lightning_autopart.errors import ConfigError
from lightning_autopart.graph import CapturedModel
from lightning_autopart.plan import Plan
from lightning_autopart.stages import build_stage_module, tied_groups
from lightning_autopart.topology import build_groups, place, tied_ranks

__all__ = ["PipelineRunner"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class PipelineRunner:
    """Runs one rank's stages of ``plan`` over torch.distributed.pipelining, with data-parallel replicas.

    Args:
        plan: The plan; every rank must build its runner with the same plan.
        model: The captured model (stage modules are built for this rank's stages), or this rank's stage
            modules by stage index.
        rank: This process's global rank.
        device: The device of the stage modules.
        loss_fn: ``loss_fn(output, target)`` on one micro-batch (a mean over its samples); ``output`` is the
            model's output tensor, or the tuple of its outputs when there are several.

    Keyword Args:
        tied: Tied parameters as (FQN, stage indices); derived from ``model`` when it is a CapturedModel.
        groups: Process groups from :func:`~lightning_autopart.topology.build_groups`; when None they are
            created here, so every rank must then construct its runner at the same point.
    """

    def __init__(
        self,
        plan: Plan,
        model: CapturedModel | Mapping[int, nn.Module],
        rank: int,
        device: torch.device | str,
        loss_fn: LossFn,
        *,
        tied: Sequence[tuple[str, Sequence[int]]] | None = None,
        groups: Mapping[tuple[int, ...], dist.ProcessGroup] | None = None,
    ) -> None:
        self.plan = plan
        self.placement = place(plan, rank)
        self.device = torch.device(device)
        captured = model if isinstance(model, CapturedModel) else None
        if tied is None:
            tied = tied_groups(plan, captured) if captured is not None else []
        if groups is None:
            groups = build_groups(plan, tied, self.device.type)
        #: This rank's stage modules by stage index.
        self.modules: dict[int, nn.Module] = {}
        for s in self.placement.stages:
            stage = plan.stages[s]
            if captured is not None:
                module = build_stage_module(captured, stage.block_start, stage.block_end)
            elif isinstance(model, Mapping) and s in model:
                module = model[s]
            else:
                raise ConfigError(f"rank {rank} holds stage {s} but no module was given for it")
            self.modules[s] = module.to(self.device)
        self._pp_group = groups[tuple(sorted(self.placement.pp_ranks))]
        self._dp_group = groups.get(self.placement.dp_ranks)
        self._tied = self._tied_params(tied, captured, groups)
        tied_ids = {id(p) for p, _ in self._tied}
        self._params = [
            p
            for p in dict.fromkeys(p for m in self.modules.values() for p in m.parameters())
            if p.requires_grad and id(p) not in tied_ids
        ]
        self._loss_fn = loss_fn
        self._buckets: list[GradBucket] = []
        if plan.replicas > 1 and self._dp_group is not None:
            self._buckets = make_buckets(self._params, plan.micro_batches, self._dp_group)
        # A 1-stage plan has nothing to pipeline: its micro-batches run directly (see [Note: one stage]).
        direct = plan.num_stages == 1
        self._train = None if direct else self._schedule(with_loss=True)
        self._eval = None if direct else self._schedule(with_loss=False)

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
        self, inputs: Any = None, target: torch.Tensor | None = None, *, sync: bool = True
    ) -> torch.Tensor | None:
        """Forward and backward of one step on this replica's shard; gradients add to ``.grad`` as autograd's do
        (see [Note: gradient semantics]).

        Args:
            inputs: The model's inputs (a Tensor or a tuple of them), first stage only; others pass None.
            target: The loss target, last stage only.
            sync: Whether to all-reduce the gradients among the replicas after this step (see
                [Note: accumulation]); pass False on every step of an accumulation window but the last.

        Returns:
            On the last stage the mean of the micro-batch losses (detached); elsewhere None.
        """
        if self.is_last and target is None:
            raise ConfigError(f"rank {self.placement.rank} holds the last stage: step needs the target")
        args = self._check(inputs, target)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        for bucket in self._buckets:
            bucket.attach(active=sync)
        try:
            if self._train is None:
                self._run_direct(args, target, losses)
            else:
                self._train.step(*args, **kwargs)
        finally:
            for bucket in self._buckets:
                bucket.active = False
        for bucket in self._buckets:
            bucket.finish(self.plan.replicas, sync)
        if sync:
            self._reduce_tied()
        # Each micro-batch's loss was divided by the micro-batches: their sum is the mean loss.
        return torch.stack([loss.detach() for loss in losses]).sum() if self.is_last else None

    @torch.no_grad()
    def eval_step(self, inputs: Any = None) -> Any:
        """Forward only; returns the model's output on the last stage (merged over micro-batches), else None."""
        args = self._check(inputs, None)
        if self._eval is None:
            return _unwrap(_merge([self.modules[0](*chunk) for chunk in self._chunks(args)]))
        with torch.enable_grad():  # pipelining refuses to run under no_grad; its eval builds no graph
            output = self._eval.eval(*args)
        return _unwrap(output) if self.is_last else None

    def _chunks(self, tensors: Sequence[Any]) -> list[tuple[Any, ...]]:
        """The micro-batches of ``tensors``: dim-0 slices as pipelining makes them; non-tensors repeated."""
        n = self.plan.micro_batches
        split = [torch.tensor_split(t, n) if isinstance(t, torch.Tensor) else [t] * n for t in tensors]
        return list(zip(*split, strict=True))

    def _run_direct(
        self, args: tuple[Any, ...], target: torch.Tensor | None, losses: list[torch.Tensor]
    ) -> None:
        """A 1-stage step: forward, loss and backward of each micro-batch in turn, as the schedule would."""
        assert target is not None  # the only stage is the last: step() checked it
        module = self.modules[0]
        for chunk, target_chunk in zip(
            self._chunks(args), torch.tensor_split(target, self.plan.micro_batches), strict=True
        ):
            loss = self._loss(module(*chunk), target_chunk)
            loss.backward()
            losses.append(loss)

    def _check(self, inputs: Any, target: torch.Tensor | None) -> tuple[Any, ...]:
        """The first stage's positional inputs, after checking that batch sizes match the plan."""
        expected = self.local_batch_size
        checks: list[tuple[str, Any]] = []
        args: tuple[Any, ...] = ()
        if self.is_first:
            if inputs is None:
                raise ConfigError(f"rank {self.placement.rank} holds the first stage: step needs the inputs")
            args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            checks += [(f"input {i}", t) for i, t in enumerate(tree_leaves(args))]
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

    def _schedule(self, with_loss: bool) -> Any:
        """The plan's schedule over this rank's stages (a fresh PipelineStage per schedule)."""
        stages: list[Any] = [
            PipelineStage(self.modules[s], s, self.plan.num_stages, self.device, group=self._pp_group)
            for s in self.placement.stages
        ]
        # The loss is scaled by 1 / micro-batches before backward; see [Note: gradient semantics].
        options: dict[str, Any] = {"loss_fn": self._loss if with_loss else None, "scale_grads": False}
        n = self.plan.micro_batches
        name = self.plan.schedule
        if name == "Interleaved1F1B":
            return ScheduleInterleaved1F1B(stages, n, **options)
        if len(stages) != 1:
            raise ConfigError(f"schedule {name} runs one stage per rank; rank holds {len(stages)}")
        if name == "1F1B" and n >= self.plan.num_stages:
            return Schedule1F1B(stages[0], n, **options)
        if name not in ("GPipe", "1F1B"):
            raise ConfigError(f"unknown schedule {name!r}; use GPipe, 1F1B or Interleaved1F1B")
        return ScheduleGPipe(stages[0], n, **options)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(_unwrap(output), target) / self.plan.micro_batches

    def _tied_params(
        self,
        tied: Sequence[tuple[str, Sequence[int]]],
        captured: CapturedModel | None,
        groups: Mapping[tuple[int, ...], dist.ProcessGroup],
    ) -> list[tuple[nn.Parameter, dist.ProcessGroup | None]]:
        """This rank's tied parameters, each with the group its gradient is summed over."""
        out: list[tuple[nn.Parameter, dist.ProcessGroup | None]] = []
        for fqn, stages in tied:
            if not set(stages) & set(self.placement.stages):
                continue
            if captured is not None:
                param = captured.module.get_parameter(fqn)
            else:
                named = {n: p for m in self.modules.values() for n, p in m.named_parameters()}
                if fqn not in named:
                    raise ConfigError(f"tied parameter {fqn!r} is in no stage module of this rank")
                param = named[fqn]
            ranks = tied_ranks(self.plan, stages)
            out.append((param, groups[ranks] if len(ranks) > 1 else None))
        return out

    def _reduce_tied(self) -> None:
        """Sum each tied gradient over the stages holding it, averaged over replicas (one all-reduce each)."""
        for param, group in self._tied:
            if param.grad is not None and group is not None:
                all_reduce_mean([param.grad], group, self.plan.replicas)


def _merge(outputs: list[Any]) -> Any:
    """Micro-batch outputs (tensors or tuples of them) concatenated along dim 0, as pipelining merges them."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs, strict=True))


def _unwrap(output: Any) -> Any:
    """A one-tensor tuple as its tensor (stage modules return tuples; users' models return tensors)."""
    return output[0] if isinstance(output, tuple) and len(output) == 1 else output
