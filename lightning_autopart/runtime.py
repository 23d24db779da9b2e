"""One rank's share of a training step: the plan's pipeline schedule, then the gradient all-reduces.

[Note: gradient semantics] The schedule divides gradients by the number of micro-batches
(``scale_grads=True``), so with a mean loss each replica holds the gradient of the mean over its shard.
The runtime then averages gradients over the replicas of each stage, which gives the gradient of the mean
over the global batch, as a single process would compute it. A tied parameter (held by several stages) is
summed over the stages that hold a copy and averaged over replicas, in one all-reduce over all its holders.

[Note: fixed shapes] torch.distributed.pipelining infers the shapes sent between stages from the first
micro-batch and keeps them: every step must bring exactly ``plan.batch_size / replicas`` samples per replica,
split evenly into ``plan.micro_batches`` micro-batches (the plan guarantees divisibility). Another batch
size raises :class:`~lightning_autopart.errors.ConfigError` before any communication starts.

[Note: overlapped all-reduce] As DDP does, the replicas' gradient all-reduce overlaps the last micro-batch's
backward: parameters are grouped into buckets of about ``BUCKET_BYTES`` in reverse registration order (about
the order backward finishes them), and a post-accumulate-grad hook counts each parameter's accumulations; when
every parameter of a bucket has received its last micro-batch's gradient, the bucket is flattened and
all-reduced asynchronously. After the schedule (which divides gradients by the micro-batches), the summed
buckets are copied back divided by ``replicas x micro_batches``, which equals averaging the scaled gradients
(the buckets only ever see this step's gradients; see [Note: accumulation] for earlier ones). Stages are
captured graphs, so every replica finishes its buckets in the same order; a bucket that never became ready (a parameter that
got no gradient) is reduced after the schedule, on every replica alike.

[Note: accumulation] ``step`` adds to ``.grad`` as ``loss.backward()`` does, and like DDP's ``no_sync`` a
step with ``sync=False`` adds only this replica's local gradient. The gradients held before a step are set
aside while the schedule runs (it divides whatever ``.grad`` holds by the micro-batches) and added back after.
A ``sync=True`` step all-reduces them (the local sum of the window's earlier steps) asynchronously from the
start of its schedule, so that message overlaps the whole forward and backward, while the buckets carry this
step's own gradients; a tied parameter's total is summed over its holders once, at the end. So an accumulation
window of k steps costs one all-reduce of the stage's gradients plus one overlapped message, not k. Zero the
gradients after each optimizer step, as usual.
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

from lightning_autopart.errors import ConfigError
from lightning_autopart.graph import CapturedModel
from lightning_autopart.plan import Plan
from lightning_autopart.stages import build_stage_module, tied_groups
from lightning_autopart.topology import build_groups, place, tied_ranks

__all__ = ["PipelineRunner"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]

#: Gradient bytes per overlapped all-reduce bucket (see [Note: overlapped all-reduce]).
BUCKET_BYTES = 2 * 1024 * 1024


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
        self._buckets: list[_Bucket] = []
        if plan.replicas > 1 and self._dp_group is not None:
            self._buckets = _make_buckets(self._params, plan.micro_batches, self._dp_group)
        self._train = self._schedule(with_loss=True)
        self._eval = self._schedule(with_loss=False)

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
        """Forward and backward of one step on this replica's shard; gradients add to ``.grad`` as autograd's do.

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
        # The schedule divides every .grad by the micro-batches: set earlier gradients aside until it is done.
        params = self._params + [p for p, _ in self._tied]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        local = earlier[: len(self._params)]
        pending = None
        if sync and self._buckets and self._dp_group is not None and any(g is not None for g in local):
            pending = _start_all_reduce(local, self._dp_group)
        for bucket in self._buckets:
            bucket.reset(active=sync)
        try:
            self._train.step(*args, **kwargs)
        finally:
            for bucket in self._buckets:
                bucket.active = False
        if sync:
            for bucket in self._buckets:
                bucket.finish(self.plan.replicas)
            if pending is not None:
                pending.wait()
        for p, g in zip(params, earlier, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        if sync:
            self._reduce_tied()
        return torch.stack([loss.detach() for loss in losses]).mean() if self.is_last else None

    @torch.no_grad()
    def eval_step(self, inputs: Any = None) -> Any:
        """Forward only; returns the model's output on the last stage (merged over micro-batches), else None."""
        args = self._check(inputs, None)
        with torch.enable_grad():  # pipelining refuses to run under no_grad; its eval builds no graph
            output = self._eval.eval(*args)
        return _unwrap(output) if self.is_last else None

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
        loss_fn = self._loss if with_loss else None
        n = self.plan.micro_batches
        name = self.plan.schedule
        if name == "Interleaved1F1B":
            return ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn)
        if len(stages) != 1:
            raise ConfigError(f"schedule {name} runs one stage per rank; rank holds {len(stages)}")
        if name == "1F1B" and n >= self.plan.num_stages:
            return Schedule1F1B(stages[0], n, loss_fn=loss_fn)
        if name not in ("GPipe", "1F1B"):
            raise ConfigError(f"unknown schedule {name!r}; use GPipe, 1F1B or Interleaved1F1B")
        return ScheduleGPipe(stages[0], n, loss_fn=loss_fn)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(_unwrap(output), target)

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
                _all_reduce([param.grad], group, self.plan.replicas)


