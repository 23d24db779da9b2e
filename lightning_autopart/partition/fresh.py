"""What a stage's backward peak adds beyond its micro-batches in flight: the gradients that do not exist yet at
its activations' peak, and the input gradients of earlier micro-batches still held for their sends.

[Note: fresh gradients] ``fresh`` holds for a stage whose gradients do not exist while it holds its
activations at their peak: one replica (replicas keep persistent all-reduce buckets), one chunk, gradients
dropped at the step's start (no accumulation over steps), and every micro-batch in flight at once
(``in_flight == M``: GPipe, or 1F1B with M <= S - p; a single stage runs one micro-batch at a time, so only
M = 1). Its first backward then starts without gradients and makes them as it goes: block ``k``'s meets those of
the blocks after it (``M u + X_f``, ``X_f`` the :class:`~.tables.BackwardPeak` with the gradients each block's
backward makes, a tied weight's by its last user's); later backwards hold them all, one micro-batch fewer
(``(M - 1) u + X + grads``). With a single stage the forward's end with last step's gradients (``M u + grads``)
is a third moment: plain Lightning zeroes them after the forward, before backward. The peak is the largest of
the three (:func:`fresh_excess`, less the gradients the state counts). The larger of the last two, taken as
``M u + max x_k - min(u, grads)``, took the predicted peak of a GPT-2 and a Llama in bf16-mixed on an H100 from
1.14 and 1.10 to 1.08 and 1.03 of the measured one; the three moments took a plain step whose Mamba scan comes
first (Jamba) from 1.020 to 0.986, and a GPT-2's GPipe last stage, whose tied head's gradient its first backward
makes, from 0.924 to 0.933. A pipelined step drops them before its first forward (the strategy's
``training_step``), so there the forward's end holds none. An interleaved rank's chunks are priced moment by
moment instead ([Note: a chunk's first backward] in ranks.py).

[Note: input gradients in flight] A stage after the first sends each micro-batch's input gradients back (every
value of the cut before it, a zero for a value that needs none: [Note: wire format] in runtime/wire.py), and
torch's schedules hold them past the next backward: 1F1B keeps one micro-batch's send until that backward is
done, GPipe all of them until the step's end. So a later backward meets ``r`` (``recv_i``) more with ``n``
micro-batches in flight (1F1B, ``n < M``), or ``r`` more with one micro-batch fewer (``n = M``), and GPipe's
``k``-th backward ``k r`` more with ``k`` fewer (:func:`sent_back`). ViT-MAE's images reach its loss through
every stage, so their zero gradients do too: its 1F1B last rank read 0.923 of the measured peak, 1.00 since. A
fresh stage's first backward holds no earlier send: they belong to its later backwards' moment only
(``fresh_excess``'s ``back``), which has one micro-batch fewer already, so there 1F1B adds ``r`` and GPipe's
``k``-th ``r + (k - 1)(r - u)``.

[Note: unreached gradients] A parameter that only blocks with every output dead use (a head whose output the
loss never reads) never gets a gradient: a single replica never allocates one for it, and the optimizer keeps no
state for it. Replicas do hold it: their all-reduce buckets are flat buffers over every trainable parameter
(runtime/buckets.py). So :meth:`~.tables.CostTables.state` gives one replica the state and gradients less
``BlockProfile.unreached_grad_bytes``, and the bounds use that smaller one. A SigLIP vision model, whose pooling
head the loss on its last hidden state never reaches, read 1.17 of its measured plain step's peak before.
"""

from __future__ import annotations

from lightning_autopart.partition.configs import Config, in_flight
from lightning_autopart.partition.tables import CostTables

__all__ = ["fresh_excess", "fresh_excesses", "fresh_stages", "sent_back", "sent_backs"]


def fresh_stages(tables: CostTables, cfg: Config) -> list[bool]:
    """Per pipeline position: whether its gradients do not exist at its activations' peak ([Note: fresh
    gradients])."""
    if cfg.replicas > 1 or cfg.chunks > 1 or tables.persistent_grads:
        return [False] * cfg.stages
    mb = cfg.micro_batches
    return [in_flight(cfg.schedule, cfg.stages, p, mb) == mb for p in range(cfg.stages)]


def fresh_excess(x: int, xf: int, grads: int, lead: int, prev: int, later: bool, back: int = 0) -> int:
    """What a fresh stage's peak adds to its micro-batches in flight (their units, one of them whole), less its
    gradients, which its state counts ([Note: fresh gradients]): the largest of the forward's end (``lead``), its
    first backward (``xf``: the gradients of the blocks after the running one made) and, where ``later``
    backwards run, the later ones (``x`` and every gradient, one micro-batch of ``prev`` gone, and ``back``: the
    input gradients still held for their sends, [Note: input gradients in flight])."""
    top = lead if lead > xf else xf
    if later and x + grads - prev + back > top:
        top = x + grads - prev + back
    return top - grads


def fresh_excesses(
    x: int,
    xf: int,
    grads: int,
    capped: bool,
    unit: int,
    stage_input: int,
    later: bool,
    backs: tuple[int, int],
    dropped: int = 0,
) -> tuple[int, int]:
    """:func:`fresh_excess` without and with checkpointing, for a stage whose micro-batch unit is ``unit`` and
    whose checkpointed unit is ``stage_input``; ``capped``: a single stage, whose forward's end holds last step's
    gradients; ``backs``: :func:`sent_backs` of a fresh stage; ``dropped``: what the forward's end holds of its
    dead parts' saves, not kept where checkpointed ([Note: a dead part's saves] in cost.py)."""
    lead = grads if capped else 0
    return (
        fresh_excess(x, xf, grads, lead + dropped, unit, later, backs[0]),
        fresh_excess(x, xf, grads, lead - unit, stage_input, later, backs[1]),
    )


def sent_back(r: int, unit: int, in_flight: int, mb: int, gpipe: bool, fresh: bool = False) -> int:
    """What a later backward adds to a stage's peak for the input gradients (``r`` per micro-batch) its schedule
    still holds for their sends, where a finished micro-batch frees ``unit`` ([Note: input gradients in
    flight]); for a ``fresh`` stage, over its second backward's moment (one micro-batch gone, every gradient
    made) instead of its first."""
    if r <= 0 or mb < 2:
        return 0
    grow = r - unit if r > unit else 0
    if fresh:
        return r + (mb - 2) * grow if gpipe else r
    if gpipe:
        return (mb - 1) * grow
    if in_flight < mb:
        return r
    return grow


def sent_backs(
    r: int, unit: int, kept_out: int, stage_input: int, in_flight: int, mb: int, gpipe: bool, fresh: bool = False
) -> tuple[int, int]:
    """:func:`sent_back` without and with checkpointing: a finished micro-batch frees ``unit`` (its activations,
    casts and kept output less what its input shares), or only its kept output beyond its checkpointed input."""
    return (
        sent_back(r, unit, in_flight, mb, gpipe, fresh),
        sent_back(r, max(0, kept_out - stage_input), in_flight, mb, gpipe, fresh),
    )
