"""SLURM for real: a 2-node cluster on this machine (``slurm_cluster.py``) runs ``examples/slurm/train.sbatch``
through ``sbatch`` and ``srun``, and a job pre-empted with SLURM's warning signal saves, requeues and resumes.

Debian's ``slurm-wlm`` and ``munge`` are installed when missing (root and apt, as in CI; skipped otherwise). The
two nodes are two ``slurmd`` on one machine, so ``Trainer(num_nodes=2)`` meets SLURM's real environment
(``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_PROCID``...) through Lightning's ``SLURMEnvironment``. Only the
rendezvous address is given (``MASTER_ADDR=127.0.0.1``): the node names ``node1``/``node2`` resolve nowhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import ROOT, free_port
from tests.launchers import _slurm_preempt as job
from tests.launchers.slurm_cluster import SlurmCluster
from tests.launchers.system import ensure_debian_packages

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLE = ROOT / "examples" / "slurm" / "train.sbatch"

#: Seconds a job may take before the test gives up (the cluster's teardown then kills it).
LIMIT = 180.0

#: Seconds from the pre-emption signal until every rank's process is gone (measured: 1 to 2 s; a rank hung in
#: a collective would outlive SLURM's KillWait, 30 s, and die of its SIGKILL).
PROMPT = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Two SLURM nodes of 2 CPUs each, up for the module; afterwards not one of its processes is left."""
    began = time.monotonic()
    ensure_debian_packages(
        {"slurmctld": "slurmctld", "slurmd": "slurmd", "slurm-client": "sbatch", "munge": "munged"}
    )
    installed = time.monotonic()
    if os.geteuid() != 0:
        pytest.skip(
            "needs root: the cluster's slurmd runs as SlurmUser=root (run the test as root, as CI does)"
        )
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=2)
    with slurm:
        up = time.monotonic() - installed
        print(f"\nslurm: packages ready in {installed - began:.1f} s, cluster up in {up:.1f} s")
        yield slurm
    assert not slurm.leftovers(), "processes of the SLURM cluster outlived its teardown"