class _Bucket:
    """Parameters whose gradients are all-reduced in one flat message, launched from backward when ready."""

    def __init__(self, params: list[nn.Parameter], micro_batches: int, group: dist.ProcessGroup) -> None:
        self.params = params
        self.micro_batches = micro_batches
        self.group = group
        self.active = False
        self._counts = [0] * len(params)
        self._pending = len(params)
        self._flat: torch.Tensor | None = None
        self._work: Any = None
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.active:
                return
            self._counts[index] += 1
            if self._counts[index] == self.micro_batches:
                self._pending -= 1
                if self._pending == 0:
                    self._launch()

        return hook

    def reset(self, active: bool = True) -> None:
        """Arm the bucket for a training step (``active=False``: a step that does not all-reduce)."""
        self.active = active
        self._counts = [0] * len(self.params)
        self._pending = len(self.params)
        self._flat = None
        self._work = None

    def _launch(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            self._flat = torch.empty(0)
            return
        self._flat = torch.cat([g.reshape(-1) for g in grads])
        self._work = dist.all_reduce(self._flat, group=self.group, async_op=True)

    def finish(self, replicas: int) -> None:
        """Wait for the bucket's all-reduce (launching it now if backward never did) and write the mean back."""
        if self._flat is None:
            # Not every parameter got its last gradient (unused in the graph): the same on every replica.
            # Gradients are already divided by the micro-batches here: average over the replicas only.
            _all_reduce([p.grad for p in self.params if p.grad is not None], self.group, replicas)
            return
        if self._work is not None:
            self._work.wait()
        flat = self._flat
        flat /= replicas * self.micro_batches
        offset = 0
        for p in self.params:
            if p.grad is not None:
                g = p.grad
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self._flat = None
        self._work = None


def _make_buckets(params: list[nn.Parameter], micro_batches: int, group: dist.ProcessGroup) -> list[_Bucket]:
    """Buckets of about BUCKET_BYTES over ``params`` in reverse order (the order backward tends to finish them)."""
    buckets: list[_Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= BUCKET_BYTES:
            buckets.append(_Bucket(current, micro_batches, group))
            current, size = [], 0
    if current:
        buckets.append(_Bucket(current, micro_batches, group))
    return buckets


class _PendingReduce:
    """An asynchronous all-reduce of several gradients in one flat message; ``wait`` writes back the mean."""

    def __init__(self, grads: list[torch.Tensor], group: dist.ProcessGroup, divisor: int) -> None:
        self.grads = grads
        self.divisor = divisor
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def wait(self) -> None:
        """Wait for the sum, divide it by ``divisor`` and copy it back into the gradients, in place."""
        self.work.wait()
        if self.divisor != 1:
            self.flat /= self.divisor
        offset = 0
        for g in self.grads:
            g.copy_(self.flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _start_all_reduce(grads: list[torch.Tensor | None], group: dist.ProcessGroup) -> _PendingReduce:
    """Launch the replicas' mean of the gradients that are not None (see [Note: accumulation])."""
    return _PendingReduce([g for g in grads if g is not None], group, dist.get_world_size(group))


def _all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup, divisor: int) -> None:
    """Sum ``grads`` over ``group`` in one flat message, then divide by ``divisor``, in place."""
    if grads:
        _PendingReduce(grads, group, divisor).wait()


def _unwrap(output: Any) -> Any:
    """A one-tensor tuple as its tensor (stage modules return tuples; users' models return tensors)."""
    return output[0] if isinstance(output, tuple) and len(output) == 1 else output
