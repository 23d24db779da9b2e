"""torchrun across two "nodes" on this machine: two agents meet at a c10d rendezvous, as on two hosts.

Each "node" is its own ``torchrun --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT`` launch (the
command users run on each host); the rendezvous numbers the nodes in the order they join, so each launch is tagged
with ``$AUTOPART_TEST_NODE`` to know which processes really share a "host". The plan must see 2 nodes, rank its
devices node by node as torchrun does, and its claims about which links stay inside a node must be true of the
launches. Single-node torchrun (2 and 4 ranks) runs in tests/distributed/test_strategy_cpu.py and others.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from torch.utils.data import DataLoader

from lightning_autopart import AutoPartitionStrategy
from lightning_autopart.errors import ConfigError
from lightning_autopart.partition.placement import link_pattern
from lightning_autopart.plan import load_plan
from tests.distributed.launch import ROOT, free_port, run_job
from tests.distributed.strategy_cases import Lit, dataset

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_train.py")
#: torchrun's own variables, which a test run under torchrun would pass on to the agents it starts.
_LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _two_nodes(out: Path, nproc: int, args: list[str], timeout: float = 240.0) -> list[tuple[int, str]]:
    """Start two torchrun agents of ``nproc`` processes each at one rendezvous; return each one's (code, log).

    Every agent runs in its own session, killed whole on timeout and afterwards."""
    port = free_port()
    procs = []
    for node in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), AUTOPART_TEST_NODE=str(node))
        for key in _LAUNCH_VARIABLES:
            env.pop(key, None)
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=autopart-test",
            str(SCRIPT), str(out), f"--devices={nproc}", "--num-nodes=2", *args,
        ]  # fmt: skip
        log = open(out / f"node{node}.log", "w+b")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))  # fmt: skip
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc, log in procs:
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = -9
            log.seek(0)
            results.append((code, log.read().decode(errors="replace")))
    finally:
        for proc, log in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
    for node, (code, log) in enumerate(results):
        assert code == 0, f"torchrun on node {node} exited with {code}:\n{log[-4000:]}"
    return results


def _records(out: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's record, by rank."""
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in records] == list(range(world))
    return records


def _check_nodes(out: Path, logs: list[tuple[int, str]], nproc: int) -> tuple[Any, list[dict[str, Any]]]:
    """The plan is for 2 nodes of ``nproc`` devices, numbered as torchrun numbered the launches, and each link the
    plan calls intra-node joins processes of one launch; return the plan and the records."""
    plan = load_plan(out / "plan.json")
    records = _records(out, 2 * nproc)
    assert (plan.cluster.nodes, plan.cluster.devices_per_node) == (2, nproc)
    printed = [log for _, log in logs if "Plan for Net" in log]
    assert len(printed) == 1 and f"on 2 nodes × {nproc} cpu" in printed[0], "rank 0 prints the plan once"
    launch = {r["rank"]: r["launch"] for r in records}
    for r in records:
        assert r["environment"] == "TorchElasticEnvironment" and r["world_size"] == 2 * nproc
        assert r["node_rank"] == r["rank"] // nproc == plan.cluster.node_of(r["rank"])
        same_node = [q["rank"] for q in records if q["node_rank"] == r["node_rank"]]
        assert {launch[q] for q in same_node} == {r["launch"]}, "one plan node is one launch"
        assert r["stages"] == [s.index for s in plan.stages if r["rank"] in s.ranks]
    pattern = link_pattern(plan.num_stages, plan.replicas, nproc, plan.layout)
    for p, stage in enumerate(plan.stages):
        assert pattern.allreduce_intra[p] == (len({launch[r] for r in stage.ranks}) == 1)
        following = plan.stages[(p + 1) % plan.num_stages]
        pairs = zip(stage.ranks, following.ranks, strict=True)
        assert pattern.p2p_intra[p] == all(launch[a] == launch[b] for a, b in pairs)
    return plan, records


def test_two_nodes_of_one_process_run_a_stage_each_equal_to_one_node(tmp_path: Path) -> None:
    """2 nodes x 1 process, 2 stages: each stage on its own node, activations crossing nodes; the losses equal
    the same 2-stage plan on one node (Lightning's launcher)."""
    (tmp_path / "two").mkdir()
    logs = _two_nodes(tmp_path / "two", 1, ["--num-stages=2"])
    plan, records = _check_nodes(tmp_path / "two", logs, 1)
    assert [s.ranks for s in plan.stages] == [(0,), (1,)]
    assert records[0]["stages"] == [0] and records[1]["stages"] == [1]
    assert records[0]["launch"] != records[1]["launch"], "the two stages run in different launches"
    assert records[0]["losses"] == records[1]["losses"], "the last stage's losses are replayed on the first"
    (tmp_path / "one").mkdir()
    code, log = run_job(
        [str(SCRIPT), str(tmp_path / "one"), "--devices=2", "--num-stages=2"], 2, "lightning", 180
    )
    assert code == 0, f"one node failed:\n{log[-4000:]}"
    reference = _records(tmp_path / "one", 2)[0]["losses"]
    assert len(reference) == len(records[0]["losses"]) == records[0]["global_step"] == 6
    assert all(math.isfinite(v) for v in reference)
    assert records[0]["losses"] == pytest.approx(reference, rel=1e-5)


def test_two_nodes_of_two_processes_place_the_plan_on_the_launches(tmp_path: Path) -> None:
    """2 nodes x 2 processes, 2 stages x 2 replicas: the plan's nodes are the launches (see _check_nodes)."""
    logs = _two_nodes(tmp_path, 2, ["--num-stages=2"])
    plan, records = _check_nodes(tmp_path, logs, 2)
    assert (plan.num_stages, plan.replicas) == (2, 2)
    for pipeline in {tuple(r["stages"]) for r in records}:
        assert len(pipeline) == 1
    by_replica: dict[tuple[int, ...], list[list[float]]] = {}
    for r in records:
        key = tuple(stage.ranks.index(r["rank"]) for stage in plan.stages if r["rank"] in stage.ranks)
        by_replica.setdefault(key, []).append(r["losses"])
    for losses in by_replica.values():  # each pipeline's last stage loss, replayed on its first stage
        assert len(losses) == 2 and losses[0] == losses[1] and all(math.isfinite(v) for v in losses[0])
        assert min(losses[0][-3:]) < losses[0][0], f"the loss did not go down: {losses[0]}"


def test_a_trainer_that_does_not_match_torchrun_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started 2 processes on 2 nodes, the Trainer says 1 x 1: refused with the fix before the rendezvous
    (it used to plan for 1 node, or fail with an IndexError for devices < --nproc_per_node)."""
    env = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"}
    for key, value in {
        **env,
        "TORCHELASTIC_RUN_ID": "test",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=AutoPartitionStrategy(), logger=False)
    message = (
        r"^TorchElasticEnvironment started 2 processes \(this one has local rank 0\), but the Trainer has "
        r"devices=1 x num_nodes=1; pass devices=<processes per node> and num_nodes=<nodes> \(torchrun: "
        r"--nproc_per_node and --nnodes"
    )
    with pytest.raises(ConfigError, match=message):
        trainer.fit(Lit("mlp"), DataLoader(dataset("mlp", 8), batch_size=4))
