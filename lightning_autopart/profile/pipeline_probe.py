"""A short two-rank pipeline on the job's own ranks, to measure what a CPU pipeline costs beyond its math.

[Note: pipeline probe] On CPUs (gloo) a pipelined micro-batch costs more than its stage's math and the bytes it
sends. On the 2-core test machine, a 2-stage 1F1B of ``Linear`` stages with 2.3 ms of forward and backward per
micro-batch ran 1.4-2.2 ms per micro-batch slower than that math timed alone, and the excess grew with the math:
gloo's threads wake, post and copy on cores that both ranks' compute keeps busy, and a waiting rank's threads
take cores from the working one. Neither a profile of the blocks nor a message timed between idle threads sees
it. So rank 0 and rank 1 run a synthetic 1F1B with two stages of the job's ranks, process group and transport,
whose actions compute about as long as the model's will and send as many bytes; what its step takes beyond the
cost model's ``K (f + b) + K p2p`` (``K = M + 1``) is the host time of a micro-batch's two actions on this
machine. Every other rank of rank 0's machine computes meanwhile (see [Note: planning under load]).

[Note: the probe's own clock] The overhead is the probe's step less its math, and its math is its products
times one product's time measured apart: an error there of e per product is e times the products of a
micro-batch in the overhead, five micro-batches' worth in a step. On the 2-core test machine this VM's speed
drifts by 10-30 % in phases lasting seconds, and a product timed over 30 runs (36 ms) moved 277-439 us between
calls a second apart: the pipeline's host time came out 3.8-11 ms for the same model. So one product is timed
over 0.1 s before the probe and again after it (rank 1 loads the cores again by then, as before), the mean of
the two is the probe's clock, and the probe runs 20 steps. The probe also times its own math: contention only
slows it, so where that is faster than the clock's, the clock caught a slower phase than the probe ran in,
and the probe's own math is subtracted instead.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_autopart.cluster import Cluster
from lightning_autopart.profile.measure import trimmed_mean
from lightning_autopart.profile.records import ModelProfile, cost_at

__all__ = [
    "COMMAND_SIZE",
    "ProbeCommand",
    "command_for",
    "follow_probe",
    "is_command",
    "lead_probe",
    "overhead_per_micro_batch",
    "probe_workload",
    "unit_us",
    "with_overhead",
]

#: The probe's compute: products of (_ROWS x _SIDE) activations with one of _WEIGHTS (_SIDE x _SIDE) weights in
#: turn (4 MiB of weights: a stage's working set outgrows the cores' L2 caches, as a model's does).
_ROWS, _SIDE, _WEIGHTS = 32, 512, 4
#: Bounds on a probe micro-batch's forward plus backward (us) and its message (bytes): the probe lasts < 1 s.
_MIN_SLOT_US, _MAX_SLOT_US = 300.0, 8000.0
_MAX_MESSAGE = 16 << 20
#: A probe's message that does not arrive in this time raises (a peer that failed mid-probe), so no rank waits
#: for the process group's own timeout (30 minutes under Lightning).
_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class ProbeCommand:
    """What both ranks run: products per forward and per backward, floats per message, micro-batches, steps."""

    fwd_reps: int
    bwd_reps: int
    message_floats: int
    micro_batches: int = 4
    warmup: int = 2
    steps: int = 20

    def to_tensor(self) -> torch.Tensor:
        """The command as the float64 tensor that rank 0 broadcasts (a leading 1 marks a probe)."""
        fields = (
            self.fwd_reps,
            self.bwd_reps,
            self.message_floats,
            self.micro_batches,
            self.warmup,
            self.steps,
        )
        return torch.tensor([1.0, *map(float, fields)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, data: torch.Tensor) -> ProbeCommand:
        """The command a broadcast tensor carries (see :meth:`to_tensor`)."""
        values = [int(v) for v in data.tolist()[1:7]]
        return cls(*values)


#: Length of a command tensor; a tensor of zeros means "planning is over".
COMMAND_SIZE = 7


def probe_workload(
    prof: ModelProfile, local_batch: int, stages: int, micro_batches: int
) -> tuple[float, int]:
    """The probe's size for ``prof``: forward plus backward of one micro-batch on one of ``stages`` even stages
    (us), and the median bytes crossing a block boundary at that micro-batch size."""
    m = max(1, local_batch // max(1, micro_batches))
    costs = [cost_at(b, m, prof.batch_size) for b in prof.blocks]
    slot_us = sum(c.fwd_us + c.bwd_us for c in costs) / max(1, stages)
    message = int(statistics.median(c.cut_bytes for c in costs)) if costs else 0
    return slot_us, message


def overhead_per_micro_batch(
    step_us: float, micro_batches: int, clock_math_us: float, own_math_us: float | None = None
) -> float:
    """Host time per micro-batch that a 2-stage 1F1B step of ``step_us`` shows beyond ``K`` micro-batches'
    math, ``K = M + 1`` (the cost model's clock, see :mod:`lightning_autopart.partition.cost`); never negative.
    The math is the probe clock's (``clock_math_us``), or the probe's own where that is less (see [Note: the
    probe's own clock])."""
    math_us = clock_math_us if own_math_us is None else min(clock_math_us, own_math_us)
    return max(0.0, step_us / (micro_batches + 1) - math_us)


def with_overhead(cluster: Cluster, overhead_us: float, message_bytes: int) -> Cluster:
    """``cluster`` whose ``action_us`` covers a probed micro-batch overhead: half of what the overhead leaves
    after the message the cost model already prices (rank 0 to rank 1's link), and never below the old value."""
    same_node = cluster.devices_per_node > 1
    bandwidth = cluster.intra_node_bw if same_node else cluster.inter_node_bw
    p2p = message_bytes / bandwidth * 1e6 + cluster.latency_us
    return dataclasses.replace(cluster, action_us=max(cluster.action_us, (overhead_us - p2p) / 2))


_Unit = tuple[torch.Tensor, list[torch.Tensor]]


def _unit() -> _Unit:
    return torch.randn(_ROWS, _SIDE), [torch.randn(_SIDE, _SIDE) for _ in range(_WEIGHTS)]


def _compute(unit: _Unit, reps: int) -> None:
    x, weights = unit
    for i in range(reps):
        torch.mm(x, weights[i % _WEIGHTS])


def unit_us(budget_s: float = 0.1, min_trials: int = 30) -> float:
    """Time of one probe product on this rank now (us): the mean of the middle 80 % of runs of ``_WEIGHTS``
    products, repeated until ``budget_s`` seconds and ``min_trials`` runs have passed (see [Note: host timing
    statistic] in :mod:`.measure`; [Note: the probe's own clock] for why it spans a budget)."""
    unit = _unit()
    _compute(unit, _WEIGHTS)
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < min_trials or time.perf_counter() - began < budget_s:
        start = time.perf_counter()
        _compute(unit, _WEIGHTS)
        times.append((time.perf_counter() - start) * 1e6 / _WEIGHTS)
    return trimmed_mean(times)


def command_for(slot_us: float, message_bytes: int, product_us: float) -> ProbeCommand:
    """The probe for a micro-batch of ``slot_us`` math (a third forward, two thirds backward, clamped to
    300 us - 8 ms) and ``message_bytes`` (at most 16 MiB), in products of ``product_us`` each."""
    slot = min(max(slot_us, _MIN_SLOT_US), _MAX_SLOT_US)
    reps = max(3, round(slot / max(product_us, 1e-3)))
    fwd = max(1, reps // 3)
    floats = max(1, min(message_bytes, _MAX_MESSAGE) // 4)
    return ProbeCommand(fwd, reps - fwd, floats)


def _send(tensor: torch.Tensor, peer: int) -> dist.Work:
    work = dist.isend(tensor, peer)
    assert work is not None  # the default group always has this rank
    return work


def _receive(tensor: torch.Tensor, peer: int) -> None:
    work = dist.irecv(tensor, peer)
    assert work is not None
    work.wait(_TIMEOUT)


def _steps(command: ProbeCommand, peer: int, lead: bool) -> list[tuple[float, float]]:
    """Run the command's steps as stage 0 (``lead``) or stage 1 of a 2-stage 1F1B; returns each step's seconds
    and the seconds of its math."""
    unit = _unit()
    m = command.micro_batches
    out = torch.zeros(command.message_floats)
    inbox = [torch.empty(command.message_floats) for _ in range(m)]
    if lead:  # torch's Schedule1F1B order for stage 0 of 2: F0 F1 B0 F2 B1 ... B(M-1)
        order = [("F", i) for i in range(min(2, m))]
        for i in range(m):
            order.append(("B", i))
            if i + 2 < m:
                order.append(("F", i + 2))
    else:  # the last stage: F0 B0 F1 B1 ...
        order = [(kind, i) for i in range(m) for kind in ("F", "B")]
    times = []
    for _ in range(command.warmup + command.steps):
        start = time.perf_counter()
        math = 0.0
        sends: list[dist.Work] = []
        for kind, i in order:
            if (kind == "F") != lead:  # stage 0 receives before a backward, stage 1 before a forward
                _receive(inbox[i], peer)
            began = time.perf_counter()
            _compute(unit, command.fwd_reps if kind == "F" else command.bwd_reps)
            math += time.perf_counter() - began
            if (kind == "F") == lead:  # stage 0 sends after a forward, stage 1 after a backward
                sends.append(_send(out, peer))
        for work in sends:
            work.wait(_TIMEOUT)
        times.append((time.perf_counter() - start, math))
    return times[command.warmup :]


def lead_probe(command: ProbeCommand, peer: int) -> tuple[float, float]:
    """Stage 0's side of the probe with ``peer`` (which runs :func:`follow_probe` with the same command): its
    step time and its math per micro-batch (us), each the mean of the middle 80 % of its steps."""
    steps = _steps(command, peer, lead=True)
    step_us = trimmed_mean([step for step, _ in steps]) * 1e6
    return step_us, trimmed_mean([math for _, math in steps]) * 1e6 / command.micro_batches


def follow_probe(command: ProbeCommand, leader: int) -> None:
    """The last stage's side of the probe that ``leader`` leads."""
    _steps(command, leader, lead=False)


def is_command(data: torch.Tensor) -> bool:
    """Whether a broadcast command tensor asks for a probe (zeros end planning)."""
    return bool(data[0].item() == 1.0)
