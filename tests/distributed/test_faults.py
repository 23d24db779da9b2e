"""One fault injected into a 2-stage fit on 2 gloo processes (4: 2 stages x 2 replicas) (issue 11, [Note:
failing ranks]): every process the job started exits, with the expected code, within seconds of an exception or
a kill, even with Lightning's default 30-minute timeout, and within the timeout of a frozen rank; the surviving
rank names the failure. The frozen jobs start one by one and sleep; the others run two at a time beside them,
each in its own session, watched by a subreaper that signals only their processes (``fault_watch.py``)."""

from __future__ import annotations

import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed._faults_script import FAULTS
from tests.distributed.fault_watch import Watched, watch_job

pytestmark = [pytest.mark.distributed, pytest.mark.alone]  # deadlines or CPU load: run with nothing beside

SCRIPT = Path(__file__).with_name("_faults_script.py")
#: Seconds after an exception or a kill by which every process must be gone (typically 0.1: docs/guide.md).
PROMPT = 10.0
#: The strategy's timeout in the frozen-peer case, and how long after it the other ranks may take to exit. The
#: timeout also bounds the rendezvous: a frozen job starts beside two others (6 processes on 2 cores).
FROZEN_TIMEOUT, AFTER_TIMEOUT = 30, 8.0
#: Seconds a job may run before the watcher kills what is left (start-up takes about 10).
BOUND = 90.0


@dataclass(frozen=True)
class Case:
    """A fault, how the job is launched and with what timeout, each rank's exit code (-9 for the rank killed,
    or frozen and then killed by the watcher; one per process: 4 is 2 stages x 2 replicas) and what the output
    must say (regular expressions)."""

    fault: str
    codes: tuple[int, ...]
    says: tuple[str, ...]
    how: str = "lightning"
    timeout: str = "default"

    @property
    def name(self) -> str:
        world = f"-{len(self.codes)}ranks" if len(self.codes) != 2 else ""
        return f"{self.fault}-{self.how}-{self.timeout}{world}"


FIRST_GONE = (
    r"autopart: rank 1 \(stage 1\) stopped: a peer closed the connection while it waited for the pipeline's "
    r"activations/gradients from rank 0 \(stage 0\)\. No rank could report why: the job's store is gone"
)

CASES = [
    Case("stop_last", (1, -9), (
        r"autopart: rank 0 \(stage 0\) stopped first: nothing came within the timeout "
        rf"\({FROZEN_TIMEOUT} s\) while it waited for the pipeline's activations/gradients from rank 1 "
        r"\(stage 1\), and no rank reported an error\. Rank 1 \(stage 1\), pid \d+, is stopped \(SIGSTOP",
    ), timeout=str(FROZEN_TIMEOUT)),
    # a group autopart creates beside the default one takes its timeout ([Note: a subgroup's timeout]), not 30 min
    Case("stop_last_logs", (1, -9), (
        r"autopart: rank 0 \(stage 0\) stopped first: nothing came within the timeout "
        rf"\({FROZEN_TIMEOUT} s\) while it waited for the log channel broadcast \(the last stage's logs\) from "
        r"rank 1 \(stage 1\), and no rank reported an error\. Rank 1 \(stage 1\), pid \d+, is stopped",
    ), timeout=str(FROZEN_TIMEOUT)),
    # 2 stages x 2 replicas: the pipelines' and the replicas' groups are not the default group. Which survivor
    # reports first is a race; each waits no longer than the timeout, and the report names the frozen rank
    # (rank 2 waits on rank 0, which waits on rank 1: "Elsewhere on this host")
    Case("stop_last", (1, -9, 1, 1), (
        rf"autopart: rank \d \(stage \d\) stopped first: nothing came within the timeout \({FROZEN_TIMEOUT} s\)"
        r"[^\n]*Rank 1 \(stage 1\), pid \d+, is stopped \(SIGSTOP",
    ), timeout=str(FROZEN_TIMEOUT)),
    Case("train_last", (1, 1), (
        r"autopart: rank 1 \(stage 1\) failed first: RuntimeError: injected failure in training_step on "
        r"rank 1\. This rank, rank 0 \(stage 0\), stopped because a peer closed the connection while it "
        r"waited for the pipeline's activations/gradients from rank 1 \(stage 1\)",
    )),
    Case("train_first", (1, 1), (r"RuntimeError: injected failure in training_step on rank 0", FIRST_GONE)),
    Case("train_first", (1, 1), (
        r"autopart: rank 0 \(stage 0\) failed first: RuntimeError: injected failure in training_step on "
        r"rank 0\. This rank, rank 1 \(stage 1\), stopped",
    ), how="torchrun"),
    Case("oom_forward", (1, 1), (r"OutOfMemoryError: injected: CUDA out of memory", FIRST_GONE)),
    Case("validation_last", (1, 1), (
        r"autopart: rank 1 \(stage 1\) failed first: ValueError: injected failure in validation_step on "
        r"rank 1\. This rank, rank 0 \(stage 0\), stopped",
    )),
    Case("optimizer_first", (1, 1), (r"injected failure in the optimizer step on rank 0", FIRST_GONE)),
    Case("configure_optimizers_last", (1, 1), (
        # before the plan exists: no stage to name, and rank 0 waits for the plan's broadcast
        r"autopart: rank 1 failed first: TypeError: injected failure in configure_optimizers on rank 1\. "
        r"This rank, rank 0, stopped",
    )),
    Case("loader_last", (1, 1), (
        r"autopart: rank 1 \(stage 1\) failed first: OSError: injected failure: sample 16 is unreadable",
    )),
    # the kill may also tear down the last step's log broadcast that rank 1 had sent but rank 0 not yet read
    # (a killed process's socket resets, dropping what was in flight), so either wait may be the one named
    Case("kill_last", (1, -9), (
        r"autopart: rank 0 \(stage 0\) stopped first: a peer closed the connection while it waited for the "
        r"(pipeline's activations/gradients|log channel broadcast \(the last stage's logs\)) from rank 1 "
        r"\(stage 1\), and no rank reported an error\. "
        r"Rank 1 \(stage 1\), pid \d+, (was killed by SIGKILL|is gone)",
    )),
]


