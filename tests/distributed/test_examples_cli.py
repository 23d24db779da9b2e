"""The examples launched as users launch them: LightningCLI configs on 2 CPU processes (the strategy named by string
and by class path), a Hugging Face model pipelined over 2 ranks, the tutorial run as a file with the RaNNC
tutorial's arguments, and a LightningCLI script that never imports lightning_autopart. The launches are
independent, so they run two at a time (``side_by_side``), the Hugging Face one beside the others."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launch import ROOT, run_job, side_by_side

pytestmark = pytest.mark.distributed

#: Shorter runs: no progress bar or model summary in the output.
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def _finished(out: str) -> tuple[int, float]:
    """The steps trained and the final training loss that rank 0 printed."""
    found = re.search(r"trained (\d+) steps, final train_loss=(\S+)", out)
    assert found is not None, out[-3000:]
    return int(found.group(1)), float(found.group(2))


def _by_string(tmp_path: Path) -> list[tuple[int, str]]:
    # examples/configs/tutorial.yaml: `strategy: autopart`; Lightning's launcher starts the second process.
    args = ["-m", "examples.tutorial", "fit", "--config", "examples/configs/tutorial.yaml", *QUIET]
    args += ["--model.hidden", "64", "--model.layers", "4", "--model.batch_size", "16"]
    args += ["--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path)]
    return [run_job(args, world=2, timeout=240)]


def _by_class_path(tmp_path: Path) -> list[tuple[int, str]]:
    # examples/configs/gpt.yaml: class_path + init_args (2 stages, 1F1B, 4 micro-batches); the tied embedding and
    # head sit on different stages. devices comes from torchrun's environment (LOCAL_WORLD_SIZE).
    args = ["-m", "examples.gpt", "fit", "--config", "examples/configs/gpt.yaml", *QUIET]
    args += ["--model.n_layers", "2", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2"]
    args += ["--trainer.default_root_dir", str(tmp_path)]
    return [run_job(args, world=2, how="torchrun", timeout=240)]


def _hugging_face(tmp_path: Path) -> list[tuple[int, str]]:
    args = ["-m", "examples.hf_causal_lm", "fit", "--config", "examples/configs/hf_causal_lm.yaml", *QUIET]
    args += ["--trainer.max_steps", "6", "--trainer.val_check_interval", "3"]
    return [run_job([*args, "--trainer.default_root_dir", str(tmp_path)], world=2, timeout=240)]


def _as_a_file(tmp_path: Path) -> list[tuple[int, str]]:
    # `python examples/tutorial.py 64 512 10`, as the RaNNC tutorial (and mpirun) runs it: no -m, no PYTHONPATH,
    # from another directory.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_RANK", "WORLD_SIZE")}
    command = [sys.executable, str(ROOT / "examples" / "tutorial.py"), "16", "64", "4", "--max-steps", "3"]
    done = subprocess.run(
        [*command, "--devices", "1"], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    return [(done.returncode, done.stdout + done.stderr)]


SCRIPT = """
import sys
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

LightningCLI(BoringModel)
print("trained", "lightning_autopart" in sys.modules)
"""


def _without_the_import(tmp_path: Path) -> list[tuple[int, str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base = [str(script), "fit", *QUIET, "--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    base += ["--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path)]
    by_name = run_job([*base, "--trainer.strategy", "autopart"], world=1, timeout=120)
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_autopart.AutoPartitionStrategy\n"
        "    init_args:\n      profile: estimate\n"
    )
    return [by_name, run_job([*base, "--config", str(config)], world=1, timeout=120)]


#: Every launch of this module, by name; independent of each other, so they run two at a time.
JOBS: dict[str, Callable[[Path], list[tuple[int, str]]]] = {
    "by_string": _by_string,
    "by_class_path": _by_class_path,
    "hugging_face": _hugging_face,
    "as_a_file": _as_a_file,
    "without_the_import": _without_the_import,
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[tuple[int, str]], Path]]:
    """Each job's launches (exit code, output) and its folder, the jobs run side by side."""
    names = [n for n in JOBS if n != "hugging_face" or importlib.util.find_spec("transformers")]
    folders = {name: tmp_path_factory.mktemp(name) for name in names}
    jobs = [functools.partial(JOBS[name], folders[name]) for name in names]
    longest = names.index("hugging_face") if "hugging_face" in names else 0
    runs = side_by_side(jobs, longest=longest)
    return {name: (run, folders[name]) for name, run in zip(names, runs, strict=True)}


def test_config_naming_the_strategy_by_string_trains_on_two_processes(launched: Any) -> None:
    [(code, out)], tmp_path = launched["by_string"]
    assert code == 0, out[-3000:]
    assert "Plan for Net (16,640 parameters" in out and "on 2 ranks" in out
    steps, loss = _finished(out)
    assert steps == 4 and math.isfinite(loss)
    saved = next(tmp_path.glob("lightning_logs/version_*/config.yaml")).read_text()
    assert re.search(r"^  strategy: autopart$", saved, re.MULTILINE)


def test_config_naming_the_strategy_by_class_path_pipelines_under_torchrun(launched: Any) -> None:
    [(code, out)], _ = launched["by_class_path"]
    assert code == 0, out[-3000:]
    assert "Plan for GPT" in out and "1F1B: 2 stages × 1 replica on 2 ranks" in out
    assert "Batch        8 = 4 micro-batches × 2 samples × 1 replica" in out
    steps, loss = _finished(out)
    assert steps == 4 and math.isfinite(loss)


def test_hugging_face_causal_lm_is_pipelined_over_two_ranks(launched: Any) -> None:
    pytest.importorskip("transformers")
    [(code, out)], _ = launched["hugging_face"]
    assert code == 0, out[-3000:]
    assert "Plan for LlamaForCausalLM" in out and "1F1B: 2 stages × 1 replica on 2 ranks" in out
    stage_1 = re.search(
        r"\n\s+1\s+\S+\s+model\.layers\.\d+ \.\. lm_head", out
    )  # the last stage ends the model
    assert stage_1 is not None, out[-3000:]
    steps, loss = _finished(out)
    assert steps == 6 and loss < math.log(256) - 0.3  # learning: below the uniform guess over 256 tokens


def test_tutorial_runs_as_a_file_with_the_rannc_arguments(launched: Any) -> None:
    [(code, out)], _ = launched["as_a_file"]
    assert code == 0, out[-3000:]
    assert "#Parameters=16640" in out and "Plan for Net" in out
    assert re.search(r"final train_loss=\d+\.\d+", out) and "Finished on rank0" in out


def test_a_script_without_the_import_needs_the_class_path_form(launched: Any) -> None:
    [(code, out), (code_config, out_config)], _ = launched["without_the_import"]
    # The name is registered by `import lightning_autopart`, which this script never runs: Lightning's own error.
    assert code != 0
    assert "You selected an invalid strategy name: `strategy='autopart'`" in out
    # A class path makes LightningCLI import the package itself.
    assert code_config == 0, out_config[-3000:]
    assert "Plan for BoringModel" in out_config and re.search(r"Profile +estimate on ", out_config)
    assert "trained True" in out_config
