"""The exit guard's handler for a process that saw no failure ([Note: groups end before the interpreter]):
its process groups end in an exit handler, not in the interpreter's teardown, and within a bounded time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.distributed.launch import ROOT, free_port

#: A one-rank gloo job that installs the exit guard, as the strategy's setup does, then ends normally.
_JOB = """
import atexit, sys, time
import torch.distributed as dist
from lightning_autopart.lightning import exits

def say(what: str) -> None:
    print(what, "initialized" if dist.is_initialized() else "ended", flush=True)

mode = sys.argv[1]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
dist.new_group([0])  # a second group, as the stages' and the mesh's are
atexit.register(say, "after the guard:")  # registered before setup: runs after the guard's handlers
exits.install()
atexit.register(say, "before the guard:")  # a logger's or the user's handler: runs first
if mode == "hang":  # ending the groups blocks: the watchdog ends the process
    dist.destroy_process_group = lambda *a, **k: time.sleep(60)
    exits._end_groups.__defaults__ = (1.0,)
if mode == "failed":
    dist.destroy_process_group = lambda *a, **k: print("destroyed", flush=True)
    exits.arm()
print("trained", flush=True)
"""


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(_JOB).replace("{port}", str(free_port()))
    return subprocess.run(
        [sys.executable, "-c", code, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
def test_a_finished_process_ends_its_groups_before_the_interpreter_does() -> None:
    done = _run("ok")
    assert done.returncode == 0, done.stderr
    expected = ["trained", "before the guard: initialized", "after the guard: ended"]
    assert done.stdout.splitlines() == expected, done.stdout


@pytest.mark.slow
def test_ending_the_groups_is_bounded_by_a_watchdog() -> None:
    done = _run("hang")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Timeout" in done.stderr  # faulthandler's dump names where it blocked


@pytest.mark.slow
def test_after_a_failure_the_groups_are_left_alone() -> None:
    """A peer may still hold an operation open on them: the guard exits with code 1 without ending them."""
    done = _run("failed")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.splitlines() == ["trained", "before the guard: initialized"], done.stdout
