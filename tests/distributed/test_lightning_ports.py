"""Lightning's own strategy tests (DDP, FSDP, ModelParallel, DeepSpeed), ported to autopart: the same calls,
on gloo CPU ranks with a 2-stage plan, compared with one plain process or plain DDP (see docs/testing.md).

Two launches of ``_ports_script.py``: 2 stages x 1 replica with Lightning's launcher (each action compared with
the same action on one plain process, run here), whose last action runs plain DDP on the 2 processes; and
2 stages x 2 replicas under torchrun, compared with that DDP run rank by replica. The checks that need no
process group of several ranks run in this process.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch.utils.data import DataLoader

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.launch import run_job, side_by_side
from tests.distributed.ports_cases import TRAIN_BATCHES, PortLit, run_action
from tests.distributed.strategy_cases import LOCAL_BATCH, Lit, dataset

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_ports_script.py")
#: What the metrics, sync_dist and all_gather actions log and check.
LOGS = {"metrics": True, "sync": True, "gather": True}

#: (launcher, processes, actions). Every autopart action runs 2 stages (replicas: processes // 2).
LAUNCHES: list[tuple[str, int, list[dict[str, Any]]]] = [
    (
        "lightning",
        2,
        [
            # test_ddp_integration fit/test, test_common.test_evaluate, loops (limit_*, val_check_interval,
            # num_sanity_val_steps), log_dict of tensors and of a MetricCollection, sync_dist, all_gather, and
            # the strategy's collectives and data-parallel view
            {
                "cfg": LOGS,
                "trainer": {"limit_train_batches": 3, "val_check_interval": 2, "num_sanity_val_steps": 1},
                "evaluate": True,
                "probe": True,
            },
            # test_deepspeed accumulated_grad_batches + gradient_clip_by_value, scheduler_step_count (epoch),
            # check_val_every_n_epoch
            {
                "cfg": {"scheduler": "epoch"},
                "trainer": {
                    "accumulate_grad_batches": 2,
                    "gradient_clip_val": 0.01,
                    "gradient_clip_algorithm": "value",
                    "check_val_every_n_epoch": 2,
                }
            },
            # accumulation with clipping by norm (over both stages) in configure_gradient_clipping
            # (test_deepspeed_configure_gradient_clipping), a scheduler stepped every step
            {"cfg": {"clip": 0.05, "scheduler": "step"}, "trainer": {"accumulate_grad_batches": 2, "max_epochs": 1}},
            {"trainer": {"fast_dev_run": 2}},
            {"cfg": {"skip_from": 2}},  # on_train_batch_start returns -1
            {"cfg": {"stop_at": 1}},  # trainer.should_stop set in training_step, after the model call
            # trainer.fit twice on one Trainer, then global_step/current_epoch after resuming from its checkpoint
            {"twice": True, "resume": "T.ckpt"},
            # the reference of the next launch: plain DDP on 2 processes
            {"plain": True, "cfg": LOGS, "probe": True},
        ],
    ),
    ("torchrun", 4, [{"cfg": LOGS, "probe": True, "schedule": "1F1B"}]),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, Any]]:
    """Every launch's results by rank and action (two launches at a time, each in its own folder)."""

    def launch(i: int, out: Path) -> dict[int, Any]:
        how, world, actions = LAUNCHES[i]
        (out / f"actions{i}.json").write_text(json.dumps(actions))
        code, log = run_job([str(SCRIPT), str(out / f"actions{i}.json"), str(out), str(world)], world, how, 240)
        assert code == 0, f"launch {i} ({how}, {world}) failed ({code}):\n{log[-6000:]}"
        return {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)}

    outs = [tmp_path_factory.mktemp(f"ports{i}") for i in range(len(LAUNCHES))]
    return side_by_side([partial(launch, i, out) for i, out in enumerate(outs)])


