"""What a rank says when its step fails (see [Note: failing ranks]): which errors come from a peer, which
operation and which ranks a failed collective waited for, and the report another rank reads from the store.
The processes themselves are tested in tests/distributed/test_faults.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from lightning_autopart.lightning import exits, faults
from lightning_autopart.lightning.faults import FaultGuard, peer_failure
from lightning_autopart.runtime.topology import place
from tests.pipeline_plans import make_plan

CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2796"
TIMED_OUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"


def test_backend_errors_are_peer_failures_and_user_errors_are_not() -> None:
    assert peer_failure(RuntimeError(CLOSED)) == "closed"
    assert peer_failure(RuntimeError(TIMED_OUT)) == "timeout"
    assert peer_failure(dist.DistNetworkError("Broken pipe")) == "closed"
    assert peer_failure(RuntimeError("injected failure in training_step")) is None
    assert peer_failure(ValueError("the timeout of my data source")) is None  # not a RuntimeError
    wrapped = RuntimeError("Stage 0 failed to run forward")
    wrapped.__cause__ = RuntimeError(CLOSED)
    assert peer_failure(wrapped) == "closed"


def test_the_operation_and_the_ranks_waited_for_come_from_the_traceback_and_the_plan() -> None:
    plan = make_plan(8, 4, 2)  # 4 stages x 2 replicas, pipeline-major: replicas on ranks 0-3 and 4-7
    middle = place(plan, 1)
    assert faults._who(1, plan) == "rank 1 (stage 1)" and faults._who(1, None) == "rank 1"
    assert faults._peers("neighbours", middle, 1, 8) == [0, 2]
    assert faults._peers("pipeline", middle, 1, 8) == [0, 2, 3]
    assert faults._peers("replicas", middle, 1, 8) == [5]
    assert faults._peers("world", middle, 1, 8) == [0, 2, 3, 4, 5, 6, 7]
    schedules = "/site-packages/torch/distributed/pipelining/schedules.py"
    code = compile("raise RuntimeError('x')", schedules, "exec")
    try:
        exec(code)
    except RuntimeError as error:
        assert faults._operation(error) == ("the pipeline's activations/gradients", "neighbours")
    assert faults._operation(RuntimeError(CLOSED)) == ("a collective of every rank", "world")


def test_the_root_cause_is_summarised() -> None:
    outer = RuntimeError("\n  Stage 0 failed to run forward:\n ...")
    outer.__cause__ = MemoryError("out of memory\nmore detail")
    assert faults._summary(outer) == "MemoryError: out of memory"


def test_a_child_process_is_named_by_how_it_ended() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert faults._process_state(child.pid) in ("is still running", faults._STATES["D"])
        os.kill(child.pid, signal.SIGSTOP)
        # on a loaded machine the child may pass through other states (a page fault's "D") first
        assert _settles(child.pid, "is stopped")
        child.kill()
        assert _settles(child.pid, "was")
        assert faults._process_state(child.pid) == "was killed by SIGKILL"  # a zombie until reaped
    finally:
        child.kill()
        child.wait()
    assert faults._process_state(child.pid).startswith("is gone")


def _settles(pid: int, prefix: str, seconds: float = 10.0) -> bool:
    """Whether the state of ``pid`` starts with ``prefix`` within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not faults._process_state(pid).startswith(prefix):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class _Channel:
    abandoned = False

    def abandon(self) -> None:
        self.abandoned = True


def _split(plan: Any, rank: int) -> Any:
    """What the guard reads of a rank's ``Partition``: the plan, the placement and the log channel."""
    runner = SimpleNamespace(placement=place(plan, rank))
    return SimpleNamespace(plan=plan, steps=SimpleNamespace(runner=runner, channel=_Channel()))


