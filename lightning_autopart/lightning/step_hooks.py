"""The strategy's step methods: Lightning's training, evaluation and predict steps and its backward, run through
this rank's share of the pipeline (see :class:`~lightning_autopart.lightning.steps.PipelinedSteps`), and
Lightning's collectives over the ranks a plain DDP job would have.

[Note: collectives] A DDP rank is a data-parallel replica; under autopart every stage of a pipeline sees the
replica's batch and logs the same (replayed) values. So ``reduce`` and ``all_gather`` run over the
data-parallel replicas of this rank's stage: ``self.log(..., sync_dist=True)`` with ``reduce_fx="sum"`` adds
the replicas' values once each, not once per stage, and ``self.all_gather(x)`` has one entry per replica, as
under DDP with as many processes. With one replica neither runs a collective (``all_gather`` returns ``x``, as
``LightningModule.all_gather`` documents for a world of one). In a step, ``all_gather`` runs on the stage that
calls it, among that stage's replicas: the last stage runs the step once per micro-batch, so it gathers
micro-batch values. Decisions every rank must share (``reduce_boolean_decision``: checkpoints, early
stopping), ``barrier`` and ``broadcast`` use every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.grad_logs import GradientLogs, gathered_logs
from lightning_autopart.lightning.hooks import instance_attribute
from lightning_autopart.lightning.split import Partition
from lightning_autopart.lightning.steps import PipelinedSteps
from lightning_autopart.runtime.gradients import agree_on_overflow, clip_by_global_norm

__all__ = ["StepHooks"]


if TYPE_CHECKING:  # the Strategy's loop hooks, after this class in the MRO

    class _LoopHooks:
        def on_validation_start(self) -> None: ...

        def on_train_end(self) -> None: ...

        def on_validation_end(self) -> None: ...

        def on_test_end(self) -> None: ...

        def on_predict_end(self) -> None: ...

        def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any: ...

else:
    _LoopHooks = object


class StepHooks(_LoopHooks):
    """The Strategy's step methods, over the :class:`Partition` made in ``setup``. The pipeline runs forward and
    backward inside ``training_step``; ``backward`` only hands the gradients to the parameters, after Lightning's
    ``zero_grad``. At the loops' boundaries it reads the non-finite loss check and drops an evaluation's
    schedule. What the gradient hooks log is gathered from every stage (see [Note: gradient hooks])."""

    _part: Partition | None
    _params: list[Any]
    _stash: list[Tensor | None]
    precision_plugin: Any
    world_size: int
    _lm: Any
    root_device: Any
    #: The gathering of the gradient hooks' logs, with the partition it serves.
    _gradient_logs: tuple[Partition, GradientLogs] | None = None

    @property
    def _steps(self) -> PipelinedSteps | None:
        return self._part.steps if self._part is not None else None

    if TYPE_CHECKING:  # the Strategy's own, after this class in the MRO

        def pre_backward(self, closure_loss: Tensor) -> None: ...

        def post_backward(self, closure_loss: Tensor) -> None: ...

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._check_losses()

    def on_train_end(self) -> None:
        super().on_train_end()
        self._check_losses()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._release_eval()

    def on_test_end(self) -> None:
        super().on_test_end()
        self._release_eval()

    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._release_eval()

    def _release_eval(self) -> None:
        """An evaluation loop is over: its schedule's receive buffers must not stay through training."""
        if self._part is not None:
            self._part.steps.runner.release("eval")

    def _check_losses(self) -> None:
        """Read the non-finite loss check's window outside any step (see [Note: non-finite loss])."""
        if self._steps is not None and self._lm.trainer.state.fn == TrainerFn.FITTING:
            self._steps.losses.check(scaled=self._steps.scale is not None)

    @property
    def _layer_sync(self) -> LayerSync | None:
        """Lightning's ``sync_batchnorm`` plugin slot: always empty (see the setter)."""
        return None

    @_layer_sync.setter
    def _layer_sync(self, plugin: LayerSync | None) -> None:
        if plugin is not None:
            raise ConfigError(
                f"Trainer(sync_batchnorm=True) (or a {type(plugin).__name__} plugin) is not supported by "
                "AutoPartitionStrategy: BatchNorm statistics are computed per micro-batch on the stage that holds "
                "the layer and are not synchronised across replicas; drop sync_batchnorm, or use the 'ddp' strategy"
            )

    def _collective_group(self, group: Any | None) -> Any | None:
        """The group of ``reduce`` and ``all_gather`` (see [Note: collectives]): ``group`` if given, else this
        stage's data-parallel group; None where there is nothing to collect (one replica, one process, or no
        split yet: the planner runs the user's step on rank 0 alone). The default group (``WORLD``, which
        ``LightningModule.all_gather`` passes when given none) counts as not given."""
        if group is not None and group is not _group.WORLD:
            return group
        if not _distributed_is_initialized() or self.world_size == 1 or self._part is None:
            return None
        if self._part.plan.replicas == 1:
            return None
        return self._part.steps.runner.dp_group

    def barrier(self, name: str | None = None) -> None:
        """Every rank of the job (Lightning's barriers are job-wide)."""
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from global rank ``src`` to every rank of the job."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """One entry per data-parallel replica, stacked (see [Note: collectives]); with one replica, ``tensor``
        itself (as ``LightningModule.all_gather`` documents for a world of one)."""
        chosen = self._collective_group(group)
        if chosen is None:
            return tensor
        return _all_gather_ddp_if_available(tensor, group=chosen, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``all`` (or any, with ``all=False``) of every rank's decision: every stage must stop, or save, alike."""
        if not _distributed_is_initialized() or self.world_size == 1:
            return decision
        votes = _sync_ddp_if_available(
            torch.tensor(int(decision), device=self.root_device), _group.WORLD, reduce_op="sum"
        )
        return bool(votes == self.world_size) if all else bool(votes)

    def _loss_scale(self) -> Any:
        """The precision plugin's gradient scaler (16-mixed), applied to each micro-batch's loss before its backward,
        with its inf check agreed by every rank, so that all stages skip the same steps."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None:
            return None
        unscale = scaler.unscale_

        def agreed_unscale(optimizer: Any) -> None:
            unscale(optimizer)
            if _distributed_is_initialized() and self.world_size > 1:
                agree_on_overflow(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

        scaler.unscale_ = agreed_unscale
        return scaler.scale

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._steps is None:
            raise ConfigError("AutoPartitionStrategy ran a training step before setup partitioned the model")
        trainer = self._lm.trainer
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:  # Lightning zeroes gradients only after this step: start clean
            for p in self._params:
                p.grad = None
        sync = not trainer.fit_loop._should_accumulate()
        with self.precision_plugin.train_step_context():
            loss = self._steps.train(batch, batch_idx, accumulate, sync)
        # Hide the gradients from Lightning's zero_grad, which runs between this step and backward.
        self._stash = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        return loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline; every rank of the pipeline returns the predictions of its replica's batch."""
        assert self._steps is not None, "predict_step before setup"
        with self.precision_plugin.predict_step_context():
            return self._steps.predict(*args, **kwargs)

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        assert self._steps is not None, f"{hook} before setup"
        context = self.precision_plugin.val_step_context if hook == "validation_step" else (
            self.precision_plugin.test_step_context
        )
        with context():
            return self._steps.evaluate(hook, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """No autograd here (the pipeline ran it); fire the hooks and hand the gradients back."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._lm)
        for p, g in zip(self._params, self._stash, strict=False):
            p.grad = g
        self._stash = []  # the parameters hold them now: kept here, they would outlive zero_grad
        with self._gathered_logs("on_after_backward"):
            closure_loss = self.precision_plugin.post_backward(closure_loss, self._lm)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, with what ``on_before_optimizer_step`` logs gathered from every stage (the precision
        plugin calls that hook, then clips, after the closure)."""
        plugin = self.precision_plugin
        after = plugin._after_closure

        def gathered_after(model: Any, optimizer: Any) -> None:
            with self._gathered_logs("on_before_optimizer_step"):
                after(model, optimizer)

        with instance_attribute(plugin, "_after_closure", gathered_after):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _gathered_logs(self, hook: str) -> Any:
        """Where ``hook`` runs: its logs gathered from every stage of this rank's pipeline."""
        part = self._part
        if part is None:
            return gathered_logs(None, self._lm, hook)
        if self._gradient_logs is None or self._gradient_logs[0] is not part:
            steps = part.steps
            self._gradient_logs = (part, GradientLogs.of(steps.channel, steps.runner.placement, part.plan))
        trainer = self._lm.trainer
        overridden = _overrides(self._lm, pl.LightningModule, hook) or any(
            _overrides(c, pl.Callback, hook) for c in trainer.callbacks
        )
        return gathered_logs(self._gradient_logs[1], self._lm, hook, overridden)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """``clip_grad_norm_`` with the norm over every stage of the pipeline (tied parameters counted once)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert self._part is not None
        many = len(self._part.steps.runner.placement.pp_ranks) > 1
        clip_by_global_norm(params, clip_val, self._part.counted_elsewhere, self._part.pp_group if many else None)


def _overrides(obj: Any, base: type, hook: str) -> bool:
    """Whether ``obj`` (a module or callback) has its own ``hook``, not ``base``'s no-op."""
    return hook in vars(obj) or getattr(type(obj), hook, None) is not getattr(base, hook, None)
