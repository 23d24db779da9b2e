"""Prefix sums of one profile on one cluster: every interval cost of the planner in O(1)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError
from lightning_autopart.partition.configs import Config, chunk_counts
from lightning_autopart.partition.tied import tied_copies
from lightning_autopart.profile.loader import LoaderCost
from lightning_autopart.profile.optimizers import optimizer_transient_factor
from lightning_autopart.profile.records import BlockProfile, ModelProfile, cost_at

__all__ = ["BackwardPeak", "CostTables", "ForwardPeak", "RangeMax", "SizeTables"]


class RangeMax:
    """The largest of ``values[i:j]`` in O(1) (a sparse table, O(L log L) to build)."""

    def __init__(self, values: list[int]) -> None:
        self._levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = self._levels[-1]
            self._levels.append([max(prev[i], prev[i + width]) for i in range(len(values) - 2 * width + 1)])
            width *= 2

    def __call__(self, i: int, j: int) -> int:
        """``max(values[i:j])`` (0 for an empty range)."""
        if j <= i:
            return 0
        level = (j - i).bit_length() - 1
        row = self._levels[level]
        return max(row[i], row[j - (1 << level)])


@dataclass(frozen=True, slots=True)
class SizeTables:
    """Everything that depends on the micro-batch size ``m``, from the blocks' cost curves.

    ``pf``/``pb``: prefix sums of forward and backward time; ``big``: the largest ``f_k + b_k``; ``acts``:
    prefix sums of saved-activation bytes less ``shared``; ``shared[k]``: bytes block ``k`` saves that block
    ``k - 1`` saves too (see [Note: saved twice]; a stage ``[i, j)`` holds ``acts[j] - acts[i] + shared[i]``);
    ``stage_input[i]``: bytes a stage starting at block ``i`` receives;
    ``cuts[k]``: bytes crossing the cut after block ``k``; ``transient(i, j)``: what a micro-batch's backward through
    blocks ``[i, j)`` holds at most beyond their activations ([Note: backward's peak]), ``fresh_transient(i, j)``
    the same with the gradients the blocks after the running one have made; ``forward(i, j)``: what its forward
    holds at most beyond their activations, the saves of their dead parts, freed before its backward
    (:class:`ForwardPeak`). Per micro-batch, what the pipeline
    holds (see [Note: pipeline buffers] in cost.py):
    ``recv[i]``, the receive buffer of a stage starting at block ``i`` (0 for the first: the batch holds its
    input); ``alias[i]``, the part of it block ``i`` saves; ``send[j]``, the receive buffer of the gradient of a
    stage ending before block ``j`` (0 for the last); ``held[j]``, the part of its output no block saves (0 for
    the last stage, where the loss is priced: the runtime drops the model's outputs once the loss is computed, see
    [Note: the last stage's outputs] in runtime/outputs.py; the model's outputs where it is not); ``passed[j]``,
    per producer ``p`` (ascending), the bytes of that part made by blocks ``<= p``: a stage starting after ``p``
    keeps them as received (:meth:`passed_through`); ``relayed[j]``, the same over the whole cut, saved values
    too: a stage starting after ``p`` sends them as received (:meth:`relayed_through`; none for the last stage,
    which sends no output).
    """

    m: int
    pf: list[float]
    pb: list[float]
    big: float
    acts: list[int]
    shared: list[int]
    stage_input: list[int]
    cuts: list[int]
    transient: BackwardPeak
    fresh_transient: BackwardPeak
    forward: ForwardPeak
    recv: list[int]
    alias: list[int]
    send: list[int]
    held: list[int]
    passed: list[tuple[tuple[int, int], ...]]
    relayed: list[tuple[tuple[int, int], ...]]

    def passed_through(self, i: int, j: int) -> int:
        """Bytes of the output held by a stage of blocks ``[i, j)`` that it received as they are (their storage is
        its receive buffer, or the batch): made before block ``i``, by no block of the stage."""
        return _made_before(self.passed[j], i)

    def relayed_through(self, i: int, j: int) -> int:
        """Bytes of the output a stage of blocks ``[i, j)`` sends that it received as they are, saved or not (at
        least :meth:`passed_through`)."""
        return _made_before(self.relayed[j], i)


def _made_before(by_producer: tuple[tuple[int, int], ...], i: int) -> int:
    """The cumulative bytes of the producers before block ``i`` (``by_producer`` ascending, cumulative)."""
    got = 0
    for p, b in by_producer:
        if p >= i:
            break
        got = b
    return got


class BackwardPeak(RangeMax):
    """``X(i, j) = max over k in [i, j) of (acts[k+1] - grads[k+1] + t_k) - acts[j] + grads[j]``: what a micro-batch's
    backward through blocks ``[i, j)`` holds at most beyond their activations (and weight copies: ``acts``, a
    prefix sum), with the gradients of the blocks after the running one (``grads``: a prefix sum; none without
    it).

    [Note: backward's peak] Backward runs a stage's blocks last to first, and each frees what it saved as it goes,
    so block ``k``'s transient ``t_k`` (its gradients and temporaries) meets the activations of blocks ``i..k``
    only, and, where the step's gradients are made by this backward ([Note: fresh gradients] in fresh.py), the
    gradients of blocks ``k+1..j-1``. The largest transient over all the activations, the bound used before,
    over-predicted a stage whose largest transient comes early: Funnel's first attention, first of two stages,
    1.15 of the measured peak (``bench/pipeline_sweep.py``); counting no gradient there under-predicted a plain
    step whose Mamba scan comes first (Jamba, ``bench/step_peak.py --sweep``: 0.93), as the gradients of all the
    layers after it are made by then."""

    def __init__(self, acts: list[int], transients: list[int], grads: list[int] | None = None) -> None:
        made = grads if grads is not None else [0] * len(acts)
        super().__init__([a - g + t for a, g, t in zip(acts[1:], made[1:], transients, strict=True)])
        self._offset = [g - a for a, g in zip(acts, made, strict=True)]

    def __call__(self, i: int, j: int) -> int:
        return super().__call__(i, j) + self._offset[j] if j > i else 0


class ForwardPeak(RangeMax):
    """``F(i, j)``: what a micro-batch's forward through blocks ``[i, j)`` holds at most beyond their activations
    (``acts``, a prefix sum), from the saves of their dead parts (``dropped``, a prefix sum), which the forward
    holds and its backward never sees ([Note: a dead part's saves] in cost.py): all of them at the forward's end,
    and, while a block that runs no backward (``forward_only``) peaks in its forward (``t_k``), those made before
    it, with the activations of the blocks up to it::

        F(i, j) = max(d(i..j), max over forward-only k in [i, j) of (a(i..k) + d(i..k-1) + t_k) - a(i..j))
    """

    def __init__(self, acts: list[int], dropped: list[int], transients: list[int], forward_only: list[bool]) -> None:
        values = zip(acts[1:], dropped[:-1], transients, forward_only, strict=True)
        super().__init__([a + d + t if only else _NONE_BELOW for a, d, t, only in values])
        self._acts, self._dropped = acts, dropped
        self._any = _prefix([int(only) for only in forward_only])

    def __call__(self, i: int, j: int) -> int:
        if j <= i:
            return 0
        ends = self._dropped[j] - self._dropped[i]
        if self._any[j] == self._any[i]:
            return ends
        top = super().__call__(i, j) - self._acts[j] - self._dropped[i]
        return top if top > ends else ends


#: Below every value of a :class:`ForwardPeak` (blocks that run a backward take no part in its maximum).
_NONE_BELOW = -(1 << 62)


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    acc = 0
    for x in values:
        acc += x
        out.append(acc)
    return out


class CostTables:
    """Prefix sums of one profile on one cluster; the tables of each micro-batch size are built once per size."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, *, persistent_grads: bool = False) -> None:
        if not profile.blocks:
            raise ConfigError("the profile has no blocks; capture the model again (it produced 0 blocks)")
        if profile.batch_size < 1:
            raise ConfigError(f"profile batch_size must be >= 1, got {profile.batch_size}")
        blocks = profile.blocks
        self.profile = profile
        self.cluster = cluster
        self.num_blocks = len(blocks)
        self.b0 = profile.batch_size
        #: Bytes one device may use (memory compares are in exact integers).
        self.usable = self.cap = cluster.usable_memory_bytes
        self.params = _prefix([b.param_bytes for b in blocks])
        self.grads = _prefix([b.grad_bytes for b in blocks])
        self.optim = _prefix([b.optimizer_bytes for b in blocks])
        self.buffers = _prefix([b.buffer_bytes for b in blocks])
        self.counts = _prefix([b.param_count for b in blocks])
        #: What a stage holds through the whole step; autocast's weight copies are apart ([Note: weight casts]).
        self.static = _prefix([b.param_bytes + b.grad_bytes + b.optimizer_bytes + b.buffer_bytes for b in blocks])
        #: Prefix sums of the gradients the loss never reaches ([Note: unreached gradients] in fresh.py).
        self.unreached = _prefix([b.unreached_grad_bytes for b in blocks])
        self._one_replica: tuple[list[int], list[int]] | None = None
        #: Prefix sums of the weight copies one micro-batch's forward makes ("-mixed"), kept until its backward.
        self.casts = _prefix([b.cast_bytes for b in blocks])
        #: Prefix sums of the optimizer step's time (once per step, independent of the micro-batch).
        self.opt_us = _prefix_float([b.optimizer_us for b in blocks])
        #: Prefix sums of one micro-batch's gradient accumulation ([Note: gradient accumulation] in step.py).
        self.acc_us = _prefix_float([b.accumulate_us for b in blocks])
        #: Prefix sums of the blocks' host time per micro-batch, forward and backward, and forward alone (0
        #: unless timed on a device the host feeds ahead of time: [Note: host and device] in cuda_clock.py).
        self.host_fb = _prefix_float([b.host_fwd_us + b.host_bwd_us for b in blocks])
        self.host_f = _prefix_float([b.host_fwd_us for b in blocks])
        #: Bytes the optimizer step allocates per byte of trainable parameters (its transient).
        self.opt_transient = optimizer_transient_factor(profile.optimizer)
        self.tied = tied_copies(profile)
        #: Per block, the gradients its backward makes: a tied weight's by its last user's, which runs first
        #: ([Note: backward's peak]).
        made = [b.grad_bytes - b.unreached_grad_bytes for b in blocks]
        for tc in self.tied:
            last = max(u for u in range(self.num_blocks) if tc.next_user[u] == u)
            made[tc.owner] -= tc.grad_bytes
            made[last] += tc.grad_bytes
        self.made_grads = _prefix(made)
        self.fresh_extra = [b.fresh_extra_bytes for b in blocks]
        #: Gradients live through the whole step (accumulated over steps): none is ever fresh (see
        #: [Note: fresh gradients] in :mod:`.fresh`).
        self.persistent_grads = persistent_grads
        #: Bytes per sample of the batch every rank holds on its device through the step, at least the model's
        #: inputs ([Note: pipeline buffers] in cost.py).
        self.batch_per_sample = max(float(profile.meta.get("batch_bytes") or 0.0), profile.input_bytes / self.b0)
        #: The training loader's time per batch, where it was timed ([Note: loader time] in loader.py).
        self.loader = LoaderCost.from_meta(profile.meta.get("loader"))
        self._sizes: dict[int, SizeTables] = {}
        self._fb: dict[tuple[int, bool], list[float]] = {}
        self._pb_acc: dict[tuple[int, float], list[float]] = {}
        self._mem: dict[tuple[int, int, int, bool], list[int]] = {}
        self._limits: dict[tuple[int, int, int, int], list[int]] = {}
        self._p2p: dict[tuple[int, bool], list[float]] = {}

    def state(self, replicas: int) -> tuple[list[int], list[int]]:
        """Prefix sums of what a stage holds through the step and of its gradients, with ``replicas`` replicas:
        one holds no gradient the loss never reaches ([Note: unreached gradients] in fresh.py)."""
        if replicas > 1 or not self.unreached[-1]:
            return self.static, self.grads
        if self._one_replica is None:
            self._one_replica = (
                [s - u for s, u in zip(self.static, self.unreached, strict=True)],
                [g - u for g, u in zip(self.grads, self.unreached, strict=True)],
            )
        return self._one_replica

    def at(self, m: int) -> SizeTables:
        """The tables of micro-batch size ``m`` (see :class:`SizeTables`)."""
        got = self._sizes.get(m)
        if got is None:
            costs = [cost_at(b, m, self.b0) for b in self.profile.blocks]
            pf, pb = [0.0], [0.0]
            for c in costs:
                pf.append(pf[-1] + c.fwd_us)
                pb.append(pb[-1] + c.bwd_us)
            cuts = [c.cut_bytes for c in costs]
            first = -(-self.profile.input_bytes * m // self.b0)
            blocks = self.profile.blocks
            shared = [0] + [round(blocks[k].saved_by_previous * cuts[k - 1]) for k in range(1, len(costs))]
            inputs = [first, *cuts[:-1]]
            inner = [0, *cuts[:-1], 0]  # what crosses the cut before block j, 0 at the model's two ends
            kept = [0, *(round((1.0 - b.saved_output_share) * c) for b, c in zip(blocks, cuts, strict=True))]
            if self.profile.meta.get("loss_priced"):  # the loss's own saves priced it: the runtime drops the rest
                kept[-1] = 0
            peaks = [c.transient_bytes for c in costs]
            got = SizeTables(
                m=m,
                pf=pf,
                pb=pb,
                big=max(c.fwd_us + c.bwd_us for c in costs),
                acts=(acts := _prefix([max(0, c.activation_bytes - d) for c, d in zip(costs, shared, strict=True)])),
                shared=shared,
                stage_input=inputs,
                cuts=cuts,
                # a block's weight copies go with its activations ([Note: weight casts] in cost.py)
                transient=BackwardPeak(kept_back := [a + c for a, c in zip(acts, self.casts, strict=True)], peaks),
                # with the gradients the running block made by its peak ([Note: gradients made by the peak])
                fresh_transient=BackwardPeak(
                    kept_back, [p + x for p, x in zip(peaks, self.fresh_extra, strict=True)], self.made_grads
                ),
                # the dead parts' saves, in proportion to the batch ([Note: a dead part's saves] in cost.py)
                forward=ForwardPeak(
                    kept_back,
                    _prefix([-(-b.dropped_bytes * m // self.b0) for b in blocks]),
                    peaks,
                    [b.forward_only for b in blocks],
                ),
                recv=[0, *cuts[:-1]],
                # a part of what the block saves, never more (a + q >= 0 per micro-batch in flight)
                alias=[
                    min(round(b.saved_input_share * c), cost.activation_bytes)
                    for b, c, cost in zip(blocks, inputs, costs, strict=True)
                ],
                send=inner,
                held=kept,
                passed=[(), *(_passed(b.passed_shares, c, h) for b, c, h in zip(blocks, cuts, kept[1:], strict=True))],
                # the last stage sends no output: nothing it relays ([Note: pipeline buffers] in cost.py)
                relayed=[(), *(_passed(_merged(b), c, c) for b, c in zip(blocks[:-1], cuts[:-1], strict=True)), ()],
            )
            self._sizes[m] = got
        return got

    def loader_us(self, samples: int) -> tuple[float, float, float]:
        """The loader's share of a step whose replica takes ``samples`` per step: the fetch made by the training
        process (no workers, or workers sharing the cores of a host that does the math), the share of steps
        that start with the device idle (after a read back: 1 on such a host), and the least the step may take
        (its workers' pace); zeros where it was not timed ([Note: loader in the step] in cost.py)."""
        if self.loader is None:
            return 0.0, 1.0, 0.0
        fetch = self.loader.fetch_us(samples)
        if not self.cluster.async_host:
            return fetch, 1.0, 0.0
        if self.loader.workers:
            return 0.0, 1.0, fetch / self.loader.workers
        every = self.loader.readback_every
        return fetch, 1.0 / every if every > 0 else 0.0, 0.0

    def times(self, m: int) -> tuple[list[float], list[float], float]:
        """Prefix sums of forward and backward time at ``m`` samples, and the largest ``f_k + b_k``."""
        at = self.at(m)
        return at.pf, at.pb, at.big

    def accumulating_pb(self, m: int, share: float) -> list[float]:
        """Prefix sums of a micro-batch's backward at size ``m`` with ``share`` of the gradients' accumulation
        added (see [Note: gradient accumulation] in step.py)."""
        pb = self.at(m).pb
        if share <= 0.0 or not self.acc_us[-1]:
            return pb
        got = self._pb_acc.get((m, share))
        if got is None:
            got = self._pb_acc[(m, share)] = [b + share * a for b, a in zip(pb, self.acc_us, strict=True)]
        return got

    def fb_prefix(self, m: int, recompute: bool = False) -> list[float]:
        """Prefix sums of ``f_k + b_k`` at ``m`` samples, or of ``2 f_k + b_k`` with ``recompute``."""
        got = self._fb.get((m, recompute))
        if got is None:
            pf, pb, _ = self.times(m)
            k = 2 if recompute else 1
            got = [k * f + b for f, b in zip(pf, pb, strict=True)]
            self._fb[(m, recompute)] = got
        return got

    def limits(self, cfg: Config, m: int) -> list[int]:
        """Per virtual stage: the bytes it may use, a share of its rank's device.

        [Note: chunk shares] The DP judges each stage alone, so an interleaved rank's device is split among its
        chunks before the partition is known; the shares add up to the device, so chunks that fit their shares
        fit together. The search tries two splits (``Config.shares``): ``even``, and ``in-flight``, in
        proportion to what an average stage's state and messages plus its chunk's most micro-batches in flight
        times an average stage's activations would hold, the batch on the first chunk. A rank's first chunk holds the most micro-batches (8 to
        the second's 1 on an 8-rank pipeline's last rank, [Note: interleaved in flight]) and gets the larger
        share there; a last chunk holding a large head (a tied embedding's copy) may need the even split. One
        chunk per rank: the whole device.
        """
        v, s, mb = cfg.chunks, cfg.stages, cfg.micro_batches
        if v == 1:
            return [self.cap] * s
        if cfg.shares == "even":
            return [self.cap // v] * (s * v)
        got = self._limits.get((s, mb, v, m))
        if got is None:
            at, nv = self.at(m), s * v
            inner = at.cuts[:-1]
            base = self.static[-1] / nv + 2 * cfg.messages * (sum(inner) / len(inner) if inner else 0.0)
            act = at.acts[-1] / nv
            got = [0] * nv
            whole = self.batch_bytes(m, mb)  # a rank's first chunk holds it
            for p, counts in enumerate(chunk_counts(s, mb, v)):
                want = [base + n * act + (whole if c == 0 else 0.0) for c, n in enumerate(counts)]
                total = sum(want)
                given = 0
                for c in range(v - 1):
                    got[p + c * s] = share = int(self.cap * want[c] / total) if total > 0 else self.cap // v
                    given += share
                got[p + (v - 1) * s] = self.cap - given
            self._limits[(s, mb, v, m)] = got
        return got

    def batch_bytes(self, m: int, mb: int) -> int:
        """A replica's batch of ``mb`` micro-batches of ``m`` samples on its device: at least every micro-batch's
        input ([Note: pipeline buffers] in cost.py)."""
        return max(int(self.batch_per_sample * m * mb), mb * self.at(m).stage_input[0])

    def memory_prefix(self, m: int, v: int, held: int, fresh: bool = False) -> list[int]:
        """Prefix sums of ``v * (static + held * activation_bytes(m))``: a chunk's memory, ``held`` micro-batches
        of activations in flight (transients not included: a lower bound of the stage's memory); with
        ``fresh``, less the gradients, which a fresh stage may not hold at its peak (a lower bound still)."""
        got = self._mem.get((m, v, held, fresh))
        if got is None:
            acts = self.at(m).acts
            static, grads = self.state(1)  # the least any replica count holds
            state = [s - g for s, g in zip(static, grads, strict=True)] if fresh else static
            got = self._mem[(m, v, held, fresh)] = [v * (s + held * a) for s, a in zip(state, acts, strict=True)]
        return got

    def p2p(self, m: int, intra: bool) -> list[float]:
        """``x[j]``: time to send the cut before block j at ``m`` samples (0 at j = 0 and j = L)."""
        got = self._p2p.get((m, intra))
        if got is None:
            c = self.cluster
            bw = c.intra_node_bw if intra else c.inter_node_bw
            lat = c.latency_us
            got = [0.0] + [cut / bw * 1e6 + lat for cut in self.at(m).cuts[:-1]] + [0.0]
            self._p2p[(m, intra)] = got
        return got

    def tied_extra(self, i: int, j: int) -> tuple[int, int, int, int]:
        """(param, grad, optimizer bytes, param count) of tied copies held by a stage of blocks ``[i, j)``."""
        p = g = o = n = 0
        for t in self.tied:
            if t.copied_by(i, j):
                p += t.param_bytes
                g += t.grad_bytes
                o += t.optimizer_bytes
                n += t.param_count
        return p, g, o, n

    def tied_optimizer_us(self, i: int, j: int) -> float:
        """Optimizer step time of the tied copies a stage of blocks ``[i, j)`` holds."""
        return sum(t.optimizer_us for t in self.tied if t.copied_by(i, j))


def _passed(shares: tuple[tuple[int, float], ...], cut: int, held: int) -> tuple[tuple[int, int], ...]:
    """``(p, bytes made by blocks <= p)`` of a cut's part that passes through, never more than the held part."""
    out, total = [], 0.0
    for p, share in shares:
        total += share
        out.append((p, min(held, round(total * cut))))
    return tuple(out)


def _merged(block: BlockProfile) -> tuple[tuple[int, float], ...]:
    """A block's passed shares, saved or not, per producer (ascending)."""
    by: dict[int, float] = {}
    for p, share in (*block.passed_shares, *block.saved_passed_shares):
        by[p] = by.get(p, 0.0) + share
    return tuple(sorted(by.items()))


def _prefix_float(values: list[float]) -> list[float]:
    out = [0.0]
    for x in values:
        out.append(out[-1] + x)
    return out