def _close(a: Any, b: Any, rel: float = 1e-5) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _differences(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    keys = set(got) | set(want)
    return {k: (got.get(k), want.get(k)) for k in sorted(keys) if k not in got or not _close(got[k], want.get(k))}


def _same(got: Any, want: Any) -> bool:
    """Equal values: dicts of logged numbers within tolerance, anything else exactly."""
    if isinstance(got, dict) and isinstance(want, dict):
        return not _differences(got, want)
    return _close(got, want)


def _same_views(got: dict[str, Any], want: dict[str, Any], who: str) -> None:
    """What a rank saw (steps, validations, the end) equals the reference's; its parameters are the reference's."""
    assert (got["global_step"], got["epoch"]) == (want["global_step"], want["epoch"]), who
    assert len(got["steps"]) == len(want["steps"]), f"{who}: {len(got['steps'])} steps, {len(want['steps'])}"
    for i, (seen, ref) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        assert not _differences(seen, ref), f"{who}, batch {i}: {_differences(seen, ref)}"
    assert len(got["validations"]) == len(want["validations"]), who
    for i, (seen, ref) in enumerate(zip(got["validations"], want["validations"], strict=True)):
        assert not _differences(seen, ref), f"{who}, validation {i}: {_differences(seen, ref)}"
    assert not _differences(got["final"], want["final"]), f"{who}: {_differences(got['final'], want['final'])}"
    assert got["params"], f"{who} holds no parameter"
    for name, value in got["params"].items():
        torch.testing.assert_close(value, want["params"][name], rtol=1e-5, atol=1e-7, msg=f"{who}: {name}")


def _references(tmp_path: Path, indices: list[int]) -> dict[int, dict[str, Any]]:
    _, _, actions = LAUNCHES[0]
    return {i: run_action(actions[i], lambda: "auto", 1, 1, tmp_path) for i in indices}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The first launch's autopart actions on one plain process."""
    _, _, actions = LAUNCHES[0]
    return _references(tmp_path_factory.mktemp("reference"), [i for i, a in enumerate(actions) if not a.get("plain")])


#: Test ids of the first launch's autopart actions.
ACTION_IDS = [
    "loops-logs-evaluate",
    "accumulate-clip-value",
    "accumulate-clip-norm",
    "fast-dev-run",
    "train-batch-start-minus-1",
    "should-stop",
    "fit-twice-resume",
]


@pytest.mark.parametrize("index", range(len(ACTION_IDS)), ids=ACTION_IDS)
def test_two_stages_equal_one_process(launched: list[dict[int, Any]], reference: dict[int, Any], index: int) -> None:
    want = reference[index]
    for rank, results in launched[0].items():
        got = results[index]
        _same_views(got, want, f"rank {rank}")
        assert got["torn_down"], f"rank {rank}: a tensor is left off the CPU, or gradients stashed"
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9), f"rank {rank}: learning rate"
        for key in ("sanity_batches", "first_fit", "validate", "test", "unchanged"):
            assert _same(got.get(key), want.get(key)), f"rank {rank}: {key} {got.get(key)} vs {want.get(key)}"
        if "resumed" in want:
            resumed, ref = got["resumed"], want["resumed"]
            assert resumed["starts"] == ref["starts"] and resumed["global_step"] == ref["global_step"], rank
            assert resumed["epoch"] == ref["epoch"] and len(resumed["steps"]) == len(ref["steps"]), rank
            for seen, expected in zip(resumed["steps"], ref["steps"], strict=True):
                assert not _differences(seen, expected), f"rank {rank}: {_differences(seen, expected)}"
        # all_gather outside a step: one replica gives its own value back, as LightningModule.all_gather documents
        assert len(got["gathered"]) == (2 if index == 0 else 0), rank
        for i, tensor in enumerate(got["gathered"]):
            assert torch.equal(tensor, torch.zeros(())), f"rank {rank}, epoch {i}: {tensor}"