@pytest.fixture
def guards(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Two guards on one in-process store, as ranks 0 and 1 of a 2-stage plan; no exit guard is armed."""
    monkeypatch.setattr(exits, "arm", lambda: None)  # this process must not exit at the end of the tests
    monkeypatch.setattr(exits, "install", lambda: None)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5))
    made = []
    for rank in range(2):
        guard = FaultGuard()
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
        guard.arm(rank, 2, timedelta(seconds=20))
        made.append(guard)
    return made


def test_the_peer_of_a_failed_rank_names_it(guards: list[FaultGuard]) -> None:
    plan = make_plan(8, 2, 1)
    peer, failing = guards  # ranks 0 and 1
    failing.on_exception(RuntimeError("boom"), _split(plan, 1))
    error = RuntimeError(CLOSED)
    split = _split(plan, 0)
    peer.on_exception(error, split)
    assert split.steps.channel.abandoned  # its pending receive is never waited for
    assert str(error).startswith(
        "autopart: rank 1 (stage 1) failed first: RuntimeError: boom. This rank, rank 0 (stage 0), stopped "
        "because a peer closed the connection while it waited for a collective of every rank from rank 1 "
        "(stage 1)\n"
    )
    assert str(error).endswith(CLOSED)  # the backend's message follows
    again = RuntimeError(CLOSED)
    peer.on_exception(again, _split(plan, 0))  # once per process
    assert str(again) == CLOSED


def test_with_no_report_a_timeout_names_the_peer_and_the_fix(guards: list[FaultGuard]) -> None:
    plan = make_plan(8, 2, 1)
    error = RuntimeError(TIMED_OUT)
    guards[0].on_exception(error, _split(plan, 0))
    message = str(error).splitlines()[0]
    assert message.startswith(
        "autopart: rank 0 (stage 0) stopped first: nothing came within the timeout (20 s) while it waited "
        "for a collective of every rank from rank 1 (stage 1), and no rank reported an error. "
        "Rank 1 (stage 1), pid "
    )
    assert "raise AutoPartitionStrategy(timeout=...)" in message
    assert guards[1]._get("first") == message.removeprefix("autopart: ").split(" A peer that freezes")[0]


def test_a_system_exit_is_left_alone(guards: list[FaultGuard]) -> None:
    guards[0].on_exception(SystemExit(143))
    assert not guards[0].failed


def test_when_its_peers_only_wait_a_timeout_names_the_rank_that_froze(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 stages x 2 replicas: rank 2 times out in the replicas' all-reduce with rank 0, which runs (it waits
    for rank 1); rank 1, stopped on this host, is the one the message must name."""
    monkeypatch.setattr(exits, "arm", lambda: None)
    monkeypatch.setattr(exits, "install", lambda: None)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    plan = make_plan(8, 2, 2)  # pipelines (0, 1) and (2, 3); replicas (0, 2) and (1, 3)
    guard = FaultGuard()
    guard.arm(2, 4, timedelta(seconds=20))
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        assert _settles(frozen.pid, "is stopped")
        host = socket.gethostname()
        store.set("autopart/0/pid/0", f"{host} {os.getpid()}")
        store.set("autopart/0/pid/1", f"{host} {frozen.pid}")
        code = compile("raise RuntimeError(TIMED_OUT)", "/x/lightning_autopart/runtime/buckets.py", "exec")
        try:
            exec(code, {"TIMED_OUT": TIMED_OUT})
        except RuntimeError as error:
            guard.on_exception(error, _split(plan, 2))
            message = str(error).splitlines()[0]
    finally:
        frozen.kill()
        frozen.wait()
    assert message.startswith(
        "autopart: rank 2 (stage 0) stopped first: nothing came within the timeout (20 s) while it waited for the "
        "gradient all-reduce from rank 0 (stage 0), and no rank reported an error. Rank 0 (stage 0), pid "
        f"{os.getpid()}, is still running. Elsewhere on this host: Rank 1 (stage 1), pid {frozen.pid}, is stopped "
        "(SIGSTOP"
    ), message