def _run(case: Case, out: Path) -> Watched:
    out.mkdir(parents=True)
    world = len(case.codes)
    script = [str(SCRIPT), case.fault, case.timeout, str(out), *([str(world)] if world != 2 else [])]
    return watch_job(script, out, case.how, world=world, bound=BOUND)


def _until_struck(out: Path, job: Future[Watched], wait: float = BOUND) -> None:
    """Return once the fault struck in the job writing to ``out`` (or the job ended, or ``wait`` s passed)."""
    end = time.monotonic() + wait
    while not (out / "fault").exists() and not job.done() and time.monotonic() < end:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Watched]:
    """Every case's watched job. The frozen ones start one at a time, each once the one before has frozen (they
    then sleep through their timeout), the largest first and alone; the others run two at a time from then on.
    Started together, 10 processes loading torch on 2 cores outlasted the rendezvous, which the timeout bounds."""
    root = tmp_path_factory.mktemp("faults")
    frozen = sorted((c for c in CASES if c.fault.startswith("stop")), key=lambda c: -len(c.codes))
    with ThreadPoolExecutor(len(frozen)) as held, ThreadPoolExecutor(2) as pool:
        futures: dict[str, Future[Watched]] = {}
        for i, case in enumerate(frozen):
            futures[case.name] = held.submit(_run, case, root / case.name)
            _until_struck(root / case.name, futures[case.name])
            if i == 0:
                futures |= {c.name: pool.submit(_run, c, root / c.name) for c in CASES if c not in frozen}
        return {case.name: futures[case.name].result() for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_process_exits_with_its_code_and_the_failure_is_named(
    watched: dict[str, Watched], case: Case
) -> None:
    job = watched[case.name]
    tail = job.log[-6000:]
    assert job.fault_at is not None, f"the fault never struck:\n{tail}"
    assert sorted(job.ranks) == list(range(len(case.codes))), f"ranks seen: {sorted(job.ranks)}\n{tail}"
    target = FAULTS[case.fault][0]
    frozen = case.fault.startswith("stop")
    for rank, expected in enumerate(case.codes):
        exit_ = job.ranks[rank]
        if frozen and rank == target:
            assert exit_.killed_by_watcher == "stopped", f"rank {rank}: {exit_}\n{tail}"
            continue
        assert not exit_.killed_by_watcher, f"rank {rank} was still alive at the bound: {exit_}\n{tail}"
        # torchrun's agent sends SIGTERM to the other ranks as soon as one fails: a rank that has printed what
        # it knows may get it before it exits by itself
        allowed = {expected, -15} if case.how == "torchrun" and rank != target else {expected}
        assert exit_.code in allowed, f"rank {rank}: {exit_}, expected code {expected}\n{tail}"
        seconds = job.after_fault(rank)
        if frozen:  # the survivor waited for the timeout, then exited
            assert FROZEN_TIMEOUT - 1 < seconds < FROZEN_TIMEOUT + AFTER_TIMEOUT, f"rank {rank}: {seconds} s"
        else:
            assert seconds < PROMPT, f"rank {rank} exited {seconds:.1f} s after the fault\n{tail}"
    assert job.launcher.code not in (0, None), f"launcher: {job.launcher}\n{tail}"
    for pattern in case.says:
        assert re.search(pattern, job.log), f"missing {pattern!r} in:\n{tail}"
