"""``AutoPartitionStrategy``: Lightning hooks mapped onto the planner and the pipeline runtime."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.checkpoints import CHECKPOINT_MODES, CheckpointHooks, StageCheckpoints
from lightning_autopart.lightning.environments import check_launched_world, refuse_mpi_without_mpi4py
from lightning_autopart.lightning.faults import FaultGuard
from lightning_autopart.lightning.first_batch import (
    PlanSettings,
    first_batch,
    keep_local,
    loop_facts,
    loop_loader,
    optimizer_spec,
)
from lightning_autopart.lightning.input_checks import check_stages
from lightning_autopart.lightning.meta_init import MetaInit
from lightning_autopart.lightning.preemption import Preemption, SignalNames
from lightning_autopart.lightning.ragged import check_even_batches
from lightning_autopart.lightning.readout import StepReadout, watch_steps
from lightning_autopart.lightning.split import PARTITION_ATTRIBUTE, Partition, split_module
from lightning_autopart.lightning.step_hooks import StepHooks
from lightning_autopart.lightning.summary import summarize_whole_model
from lightning_autopart.plan import SCHEDULES, Plan
from lightning_autopart.profile.loader import generators_kept
from lightning_autopart.runtime.materialize import check_initialisable, has_meta_tensors
from lightning_autopart.runtime.runner import PipelineRunner, move_in_place

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AutoPartitionStrategy"]

#: The LightningModule step each loop runs (the partition of a fresh Trainer comes from it).
_STEP_HOOKS = {
    str(TrainerFn.FITTING): "training_step",
    str(TrainerFn.VALIDATING): "validation_step",
    str(TrainerFn.TESTING): "test_step",
    str(TrainerFn.PREDICTING): "predict_step",
}


class AutoPartitionStrategy(MetaInit, StepHooks, CheckpointHooks, ParallelStrategy):
    """Trains an unchanged LightningModule as a pipeline x data-parallel job planned from its first batch.

    Every stage of one pipeline sees the same batch: the data loader's batch is one pipeline's share, so the
    global batch is ``loader batch x replicas``. The plan is made in ``setup`` from the first training batch
    (rank 0 captures, profiles and partitions; every rank receives the plan), and the model that the
    training step calls first (``self(...)`` or a submodule such as ``self.model(...)``) is pipelined; the
    user's step then computes the loss per micro-batch on the last stage and its ``self.log`` calls are
    replayed on every rank.

    ``validate``, ``test`` and ``predict`` run forward-only on the same plan, after ``fit`` or on a fresh
    Trainer (which plans from that loop's first batch). Checkpoints hold every stage's model and optimizer
    state by the original parameter names (see ``checkpoint``), and resume under any plan. A model built on the
    meta device (``init_module(empty_init=True)``, ``configure_model``) is materialised stage by stage: each rank
    allocates and initialises only its own.

    Launch with ``python train.py`` (Lightning starts the other processes) or ``torchrun``; spawning from a
    notebook is refused. Only automatic optimization is supported; a smaller last batch (``drop_last=False``)
    is padded to the planned size and weighted by its real samples, unless BatchNorm trains on it (ragged.py).

    Args:
        num_stages: Pipeline stages (None: the planner decides).
        micro_batches: Micro-batches per replica per step (None: the planner decides); when it does not divide
            the batch, the largest divisor below it is used.
        schedule: "auto" or one of "GPipe", "1F1B", "Interleaved1F1B".
        device_memory: Memory of one device, in bytes or as "40GB" (None: the device's own).
        profile: "measure" (time the blocks here) or "estimate" (roofline).
        load_plan: Path of a plan to use instead of planning (checked against the model and world size).
        save_plan: Path where rank 0 writes the plan.
        accelerator: Set by the Trainer from its ``accelerator``; leave unset.
        parallel_devices: Set by the Trainer from its ``devices``; leave unset.
        cluster_environment: Set by the Trainer (torchrun, SLURM, ... detected, or its ``plugins``); leave unset.
        checkpoint_io: Set by the Trainer from its ``plugins``; leave unset.
        precision_plugin: Set by the Trainer from its ``precision``; leave unset.
        process_group_backend: "gloo" or "nccl" (None: by device).
        timeout: Timeout of collectives: the longest a rank waits for a frozen peer. A rank that raises or is
            killed stops every rank within seconds whatever the timeout ([Note: failing ranks], faults.py).
        checkpoint: "sharded" (every rank writes its stages into a ``torch.distributed.checkpoint`` directory;
            ``autopart consolidate`` makes it one file) or "full" (rank 0 writes one file plain Lightning loads).
        preempt_signals: Signals that stop a fit at the next step boundary, with a checkpoint, exit code 128 +
            signum (docs/guide.md, Pre-emption); ``()``: Lightning's handling.
        preempt_checkpoint: Its path (None: ``<default_root_dir>/preempted.ckpt``; SLURM auto-requeue: hpc_ckpt).
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
        checkpoint: str = "sharded",
        preempt_signals: SignalNames = ("SIGTERM",),
        preempt_checkpoint: str | None = None,
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
        if checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(f"unknown checkpoint {checkpoint!r}; use one of: {', '.join(CHECKPOINT_MODES)}")
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
        self.checkpoint = checkpoint
        self._preemption = Preemption(preempt_signals, preempt_checkpoint)
        self._faults = FaultGuard()  # [Note: failing ranks]
        self.num_nodes = 1
        self._hidden_example: Any = None
        self._part: Partition | None = None
        #: Rank 0's measured training step against the plan's, once a fit has run enough steps.
        self.step_readout: StepReadout | None = None
        self._params: list[nn.Parameter] = []
        self._stash: list[Tensor | None] = []
        self._checkpoints: StageCheckpoints | None = None
        self._init_rng: Tensor | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan every rank runs (set in ``setup``)."""
        return self._part.plan if self._part is not None else None

    @property
    def _runner(self) -> PipelineRunner | None:
        return self._part.steps.runner if self._part is not None else None

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
            refuse_mpi_without_mpi4py()
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        check_launched_world(self.cluster_environment, self.num_processes, self.num_nodes)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if not self.load_plan:  # before the rendezvous: every rank refuses alike, even with a peer missing
            check_stages(self.num_stages, self.world_size)
        self._process_group_backend = (
            self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        self._faults.arm(self.global_rank, self.world_size, self._timeout)

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
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        lm = self._lm
        self._checkpoints = StageCheckpoints(self.checkpoint, self.global_rank, self.world_size)
        self._checkpoints.record(lm, self.optimizers)
        # Plan and split where the model was built (the CPU, usually): only this rank's stage reaches the device.
        with generators_kept():  # the first batch, captures and profiles draw nothing training would see
            self._part = self._adopt(getattr(lm, PARTITION_ATTRIBUTE, None)) or self._partition(trainer)
        check_even_batches(trainer, _STEP_HOOKS.get(str(trainer.state.fn), "training_step"), self._part.plan.replicas)
        lm.__dict__[PARTITION_ATTRIBUTE] = self._part
        # Lightning's ModelSummary runs the whole model on example_input_array at on_fit_start, which this rank
        # can no longer do: hide the example until training starts (restored in on_train_start and teardown).
        if lm.example_input_array is not None:
            self._hidden_example = lm.example_input_array
            lm.example_input_array = None
        summarize_whole_model(trainer, self._hidden_example)  # the summary runs it on meta copies instead
        runner = self._part.steps.runner
        self._checkpoints.writes_model = runner.placement.replica == 0
        self._params = keep_local(
            lm, self._part.steps.root_name, runner.modules, self._part.in_blocks, self.optimizers, self.root_device
        )
        self.model_to_device()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            # Clipping by norm needs the norm over the whole model, not over this rank's stage.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
            self._part.steps.scale = self._loss_scale()
            self._preemption.setup(trainer, self.cluster_environment)  # [Note: pre-emption]
            self.step_readout = watch_steps(trainer, self._part.plan, self.root_device)  # [Note: step readout]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        move_in_place(self.model, self.root_device)  # other stages' tensors stay on the meta device

    def _adopt(self, part: Partition | None) -> Partition | None:
        """The module's existing partition (an earlier fit, validate... on it), if this job can run it."""
        if part is None:
            return None
        part.check_job(self.world_size, self.root_device)
        if self.load_plan or self.num_stages not in (None, part.plan.num_stages):
            rank_zero_info("autopart: the model is already split by an earlier run; reusing its plan")
        return part

    def _partition(self, trainer: pl.Trainer) -> Partition:
        """Plan from the running loop's first batch and build this rank's stages."""
        lm = self._lm
        on_meta = has_meta_tensors(lm)
        if on_meta:  # planned on meta, by estimate; each rank then initialises only its share
            check_initialisable(lm)
            if self.profile == "measure" and not self.load_plan:
                rank_zero_info("autopart: the model is on the meta device: profiling by estimate")
        init_rng = self._init_rng if self._init_rng is not None else torch.random.get_rng_state()
        hook = _STEP_HOOKS.get(str(trainer.state.fn), "training_step")
        home = next((p.device for p in lm.parameters()), torch.device("cpu"))
        loader = loop_loader(trainer, hook)
        batch = self.precision_plugin.convert_input(self.batch_to_device(first_batch(loader, hook), device=home))
        settings = PlanSettings(
            self.num_stages,
            self.micro_batches,
            self.schedule,
            self.device_memory,
            "estimate" if on_meta else self.profile,
            self.load_plan,
            self.save_plan,
            optimizer=optimizer_spec(self.optimizers, gpu=self.root_device.type == "cuda"),
            precision=str(getattr(self.precision_plugin, "precision", "32-true")),
            accumulate=trainer.accumulate_grad_batches,
            loader=loader if trainer.state.fn == TrainerFn.FITTING else None,
            loop=loop_facts(trainer, sigterm_broadcast=not self._preemption.takes_sigterm),
        )
        with self.precision_plugin.forward_context():  # capture sees what the model will see (bf16-true...)
            return split_module(
                lm,
                batch,
                hook,
                settings,
                fitting=trainer.state.fn == TrainerFn.FITTING,
                rank=self.global_rank,
                world_size=self.world_size,
                num_nodes=self.num_nodes,
                device=self.root_device,
                init_rng=init_rng,
            )

    def _restore_example(self) -> None:
        if self._hidden_example is not None and self.lightning_module is not None:
            self.lightning_module.example_input_array = self._hidden_example
        self._hidden_example = None

    @override
    def on_train_start(self) -> None:
        self._restore_example()
        super().on_train_start()

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        # Over this stage's replicas, as DDP over its ranks (see [Note: collectives] in step_hooks.py): logged
        # values are equal along a pipeline (replayed). One replica has nothing to reduce.
        group = self._collective_group(group)
        if isinstance(tensor, Tensor) and group is not None:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failed fit: report it to the other ranks (or say which rank failed first), abandon pending
        messages, abort the process groups, make sure this process exits ([Note: failing ranks], faults.py)."""
        super().on_exception(exception)
        self._faults.on_exception(exception, self._part)

    @override
    def teardown(self) -> None:
        """Lightning's teardown, moving only this rank's tensors to the CPU; the split stays on the module, so
        a later loop runs on it."""
        self._restore_example()
        if self._steps is not None:
            self._steps.channel.wait()
        self._stash = []
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            move_in_place(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