def _submit_env(cluster: SlurmCluster) -> dict[str, str]:
    """What a user's shell holds at ``sbatch`` (jobs inherit it): the venv's python first on the PATH."""
    env = cluster.env()
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    path = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    port = str(free_port())
    return env | {
        "PATH": path,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


def _sbatch(cluster: SlurmCluster, out: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start ``sbatch --wait`` (from the repository root, as the example says); its own output goes to
    ``OUT/sbatch.txt``, the job's to ``OUT/job.out``."""
    command = ["sbatch", "--wait", f"--output={out / 'job.out'}", f"--chdir={ROOT}", *args]
    with (out / "sbatch.txt").open("wb") as log:
        return subprocess.Popen(command, env=_submit_env(cluster), stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen[bytes], out: Path, cluster: SlurmCluster) -> None:
    try:
        proc.wait(LIMIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the job ran past {LIMIT} s:\n{_report(out, cluster)}") from None
    assert proc.returncode == 0, _report(out, cluster)


def _job_id(out: Path, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"Submitted batch job (\d+)", (out / "sbatch.txt").read_text())
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise AssertionError(f"sbatch printed no job id: {(out / 'sbatch.txt').read_text()}")


def _report(out: Path, cluster: SlurmCluster) -> str:
    files = [out / "sbatch.txt", out / "job.out"]
    texts = [f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}" for p in files if p.exists()]
    return "\n".join([*texts, cluster.logs()])


def _steps(out: Path, run: int, rank: int) -> dict[int, float]:
    """The loss per global step that ``rank`` logged in ``run`` (0, then 1 after the requeue)."""
    return {int(k): v for k, v in json.loads((out / f"steps.{run}.{rank}.json").read_text()).items()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_example_sbatch_trains_on_two_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    """``examples/slurm/train.sbatch`` as a user submits it, on CPUs (the GPU request overridden): 2 nodes x 2
    tasks, a plan of 2 stages x 2 replicas with each pipeline inside a node, 20 steps, the checkpoint written."""
    assert "#SBATCH --gpus-per-node=8" in EXAMPLE.read_text()  # the line the first option below overrides
    began = time.monotonic()
    options = ["--gpus-per-node=0", "--cpus-per-task=1", "--ntasks-per-node=2", "--time=5"]
    train = ["--accelerator", "cpu", "--stages", "2", "--max-steps", "20", "--root", str(tmp_path / "run")]
    proc = _sbatch(cluster, tmp_path, *options, str(EXAMPLE), *train)
    job_id = _job_id(tmp_path, proc)
    _wait(proc, tmp_path, cluster)
    print(f"\nslurm: example job {job_id} took {time.monotonic() - began:.1f} s")
    log = (tmp_path / "job.out").read_text()
    assert f"job {job_id} on node[1-2] (2 nodes x 2 tasks)" in log, log
    assert re.search(r"Plan for Regressor .* on 2 nodes × 2 cpu", log), log  # the Cluster the planner saw
    assert "GPipe: 2 stages × 2 replicas on 4 ranks" in log, log
    for stage in (0, 1):  # stage s on ranks s and s + 2
        assert re.search(
            rf"^\s+{stage}\s+\S+\s+net\.\d+ \.\. net\.\d+\s+\S+\s+2 × {stage},{stage + 2}\s", log, re.M
        ), log
    # SLURM's block distribution puts ranks 0-1 on node1 and 2-3 on node2, as the planner assumed (node =
    # rank // devices per node), so each pipeline's link stays inside a node (the cpu spec prices both kinds
    # of link alike, and the tie goes to this layout).
    for rank, node in enumerate(["node1", "node1", "node2", "node2"]):
        assert f"rank {rank} on {node}: stage {rank % 2} (replica {rank // 2})" in log, log
    losses = {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([\d.]+)$", log, re.M)}
    assert sorted(losses) == [10, 20], log
    assert losses[20] < losses[10], losses
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert f"training finished: step 20, loss {losses[20]:.4f}, checkpoint {last}" in log, log
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 20  # sharded: every rank's part
    for node in cluster.nodes:  # each slurmd started the step's tasks
        assert f"launch task StepId={job_id}.0 " in (cluster.root / "log" / f"slurmd.{node}.log").read_text()


JOB = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --time=5
#SBATCH --requeue --open-mode=append
echo "run ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"
srun python tests/launchers/_slurm_preempt.py "$@"
"""


def test_preemption_signal_saves_requeues_and_resumes(cluster: SlurmCluster, tmp_path: Path) -> None:
    """SLURM's warning signal (``scancel --signal=USR1``: what ``--signal=USR1@90`` sends every task) stops
    both ranks after one step, promptly, with a sharded checkpoint there; rank 0 requeues the job, and the
    requeued run (``SLURM_RESTART_COUNT=1``) resumes from that checkpoint and finishes."""
    script, steps = tmp_path / "job.sbatch", 20
    script.write_text(JOB)
    root = tmp_path / "run"
    train = ["--accelerator", "cpu", "--stages", "2", "--profile", "estimate", "--max-steps", str(steps)]
    began = time.monotonic()
    proc = _sbatch(cluster, tmp_path, str(script), str(tmp_path), *train, "--root", str(root))
    job_id = _job_id(tmp_path, proc)
    deadline = time.monotonic() + LIMIT
    while not (tmp_path / "running.0").exists():
        assert proc.poll() is None and time.monotonic() < deadline, _report(tmp_path, cluster)
        time.sleep(0.05)
    pids = [int((tmp_path / f"pid.0.{r}").read_text()) for r in range(2)]
    signalled = time.monotonic()
    cluster.run("scancel", "--signal=USR1", job_id)  # every task of the job's steps, not the batch shell
    while any(_alive(pid) for pid in pids) and time.monotonic() - signalled < LIMIT:
        time.sleep(0.02)
    stopped = time.monotonic() - signalled
    _wait(proc, tmp_path, cluster)
    print(
        f"\nslurm: pre-empted job {job_id}: running after {signalled - began:.1f} s, every rank gone "
        f"{stopped:.1f} s after the signal, requeued run done {time.monotonic() - signalled:.1f} s after it"
    )
    log = (tmp_path / "job.out").read_text()
    assert stopped < PROMPT, f"ranks alive {stopped:.1f} s after the signal:\n{log}"
    assert "Killed" not in log and "signal 9" not in log, log  # no rank needed SLURM's SIGKILL

    before = [_steps(tmp_path, 0, r) for r in range(2)]
    step = max(before[0])
    assert before[0] == before[1], before  # both ranks stopped after the same step, with the same losses
    assert job.MARK <= step < steps
    # 138 = 128 + SIGUSR1; or the requeue's SIGTERM ended the rank after Lightning's teardown had given SIGTERM
    # back to its default, before the rank wrote its code (no SIGKILL: checked above)
    for r in range(2):
        code, ended = tmp_path / f"exit.0.{r}", f"task {r}: Terminated" in log or "DUE TO JOB REQUEUE" in log
        assert code.read_text() == str(128 + signal.SIGUSR1) if code.exists() else ended, (r, log)
    checkpoint = root / "hpc_ckpt_1.ckpt"  # Lightning's requeue checkpoint, the pre-emption's
    assert torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"] == step
    assert f"autopart: SIGUSR1 received; saving a checkpoint at step {step} to {checkpoint}" in log, log
    assert f"`scontrol requeue {job_id}` done" in log, log
    assert not [p.name for p in root.rglob(".*") if p.name.endswith((".partial", ".old"))]

    assert f"run 1 of job {job_id} on node[1-2]" in log, log
    assert f"Restored all states from the checkpoint at {checkpoint}" in log, log
    after = [_steps(tmp_path, 1, r) for r in range(2)]
    assert sorted(after[0]) == list(range(step + 1, steps + 1)), after  # the global step goes on
    assert after[0] == after[1] and all(torch.isfinite(torch.tensor(list(after[0].values()))))
    assert [(tmp_path / f"exit.1.{r}").read_text() for r in range(2)] == ["0", "0"], log
    assert f"training finished: step {steps}" in log, log
