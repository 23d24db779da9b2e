"""``AutoPartitionStrategy``: Lightning hooks mapped onto the planner and the pipeline runtime."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.first_batch import (
    PlanSettings,
    capture_for_plan,
    gather_state_dict,
    keep_local,
    optimizer_kind,
    plan_for_batch,
)
from lightning_autopart.lightning.hooks import batch_size_of, find_forward, step_loss
from lightning_autopart.lightning.log_channel import open_log_channel
from lightning_autopart.lightning.steps import PipelinedSteps
from lightning_autopart.plan import SCHEDULES, Plan
from lightning_autopart.runtime.gradients import agree_on_overflow, clip_by_global_norm
from lightning_autopart.runtime.runner import PipelineRunner
from lightning_autopart.runtime.topology import build_groups

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AutoPartitionStrategy"]


class AutoPartitionStrategy(ParallelStrategy):
    """Trains an unchanged LightningModule as a pipeline x data-parallel job planned from its first batch.

    Every stage of one pipeline sees the same batch: the data loader's batch is one pipeline's share, so the
    global batch is ``loader batch x replicas``. The plan is made in ``setup`` from the first training batch
    (rank 0 captures, profiles and partitions; every rank receives the plan), and the model that the
    training step calls first (``self(...)`` or a submodule such as ``self.model(...)``) is pipelined; the
    user's step then computes the loss per micro-batch on the last stage and its ``self.log`` calls are
    replayed on every rank.

    Launch with ``python train.py`` (Lightning starts the other processes) or ``torchrun``; spawning from a
    notebook is refused. Only automatic optimization is supported; every batch must have the planned size
    (``drop_last=True``), validation included; checkpoints hold the whole model (gathered on rank 0) but
    resuming one is not supported yet.

    Args:
        num_stages: Pipeline stages (None: the planner decides).
        micro_batches: Micro-batches per replica per step (None: the planner decides); when it does not divide
            the batch, the largest divisor below it is used.
        schedule: "auto" or one of "GPipe", "1F1B", "Interleaved1F1B".
        device_memory: Memory of one device, in bytes or as "40GB" (None: the device's own).
        profile: "measure" (time the blocks here) or "estimate" (roofline).
        load_plan: Path of a plan to use instead of planning (checked against the model and world size).
        save_plan: Path where rank 0 writes the plan.
        process_group_backend: "gloo" or "nccl" (None: by device).
        timeout: Timeout of collectives; a failing rank makes the others exit after it.
    """

    strategy_name = "autopart"
    is_distributed = True  # sync_dist and the DistributedSampler need it (see lightning_strategy.md)

    def __init__(
        self,
        num_stages: int | None = None,
        micro_batches: int | None = None,
        schedule: str = "auto",
        device_memory: int | str | None = None,
        profile: str = "measure",
        load_plan: str | None = None,
        save_plan: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if schedule != "auto" and schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {schedule!r}; use 'auto' or one of: {', '.join(SCHEDULES)}")
        if profile not in ("measure", "estimate"):
            raise ConfigError(f"unknown profile mode {profile!r}; use 'measure' or 'estimate'")
        for name, value in (("num_stages", num_stages), ("micro_batches", micro_batches)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        self.num_stages = num_stages
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.device_memory = device_memory
        self.profile = profile
        self.load_plan = load_plan
        self.save_plan = save_plan
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        #: The plan every rank runs (set in ``setup`` when fitting).
        self.plan: Plan | None = None
        self._hidden_example: Any = None
        self._steps: PipelinedSteps | None = None
        self._pp_group: dist.ProcessGroup | None = None
        self._params: list[nn.Parameter] = []
        self._stash: list[Tensor | None] = []
        self._counted_elsewhere: set[int] = set()

    @property
    def _runner(self) -> PipelineRunner | None:
        return self._steps.runner if self._steps is not None else None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"autopart"`` (once)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Automatic pipeline x data-parallel partitioning"
            )

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def _lm(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None, "the strategy has no LightningModule yet"
        return module

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        """The backend of the default process group."""
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.plan is None or self._runner is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": self.plan.replicas, "rank": self._runner.placement.replica}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            if _IS_INTERACTIVE and self.num_processes > 1:
                raise ConfigError(
                    "AutoPartitionStrategy cannot start processes from an interactive session: spawn-style "
                    "launching would return only one stage's weights. Run a script (python train.py) or torchrun"
                )
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )

    def set_world_ranks(self) -> None:
        """Ranks and world size from the cluster environment (as DDP does)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        if not self._lm.automatic_optimization:
            raise ConfigError(
                "AutoPartitionStrategy does not support manual optimization (automatic_optimization=False) yet; "
                "use automatic optimization, or the 'ddp' strategy"
            )
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if trainer.state.fn != TrainerFn.FITTING:
            self.model_to_device()
            self.setup_precision_plugin()
            return
        self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Plan and split where the model was built (the CPU, usually): only this rank's stage reaches the device.
        self._partition(trainer)
        self.model_to_device()
        _optimizers_to_device(self.optimizers, self.root_device)
        # Clipping by norm needs the norm over the whole model, not over this rank's stage.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _partition(self, trainer: pl.Trainer) -> None:
        """Plan from the first training batch, build this rank's stage and keep the optimizers to its parameters."""
        lm = self._lm
        home = next((p.device for p in lm.parameters()), torch.device("cpu"))
        batch = self.batch_to_device(next(iter(trainer.fit_loop._data_source.dataloader())), device=home)
        call = find_forward(lm, lambda: lm.training_step(batch, 0))
        root = lm.get_submodule(call.name) if call.name else lm
        size = batch_size_of(batch)
        settings = PlanSettings(
            self.num_stages,
            self.micro_batches,
            self.schedule,
            self.device_memory,
            self.profile,
            self.load_plan,
            self.save_plan,
            optimizer=optimizer_kind(self.optimizers),
            precision=str(getattr(self.precision_plugin, "precision", "32-true")),
        )
        plan = plan_for_batch(
            settings,
            root,
            call,
            size,
            rank=self.global_rank,
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            device=self.root_device,
            loss=step_loss(lm, call.name, batch, size),
        )
        self.plan = plan
        captured, tied, counted_elsewhere, in_blocks = capture_for_plan(plan, root, call, size, self.global_rank)
        self._counted_elsewhere = counted_elsewhere
        groups = build_groups(plan, tied, self.root_device.type)
        runner = PipelineRunner(plan, captured, self.global_rank, self.root_device, tied=tied, groups=groups)
        self._params = keep_local(lm, call.name, runner.modules, in_blocks, self.optimizers, self.root_device)
        channel = open_log_channel(plan, self.global_rank, self.root_device)
        self._steps = PipelinedSteps(lm, call.name, runner, channel, self.root_device, captured.constant_inputs)
        self._steps.scale = self._loss_scale()
        self._pp_group = groups[tuple(sorted(runner.placement.pp_ranks))]
        # Lightning's ModelSummary runs the whole model on example_input_array at on_fit_start, which this rank
        # can no longer do: hide the example until training starts (restored in on_train_start and teardown).
        self._hidden_example = lm.example_input_array
        lm.example_input_array = None

    def _restore_example(self) -> None:
        if self._hidden_example is not None and self.lightning_module is not None:
            self.lightning_module.example_input_array = self._hidden_example
        self._hidden_example = None

    @override
    def on_train_start(self) -> None:
        self._restore_example()
        super().on_train_start()

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

    @override
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

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        if self._steps is None:
            raise ConfigError(
                f"AutoPartitionStrategy runs {hook} only during fit, after the model is partitioned"
            )
        with self.precision_plugin.val_step_context():
            return self._steps.evaluate(hook, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """No autograd here (the pipeline ran it); fire the hooks and hand the gradients back."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._lm)
        for p, g in zip(self._params, self._stash, strict=False):
            p.grad = g
        self._stash = []  # the parameters hold them now: kept here, they would outlive zero_grad
        closure_loss = self.precision_plugin.post_backward(closure_loss, self._lm)
        self.post_backward(closure_loss)
        return closure_loss

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """``clip_grad_norm_`` with the norm over every stage of the pipeline (tied parameters counted once)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        many = self._runner is not None and len(self._runner.placement.pp_ranks) > 1
        clip_by_global_norm(params, clip_val, self._counted_elsewhere, self._pp_group if many else None)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state on rank 0: each stage's tensors gathered from the first replica."""
        state = self._lm.state_dict()
        if self._runner is None or not _distributed_is_initialized() or self.world_size == 1:
            return state
        assert self._steps is not None
        prefix = f"{self._steps.root_name}." if self._steps.root_name else ""
        modules = self._runner.modules.values() if self._runner.placement.replica == 0 else ()
        return gather_state_dict(state, modules, prefix, self.global_rank, self.world_size)

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        # Logged values are equal along a pipeline (replayed), so a WORLD mean is the data-parallel mean. One
        # process has nothing to reduce (and plain Lightning's single device skips the collective too).
        if isinstance(tensor, Tensor) and self.world_size > 1:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        self._restore_example()
        if self._steps is not None:
            self._steps.channel.wait()
        self._steps = None
        self._stash = []
        super().teardown()
