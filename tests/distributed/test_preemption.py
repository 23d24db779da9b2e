"""Pre-emption (see [Note: pre-emption] in ``lightning/preemption.py``): a 2-stage job signalled mid-training, as
schedulers do it, stops on every rank within seconds with code 128 + signum, leaves one complete checkpoint, and
the run that resumes from it continues the uninterrupted loss curve.

Launches: Lightning's launcher and torchrun with SIGTERM to every process (the launcher too), and one process per
rank as ``srun`` starts them on SLURM, each signalled once with SLURM's requeue signal (``--signal=USR1@90``), a
fake ``scontrol`` on the PATH recording the requeue; the requeued launch passes no ``ckpt_path`` and finds the
checkpoint as Lightning's auto-requeue does. The other two resume in this process, to keep the test short: the
sharded checkpoint on one autopart process, the full one with plain Lightning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed import _preempt_script as script
from tests.distributed.launch import ROOT, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.alone]  # deadlines or CPU load: run with nothing beside

SCRIPT = Path(script.__file__)

#: Seconds from the signal to the last process's exit that count as prompt (measured: 2 to 5 s, most of it
#: Python's own exit; Lightning's handling took until the 60 s timeout).
PROMPT = 10.0

#: Seconds a whole launch may take before the test gives up and kills it.
LIMIT = 90.0


def _env(out: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


def start(how: str, out: Path, tag: str, *options: str) -> list[subprocess.Popen[bytes]]:
    """Start the script on 2 ranks: ``how`` is "lightning" (its launcher), "torchrun" or "srun" (one process
    per rank with SLURM's variables and a fake ``scontrol`` that records its arguments in ``OUT/requeued``)."""
    args = [str(SCRIPT), str(out), tag, *options]
    env = _env(out)
    with (out / f"log.{tag}").open("wb") as log:  # the processes hold it open
        common: dict[str, Any] = {
            "cwd": ROOT,
            "stdout": log,
            "stderr": subprocess.STDOUT,
            "start_new_session": True,
        }
        if how == "lightning":
            return [subprocess.Popen([sys.executable, *args], env=env, **common)]
        if how == "torchrun":
            launcher = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
            port = env.pop("MASTER_PORT")
            command = [sys.executable, *launcher, f"--master_port={port}", *args]
            return [subprocess.Popen(command, env=env, **common)]
        env.update(_fake_slurm(out, env["PATH"]))
        return [
            subprocess.Popen(
                [sys.executable, *args], env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), **common
            )
            for r in range(2)
        ]


def _fake_slurm(out: Path, path: str) -> dict[str, str]:
    """What ``srun`` sets for a 2-task job step on one node, and a PATH whose ``scontrol`` records its arguments
    in ``OUT/requeued``."""
    bin_dir = out / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {out / "requeued"}\n')
    fake.chmod(0o755)
    variables = {"NTASKS": "2", "NTASKS_PER_NODE": "2", "NNODES": "1", "NODEID": "0", "JOB_ID": "4242"}
    return {"PATH": f"{bin_dir}{os.pathsep}{path}", "SLURM_JOB_NAME": "preempt-test"} | {
        f"SLURM_{k}": v for k, v in variables.items()
    }


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float = LIMIT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"{path.name} never appeared; log:\n{_log(path.parent)}")
        time.sleep(0.05)


def _log(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(out.glob("log.*")))


def finish(procs: list[subprocess.Popen[bytes]], pids: list[int], timeout: float = LIMIT) -> float:
    """Seconds until every started process and every rank (``pids``) has exited; kills them all after
    ``timeout`` (returning ``inf``)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if all(p.poll() is not None for p in procs) and not any(_alive(pid) for pid in pids):
            return time.monotonic() - began
        time.sleep(0.02)
    kill(procs, pids)
    return float("inf")


def kill(procs: list[subprocess.Popen[bytes]], pids: list[int]) -> None:
    """SIGKILL what this test started: each launch's session, and the ranks by pid."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def preempt(
    how: str, out: Path, tag: str, signum: int, *options: str
) -> tuple[float, list[subprocess.Popen[bytes]]]:
    """Start a job, signal it once training runs (every process of the session, or each rank once for "srun"),
    and return the seconds until all its processes exited."""
    procs = start(how, out, tag, *options)
    pids: list[int] = []
    try:
        _wait_for(out / f"running.{tag}", procs)
        for r in range(2):
            _wait_for(out / f"pid.{tag}.{r}", procs)
        pids = [int((out / f"pid.{tag}.{r}").read_text()) for r in range(2)]
        if how == "srun":
            for pid in pids:
                os.kill(pid, signum)
        else:
            os.killpg(procs[0].pid, signum)
        return finish(procs, pids), procs
    finally:
        kill(procs, pids)


def resume(how: str, out: Path, tag: str, *options: str) -> None:
    """Run a job to its end (exit 0 on every rank)."""
    procs = start(how, out, tag, "--pace", "0", *options)
    try:
        assert finish(procs, []) < LIMIT, f"the resumed job hung:\n{_log(out)}"
    finally:
        kill(procs, [])
    assert [p.returncode for p in procs] == [0] * len(procs), _log(out)


