"""Stages whose gradients do not exist at their activations' peak, and what that peak then adds.

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
``training_step``), so there the forward's end holds none.

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

__all__ = ["fresh_excess", "fresh_excesses", "fresh_stages"]


def fresh_stages(tables: CostTables, cfg: Config) -> list[bool]:
    """Per pipeline position: whether its gradients do not exist at its activations' peak ([Note: fresh
    gradients])."""
    if cfg.replicas > 1 or cfg.chunks > 1 or tables.persistent_grads:
        return [False] * cfg.stages
    mb = cfg.micro_batches
    return [in_flight(cfg.schedule, cfg.stages, p, mb) == mb for p in range(cfg.stages)]


def fresh_excess(x: int, xf: int, grads: int, lead: int, prev: int, later: bool) -> int:
    """What a fresh stage's peak adds to its micro-batches in flight (their units, one of them whole), less its
    gradients, which its state counts ([Note: fresh gradients]): the largest of the forward's end (``lead``), its
    first backward (``xf``: the gradients of the blocks after the running one made) and, where ``later``
    backwards run, the second (``x`` and every gradient, one micro-batch of ``prev`` gone)."""
    top = lead if lead > xf else xf
    if later and x + grads - prev > top:
        top = x + grads - prev
    return top - grads


def fresh_excesses(
    x: int, xf: int, grads: int, capped: bool, unit: int, stage_input: int, later: bool
) -> tuple[int, int]:
    """:func:`fresh_excess` without and with checkpointing, for a stage whose micro-batch unit is ``unit`` and
    whose checkpointed unit is ``stage_input``; ``capped``: a single stage, whose forward's end holds last step's
    gradients."""
    lead = grads if capped else 0
    return (
        fresh_excess(x, xf, grads, lead, unit, later),
        fresh_excess(x, xf, grads, lead - unit, stage_input, later),
    )
