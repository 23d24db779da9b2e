"""An interleaved rank's chunks: the parts of each chunk's memory, and the rank's peak they add up to.

[Note: a rank's chunks] An interleaved rank holds ``v`` chunks whose in-flight micro-batches peak at different
moments of the schedule ([Note: interleaved in flight] in configs.py), and whose backwards run one at a time.
The planner judges each chunk alone (``bound_bytes``: its most micro-batches, its own backward, every send kept,
against its share of the device, [Note: chunk shares] in tables.py), which adds up stage by stage. The rank's
true peak is the largest, over its backwards, of::

    sum_c (state_c + io_c) + max(sum_c (n_c (a_c + q_c + w_c) + d_c sent_c) + recompute_b + X_b, sum_c y_c)

with ``n_c`` and ``d_c`` the chunks' micro-batches in flight and finished at that moment (torch's runtime keeps
a finished micro-batch's sends until the step ends), ``w_c`` a micro-batch's weight casts ([Note: weight casts] in
cost.py) and ``b`` the chunk whose backward runs.
:func:`share_rank_peaks` finds it and splits it among the chunks (``memory_bytes`` and its parts at that
moment), so a rank's chunks add up to it; a tied parameter several of its chunks use is one tensor there and
counts once. On 2 gloo ranks x 2 chunks (``bench/pipeline_peak.py --cases
Interleaved1F1B:4``), the chunks summed with the old per-chunk counts read 1.155 and 1.169 of each rank's
measured peak; this reads 1.021 and 1.020.

[Note: a chunk's first backward] With one replica and gradients dropped at the step's start, a chunk's
gradients do not exist before its first backward, which makes them as it goes ([Note: fresh gradients] in
fresh.py: ``first``, its ``fresh_transient``, in place of ``transient``). So a moment leaves out the gradients
(``ChunkParts.grads``) of every chunk with ``d_c == 0``, and a share reports the gradients that exist then. A
rank's chunks back-propagate last to first, so chunk 0's first backward, often the rank's peak, meets only the
later chunks' gradients. A tied gradient two chunks of a rank share counts as there from the start (another
chunk's backward may make it), and so does a tied copy's. Qwen2's first rank (2 ranks x 2 chunks, the CPU's
kernels) read 1.12 of its measured peak counting every gradient there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from lightning_autopart.partition.configs import Config, interleaved_moments
from lightning_autopart.partition.tied import TiedCopy

if TYPE_CHECKING:
    from lightning_autopart.partition.cost import StageCost

__all__ = ["ChunkParts", "share_rank_peaks", "with_first_backward"]


class ChunkParts(NamedTuple):
    """A chunk's memory as its rank's moments combine it: ``state + io + d * sent + max(n * (activation + held)
    + [recompute + transient while its backward runs], optimizer)`` with ``n`` micro-batches in flight and
    ``d`` done ([Note: a rank's chunks])."""

    state: int
    io: int
    activation: int
    held: int
    #: What a finished micro-batch's messages keep until the step ends (its output and its input's gradient).
    sent: int
    recompute: int
    transient: int
    optimizer: int
    #: Autocast's weight copies of one micro-batch in flight ([Note: weight casts]).
    casts: int = 0
    #: The gradients in ``state`` that do not exist before the chunk's first backward (one replica, dropped at
    #: the step's start), and what that backward holds beyond its activations as it makes them ([Note: fresh
    #: gradients] in fresh.py; ``transient`` where none are missing).
    grads: int = 0
    first: int = 0


def with_first_backward(q: ChunkParts, grads: int, fresh_transient: int) -> ChunkParts:
    """``q`` with the gradients missing before the chunk's first backward (``grads``; 0 where replicas' buckets
    or accumulation keep them) and what that backward holds as it makes them ([Note: a chunk's first
    backward])."""
    if not grads:
        return q._replace(first=q.transient)
    return q._replace(grads=grads, first=min(fresh_transient, q.transient + grads))


def share_rank_peaks(
    cfg: Config, stages: tuple[StageCost, ...], tied: Sequence[TiedCopy] = ()
) -> tuple[StageCost, ...]:
    """Each interleaved chunk's share of its rank's peak, at the moment the rank peaks ([Note: a rank's chunks]).
    A tied parameter two chunks of a rank use is one tensor there: the later chunks' copies are left out."""
    s, v = cfg.stages, cfg.chunks
    out = list(_shared_on_rank(stages, s, v, tied))
    for p in range(s):
        chunks = [out[p + c * s] for c in range(v)]
        parts = [sc.parts for sc in chunks if sc.parts is not None]
        if len(parts) < v:
            raise ValueError(f"stage costs of rank {p} lack their parts: not priced for {cfg.schedule}")
        top, moment = -1, ((0,) * v, (0,) * v, 0)
        for held, done, b in interleaved_moments(s, cfg.micro_batches, v, p):
            x = parts[b].recompute + _running(parts[b], done[b])
            for n, d, q in zip(held, done, parts, strict=True):
                x += n * (q.activation + q.held + q.casts) + d * q.sent - (0 if d else q.grads)
            if x > top:
                top, moment = x, (held, done, b)
        held, done, b = moment
        extra = max(0, sum(q.optimizer for q in parts) - top)  # the optimizer step's turn, messages gone
        for c, (sc, q) in enumerate(zip(chunks, parts, strict=True)):
            n, on = held[c], c == b
            act = n * q.activation + (q.recompute if on else 0)
            io = q.io + n * q.held + done[c] * q.sent
            trans = _running(q, done[c]) + extra if on else 0
            missing = 0 if done[c] else q.grads  # [Note: a chunk's first backward]
            out[p + c * s] = replace(
                sc, in_flight=n, activation_bytes=act, io_bytes=io, transient_bytes=trans,
                grad_bytes=sc.grad_bytes - missing,
                buffer_bytes=sc.buffer_bytes + (n - sc.in_flight) * q.casts,
                memory_bytes=q.state - missing + n * q.casts + io + act + trans,
            )  # fmt: skip
    return tuple(out)


def _running(q: ChunkParts, done: int) -> int:
    """What a chunk's backward holds beyond its activations: at its first (``done == 0``), with the gradients it
    makes as it goes ([Note: a chunk's first backward])."""
    return q.transient if done else q.first


def _shared_on_rank(
    stages: tuple[StageCost, ...], s: int, v: int, tied: Sequence[TiedCopy]
) -> tuple[StageCost, ...]:
    """``stages`` with a tied parameter counted once per rank: a chunk whose rank holds it already in an earlier
    chunk (its owner block, or a copy) drops its copy from its state (ALBERT's one layer in every chunk), and its
    owner counts its gradient as there from the start ([Note: a chunk's first backward])."""
    out = list(stages)
    for p in range(s):
        for tc in tied:
            users = [c for c in range(v) if _holds(tc, out[p + c * s])]
            if len(users) < 2:
                continue
            for c in users[1:]:
                sc = out[p + c * s]
                if sc.parts is not None and tc.copied_by(sc.block_start, sc.block_end):
                    drop = tc.param_bytes + tc.grad_bytes + tc.optimizer_bytes
                    out[p + c * s] = replace(
                        sc, param_bytes=sc.param_bytes - tc.param_bytes, grad_bytes=sc.grad_bytes - tc.grad_bytes,
                        optimizer_bytes=sc.optimizer_bytes - tc.optimizer_bytes,
                        parts=sc.parts._replace(state=sc.parts.state - drop),
                    )  # fmt: skip
            sc = out[p + users[0] * s]  # its owner, when on this rank: another chunk may make its gradient first
            if sc.parts is not None and sc.block_start <= tc.owner < sc.block_end:
                out[p + users[0] * s] = replace(
                    sc, parts=sc.parts._replace(grads=max(0, sc.parts.grads - tc.grad_bytes))
                )  # fmt: skip
    return tuple(out)


def _holds(tc: TiedCopy, sc: StageCost) -> bool:
    """Whether the chunk ``sc`` holds the tied parameter: its owner block, or a copy of it."""
    return tc.copied_by(sc.block_start, sc.block_end) or sc.block_start <= tc.owner < sc.block_end
