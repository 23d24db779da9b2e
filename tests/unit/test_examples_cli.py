"""The examples under LightningCLI, in this process: each trains from its config, and the configs show the strategy."""

from __future__ import annotations

import importlib
import inspect
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import docstring_parser
import pytest

from examples.common import CONFIGS, default_devices
from lightning_autopart import AutoPartitionStrategy

#: example module -> the overrides that make its config tiny (one process: a pipeline of one stage).
TINY: dict[str, list[str]] = {
    "tutorial": ["--model.hidden", "16", "--model.layers", "3", "--model.batch_size", "4"],
    "gpt": ["--trainer.strategy.num_stages", "1", "--trainer.strategy.schedule", "auto", "--model.n_layers", "1"],
    "resnet": ["--model.batch_size", "4", "--model.num_samples", "16", "--model.image_size", "16"],
    "mlp": ["--trainer.strategy.num_stages", "1", "--model.widths", "[8, 32, 4]", "--model.batch_size", "4"],
    "image_classifier": ["--data.batch_size", "4", "--data.num_samples", "16"],
    "hf_causal_lm": [
        "--trainer.strategy.num_stages", "1", "--model.num_layers", "1", "--data.seq_len", "16",
        "--data.num_samples", "16", "--trainer.val_check_interval", "2",
    ],
}  # fmt: skip

#: Every argument of the strategy's __init__.
STRATEGY_ARGS = [name for name in inspect.signature(AutoPartitionStrategy).parameters]


def _main(name: str) -> Callable[[list[str]], None]:
    if name == "hf_causal_lm":
        pytest.importorskip("transformers")
    return importlib.import_module(f"examples.{name}").main  # type: ignore[no-any-return]


@pytest.fixture
def one_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command line with no arguments, as LightningCLI expects when it gets ``args``."""
    monkeypatch.setattr(sys, "argv", ["example"])


def test_every_config_belongs_to_an_example_tested_here() -> None:
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(TINY)
    assert all((CONFIGS.parent / f"{name}.py").is_file() for name in TINY)


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.usefixtures("master_port", "one_argv")
def test_example_trains_from_its_config_with_autopart(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main = _main(name)
    tiny = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1"]
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    where = ["--trainer.devices", "1", "--trainer.accelerator", "cpu"]
    config = ["--config", str(CONFIGS / f"{name}.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    main(["fit", *config, *TINY[name], *tiny, *quiet, *where])
    out = capsys.readouterr().out
    assert "Plan for" in out and "1 stage × 1 replica" in out
    found = re.search(r"trained 2 steps, final train_loss=(\S+)", out)
    assert found is not None, out[-2000:]
    assert math.isfinite(float(found.group(1)))
    saved = next(tmp_path.glob("lightning_logs/version_*/config.yaml")).read_text()
    assert "autopart" in saved or "AutoPartitionStrategy" in saved


@pytest.mark.usefixtures("one_argv")
def test_print_config_shows_every_strategy_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main = _main("gpt")
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--print_config"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert "class_path: lightning_autopart.AutoPartitionStrategy" in printed
    assert "num_stages: 2" in printed and "schedule: 1F1B" in printed
    for arg in STRATEGY_ARGS:
        assert re.search(rf"^      {arg}:", printed, re.MULTILINE), arg
    # The printed config runs as it is: every value reads back the same (timeout, signal names...).
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(printed)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(dumped), "--print_config"])
    assert capsys.readouterr().out == printed


@pytest.mark.usefixtures("one_argv")
def test_strategy_help_gives_each_argument_its_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    docstring = docstring_parser.parse(AutoPartitionStrategy.__doc__ or "")
    documented = {p.arg_name: p.description for p in docstring.params}
    assert set(documented) == set(STRATEGY_ARGS)  # jsonargparse shows only what the docstring documents
    with pytest.raises(SystemExit):
        _main("gpt")(["fit", "--trainer.strategy.help", "lightning_autopart.AutoPartitionStrategy"])
    shown = " ".join(capsys.readouterr().out.split())
    for arg, description in documented.items():
        assert f"--trainer.strategy.{arg}" in shown
        assert " ".join((description or "").split()[:6]) in shown, arg


@pytest.mark.usefixtures("one_argv")
def test_print_config_comments_carry_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ruamel.yaml", reason="--print_config=comments needs jsonargparse[ruamel]")
    with pytest.raises(SystemExit):
        _main("gpt")(["fit", "--print_config=comments"])
    printed = capsys.readouterr().out
    assert "# Pipeline stages (None: the planner decides)." in printed
    assert re.search(r"# Memory of one device, in bytes or as \"40GB\".*\n\s+device_memory:", printed)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, (4, 2)),  # torchrun --nnodes=2 --nproc_per_node=4
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"}, (2, 1)),  # mpirun -np 2
        ({"MPI_LOCALNRANKS": "8", "PMI_SIZE": "32"}, (8, 4)),  # MPICH's mpiexec
        ({"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train"}, (8, 2)),  # srun
        (
            {"SLURM_NTASKS": "3", "SLURM_NTASKS_PER_NODE": "3", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "x"},
            (3, 1),
        ),
        ({}, (2, 1)),  # Lightning's launcher on a CPU machine: 2 processes
    ],
)
def test_default_devices_follow_the_launcher(
    env: dict[str, str], expected: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert default_devices() == expected
