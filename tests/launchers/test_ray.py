"""Ray Train: ``AutoPartitionStrategy`` in a Lightning Trainer inside Ray's ``TorchTrainer`` (examples/ray_train.py).

A local Ray cluster of 2 CPUs, 2 workers: Ray starts the processes and their process group, the strategy plans and
pipelines on them. Needs the ``ray`` extra (``pip install 'lightning_autopart[ray]'``); skipped without it. The
example runs in a session of its own, killed whole on timeout, and must leave no Ray process behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lightning_autopart.plan import load_plan
from tests.distributed.launch import ROOT

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("ray", "pandas", "pyarrow")),
        reason="needs Ray Train: pip install 'lightning_autopart[ray]'",
    ),
]


def _session_processes(sid: int) -> list[str]:
    """The processes still alive in session ``sid`` (pid and command)."""
    ps = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if line.split()[1] == str(sid)]


def test_ray_train_runs_the_strategy_on_its_workers(tmp_path: Path) -> None:
    """2 Ray workers, 2 stages: rank 0 prints and saves a plan for 1 node x 2 CPUs, the loss goes down, Ray
    reports rank 0's metrics and a checkpoint (RayTrainReportCallback) that a plain ``Net`` loads, and
    ``ray.shutdown()`` leaves no process."""
    from examples.tutorial import Net

    # Ray's session files and RayTrainReportCallback's local copies go to a short directory of the test's own
    # (Ray's socket paths must stay under 108 characters, which pytest's tmp_path may not).
    scratch = Path(tempfile.mkdtemp(prefix="autopart-ray-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    env.update(RAY_TMPDIR=str(scratch), TMPDIR=str(scratch))
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    plan_path, storage = tmp_path / "plan.json", tmp_path / "ray"
    command = [
        sys.executable,
        "-m",
        "examples.ray_train",
        "--save-plan",
        str(plan_path),
        "--storage",
        str(storage),
    ]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=300)
        deadline = time.monotonic() + 10  # ray.shutdown() has stopped its processes, or they are on their way
        while _session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _session_processes(proc.pid)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the Ray example ran past 300 s:\n{out.decode(errors='replace')[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)
    log = out.decode(errors="replace")
    assert proc.returncode == 0, f"the Ray example exited with {proc.returncode}:\n{log[-4000:]}"
    assert not left, f"processes left behind after ray.shutdown(): {left}"
    assert "Plan for Net" in log and "on 1 node × 2 cpu" in log, log[-4000:]
    plan = load_plan(plan_path)
    assert (plan.cluster.nodes, plan.cluster.devices_per_node, plan.num_stages) == (1, 2, 2)
    summary = re.search(r"autopart-ray: (\{.*\})", log)
    assert summary is not None, log[-4000:]
    losses = json.loads(summary[1])["losses"]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert min(losses[-3:]) < losses[0], f"the loss did not go down: {losses}"
    result = re.search(r"ray result: metrics (\{.*?\}), checkpoint ([^\s(]+)", log)  # a Ray log may follow
    assert result is not None, log[-4000:]
    assert f"'train_loss': {losses[-1]}" in result[1] and "'step': 8" in result[1]
    model = Net.load_from_checkpoint(Path(result[2], "checkpoint.ckpt"), map_location="cpu")
    assert sum(p.numel() for p in model.parameters()) == plan.fingerprint["param_count"]