def losses(out: Path, tag: str, rank: int = 0) -> dict[int, float]:
    """A rank's logged loss per global step (every rank logs the last stage's)."""
    return {int(k): v for k, v in json.loads((out / f"losses.{tag}.{rank}.json").read_text()).items()}


def exit_codes(out: Path, tag: str) -> list[str]:
    return [(out / f"exit.{tag}.{r}").read_text() for r in range(2)]


def no_partial_files(out: Path) -> None:
    leftovers = [p.name for p in out.rglob(".*") if p.name.endswith((".partial", ".old"))]
    assert not leftovers, f"partial checkpoint files left: {leftovers}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, float]]:
    """The uninterrupted run's loss per step: one plain process on the same batches (equal to the 2-stage
    pipeline, see test_lifecycle)."""
    out = tmp_path_factory.mktemp("reference")
    script.train(out, "ref", "auto", 1, pace=0.0)
    yield losses(out, "ref")


def _check_stopped(out: Path, tag: str, seconds: float, code: int, reference: dict[int, float]) -> int:
    """The job stopped promptly with ``code`` on every rank after the same step; returns that step."""
    assert seconds < PROMPT, f"still running {PROMPT} s after the signal:\n{_log(out)}"
    assert exit_codes(out, tag) == [str(code)] * 2, _log(out)
    before = losses(out, tag)
    step = max(before)
    assert script.MARK <= step < script.EPOCHS * script.STEPS_PER_EPOCH
    assert before == pytest.approx({s: reference[s] for s in range(1, step + 1)}, rel=1e-5)
    assert losses(out, tag, rank=1) == pytest.approx(before, rel=1e-6)  # both stopped after the same step
    return step


def _check_resumed(out: Path, tag: str, step: int, reference: dict[int, float]) -> None:
    after = losses(out, tag)
    total = script.EPOCHS * script.STEPS_PER_EPOCH
    assert after == pytest.approx({s: reference[s] for s in range(step + 1, total + 1)}, rel=1e-5)


@pytest.mark.usefixtures("master_port")
def test_sigterm_to_every_process_of_lightnings_launcher(tmp_path: Path, reference: dict[int, float]) -> None:
    """The signal lands inside a step, the last stage waiting in the pipeline for the first: where Lightning's own
    handler (a broadcast inside the handler) deadlocked every time."""
    seconds, procs = preempt("lightning", tmp_path, "cut", signal.SIGTERM, "--in-step")
    step = _check_stopped(tmp_path, "cut", seconds, 128 + signal.SIGTERM, reference)
    assert procs[0].returncode == 128 + signal.SIGTERM
    checkpoint = tmp_path / "preempted.ckpt"
    assert (checkpoint / "meta.pt").is_file()  # a sharded checkpoint: every rank's part, and the loops
    assert torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"] == step
    no_partial_files(tmp_path)
    # Resumed here, on one process (the 2 stages' parts resharded into one), to keep the test short.
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate")
    script.train(tmp_path, "resumed", strategy, 1, str(checkpoint), pace=0.0)
    _check_resumed(tmp_path, "resumed", step, reference)


def test_sigterm_to_torchrun_and_its_workers_full_checkpoint(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """torchrun forwards the signal to its workers (a second SIGTERM each): still one stop, at one step."""
    checkpoint = tmp_path / "chosen" / "stop.ckpt"
    options = ("--checkpoint", "full", "--save", str(checkpoint), "--in-step")
    seconds, procs = preempt("torchrun", tmp_path, "cut", signal.SIGTERM, *options)
    step = _check_stopped(tmp_path, "cut", seconds, 128 + signal.SIGTERM, reference)
    assert procs[0].returncode != 0  # torchrun reports its workers' failure
    assert torch.load(checkpoint, weights_only=False)["global_step"] == step
    no_partial_files(tmp_path)
    script.train(
        tmp_path, "resumed", "auto", 1, str(checkpoint), pace=0.0
    )  # one file: plain Lightning reads it
    _check_resumed(tmp_path, "resumed", step, reference)


def test_slurm_requeue_signal_once_per_rank_requeues_and_resumes(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """``srun`` ranks with Lightning's auto-requeue: USR1 once per rank stops them with 138, rank 0 requeues
    the job, and the requeued job (no ckpt_path) resumes from Lightning's ``hpc_ckpt_1.ckpt``."""
    seconds, procs = preempt("srun", tmp_path, "cut", signal.SIGUSR1)
    step = _check_stopped(tmp_path, "cut", seconds, 128 + signal.SIGUSR1, reference)
    assert [p.returncode for p in procs] == [128 + signal.SIGUSR1] * 2
    assert (tmp_path / "requeued").read_text().split("\n") == ["requeue 4242", ""]  # rank 0, once
    assert torch.load(tmp_path / "hpc_ckpt_1.ckpt" / "meta.pt", weights_only=False)["global_step"] == step
    no_partial_files(tmp_path)
    resume("srun", tmp_path, "resumed")
    _check_resumed(tmp_path, "resumed", step, reference)