def test_the_loops_ran_as_configured(reference: dict[int, Any]) -> None:
    """The reference itself: the settings did what Lightning's tests expect (so equality above means something)."""
    main, value, norm, fast, skip, stop, twice = (reference[i] for i in range(7))
    assert main["global_step"] == 2 * 3 and main["sanity_batches"] == 1 and len(main["validations"]) == 3
    assert main["unchanged"] and {"val_acc", "val_prec", "val_rec", "train_acc_epoch", "out_mean_epoch"} <= set(
        main["final"]
    )
    assert value["global_step"] == 2 * TRAIN_BATCHES // 2 and len(value["validations"]) == 1
    assert value["lr"] == pytest.approx(0.1 * 0.7**2) and norm["lr"] == pytest.approx(0.1 * 0.7 ** (TRAIN_BATCHES // 2))
    assert norm["global_step"] == TRAIN_BATCHES // 2
    # The clipping thresholds bite: gradients above them before clipping.
    assert min(big for _, big in value["largest_grads"]) > 0.01 and min(n for n, _ in norm["largest_grads"]) > 0.05
    assert fast["global_step"] == 2 and len(fast["validations"]) == 1
    assert skip["global_step"] == 2 * 2 and stop["global_step"] == 2
    assert twice["first_fit"] == (TRAIN_BATCHES, 1) and twice["global_step"] == 2 * TRAIN_BATCHES
    assert twice["resumed"]["starts"] == [(2 * TRAIN_BATCHES, 2)] and twice["resumed"]["global_step"] == 12


def test_strategy_view_and_collectives_two_stages(launched: list[dict[int, Any]]) -> None:
    """test_ddp_cpu, test_ddp_configure_ddp, test_ddp_process_group_backend, test_ddp_torch_dist_is_available_in_
    setup: the module is not wrapped, lives on the CPU, gloo is the backend and is up in the setup hook; one
    replica: Lightning's collectives as DDP on one process."""
    for rank, results in launched[0].items():
        got = results[0]
        assert got["seen"] == {
            "strategy_model_is_module": True,
            "trainer_model_is_module": True,
            "device": "cpu",
            "root_device": "cpu",
            "distributed_in_setup": True,
        }, rank
        probe = got["probe"]
        assert probe["sampler"] == {"num_replicas": 1, "rank": 0}
        assert probe["backend"] == probe["process_group_backend"] == "gloo"
        assert probe["broadcast0"] == {"from": 0, "replica": 0} and probe["broadcast_last"] == 1
        assert probe["reduce"] == {"sum": 1.0, "mean": 1.0, "max": 1.0, "min": 1.0}, rank
        assert probe["all"] is True and probe["any"] is True
        assert torch.equal(probe["all_gather"], torch.zeros(1))


def test_two_stages_two_replicas_equal_ddp(launched: list[dict[int, Any]]) -> None:
    """sync_dist (mean, sum, max, min), log_dict of tensors and of a MetricCollection, all_gather in and outside a
    step, and the parameters, on every rank of 2 stages x 2 replicas as on DDP's rank of the same replica;
    gradients agree between the replicas of a stage (test_ddp_gradients_synced)."""
    ddp = {r: launched[0][r][7] for r in (0, 1)}
    for rank in ddp.values():
        assert [t.tolist() for t in rank["gathered"]] == [[0.0, 1.0]] * 2
    by_stage: dict[frozenset[str], list[list[float]]] = {}
    for rank, results in launched[1].items():
        got = results[0]
        replica = got["probe"]["sampler"]["rank"]
        want = ddp[replica]
        _same_views(got, want, f"rank {rank} (replica {replica})")
        assert [torch.equal(t, w) for t, w in zip(got["gathered"], want["gathered"], strict=True)] == [True, True]
        assert got["probe"]["sampler"] == {"num_replicas": 2, "rank": replica}
        for key in ("reduce", "all", "any"):
            assert got["probe"][key] == want["probe"][key], f"rank {rank}: {key}"
        assert torch.equal(got["probe"]["all_gather"], want["probe"]["all_gather"]), rank
        by_stage.setdefault(frozenset(got["params"]), []).append(got["grad_sums"])
    assert len(by_stage) == 2
    for sums in by_stage.values():
        first, second = sums
        assert first == pytest.approx(second, rel=1e-6)


# In one process: the Trainer's connectors and the strategy's settings.


def test_trainer_connects_autopart_by_name() -> None:
    """test_ddp_cpu / test_ddp_kwargs_from_registry: the registered name gives the strategy, CPU devices and
    Lightning's script launcher."""
    trainer = L.Trainer(strategy="autopart", accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, AutoPartitionStrategy) and StrategyRegistry["autopart"]["strategy"] is AutoPartitionStrategy
    assert isinstance(strategy.accelerator, CPUAccelerator) and trainer.num_devices == 2
    assert strategy.parallel_devices == [torch.device("cpu")] * 2 and strategy.root_device == torch.device("cpu")
    assert isinstance(strategy.cluster_environment, LightningEnvironment)
    assert isinstance(strategy.launcher, _SubprocessScriptLauncher)
    # Before setup: one replica per process (nothing is planned yet).
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_custom_registered_strategy_to_strategy_flag() -> None:
    """test_registry: a name registered with init parameters (and a CheckpointIO) gives a configured strategy."""

    class Custom(CheckpointIO):
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None: ...

        def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return {}

        def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None: ...

    io = Custom()
    name = "autopart_two_stages_custom_io"
    if name not in StrategyRegistry:
        StrategyRegistry.register(name, AutoPartitionStrategy, num_stages=2, schedule="1F1B", checkpoint_io=io)
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, AutoPartitionStrategy)
    assert (trainer.strategy.num_stages, trainer.strategy.schedule) == (2, "1F1B")
    assert trainer.strategy.checkpoint_io is io


@pytest.mark.parametrize(("backend", "expected"), [(None, "gloo"), ("gloo", "gloo"), ("foo", "foo")])
def test_process_group_backend_and_timeout(backend: str | None, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """test_ddp_process_group_backend, test_set_timeout, test_device_id_passed_for_cuda_devices_pytorch: the
    backend (gloo on the CPU by default) and timeout reach init_process_group, with no device id on the CPU."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    timeout = timedelta(seconds=30)
    strategy = AutoPartitionStrategy(process_group_backend=backend, timeout=timeout)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    trainer.strategy.connect(PortLit({}))
    with mock.patch("torch.distributed.init_process_group") as init:
        trainer.strategy.setup_environment()
    init.assert_called_once_with(expected, rank=0, world_size=1, timeout=timeout, device_id=None)
    assert strategy.process_group_backend == expected


def test_incorrect_script_spawning(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_incorrect_ddp_script_spawning: a process with LOCAL_RANK > 0 never starts more processes."""

    class Wrong(LightningEnvironment):
        @property
        def creates_processes_externally(self) -> bool:
            return False

    monkeypatch.setenv("LOCAL_RANK", "1")
    trainer = L.Trainer(strategy="autopart", accelerator="cpu", devices=2, plugins=[Wrong()], barebones=True)
    with pytest.raises(RuntimeError, match=r"attempted to launch new distributed processes with `local_rank > 0`"):
        trainer.fit(Lit("mlp"), DataLoader(dataset("mlp", 8), batch_size=LOCAL_BATCH))


def test_save_checkpoint_storage_options(tmp_path: Path) -> None:
    """test_fsdp/test_model_parallel test_save_checkpoint_storage_options: refused, naming the fix."""
    with pytest.raises(ConfigError, match="takes no storage_options"):
        AutoPartitionStrategy().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


def test_sync_batchnorm_is_refused() -> None:
    """test_fsdp.test_strategy_sync_batchnorm: Lightning would leave the plugin unused under autopart; refused
    when the Trainer is made, naming the fix."""
    with pytest.raises(ConfigError, match=r"sync_batchnorm=True\) .* drop sync_batchnorm"):
        L.Trainer(strategy="autopart", accelerator="cpu", devices=2, sync_batchnorm=True, logger=False)


class _NoLoss(Lit):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("master_port")
def test_training_step_without_a_loss_is_refused() -> None:
    """test_deepspeed_skip_backward_raises: a training_step returning None (skip the step) is refused by name."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AutoPartitionStrategy(num_stages=1, profile="estimate"),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ConfigError, match=r"training_step must return the loss"):
        trainer.fit(_NoLoss("mlp"), DataLoader(dataset("mlp", 8), batch_size=LOCAL_BATCH))


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_save_checkpoint_path_exists(mode: str, tmp_path: Path) -> None:
    """test_fsdp/test_model_parallel test_save_checkpoint_path_exists: a file or a checkpoint at the path is
    replaced; a directory that is not a checkpoint is refused, not deleted."""
    from lightning_autopart.errors import CheckpointError
    from lightning_autopart.lightning.checkpoints import StageCheckpoints
    from lightning_autopart.runtime.checkpoint import load_sharded

    checkpoints = StageCheckpoints(mode, 0, 1)
    state = {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "epoch": 3}

    def read(path: Path) -> dict[str, Any]:
        loaded: dict[str, Any] = load_sharded(path) if path.is_dir() else torch.load(path, weights_only=True)
        return loaded

    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is a directory that is not a checkpoint"):
        checkpoints.save(state, folder, torch.save)
    assert (folder / "notes.txt").read_text() == "mine"
    for existing in ("file", "checkpoint", "empty"):
        path = tmp_path / f"{existing}.ckpt"
        if existing == "file":
            path.write_text("old")
        elif existing == "checkpoint":
            StageCheckpoints("sharded", 0, 1).save({**state, "epoch": 1}, path, torch.save)
        else:
            path.mkdir()
        checkpoints.save(state, path, torch.save)
        assert (path.is_dir()) == (mode == "sharded"), existing
        saved = read(path)
        assert saved["epoch"] == 3 and torch.equal(saved["state_dict"]["w"], torch.ones(2)), existing
