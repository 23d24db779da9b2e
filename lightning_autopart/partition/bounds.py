"""Lower bounds of one configuration that the DP (:mod:`.dp`) and the search (:mod:`.search`) prune with: a
necessary condition for a stage's term ``<= tau`` and memory feasibility, monotone under interval containment."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import pairwise

from lightning_autopart.partition.cost import INF, Config, CostTables, in_flight
from lightning_autopart.partition.fresh import fresh_stages

__all__ = ["Relaxation"]

#: Relative slack for the floating-point relaxations (they only prune, never decide the optimum).
_SLACK = 1e-9


class Relaxation:
    """Monotone lower bounds of one configuration, valid for every layout (and the split of ``cfg.shares``).

    With ``n`` the in-flight micro-batches of the stage's place in the pipeline (its position and chunk; no
    layout changes it) and ``c0`` the smallest stage input, a stage of blocks ``[i, j)`` with term ``w <= tau``
    lies in one of two families:

    - plain: ``static + n*sum a_k <= limit`` and ``K*(F + Bw + h0) + v*(a_min + O) + H <= tau``;
    - checkpointed: ``static + sum a_k + n*c0 <= limit`` and ``K*(2F + Bw + h0) + v*(a_min + O) + H <= tau``;

    where ``h0`` is the micro-batch's host time where it adds to the math (0 where it may hide behind it),
    ``H`` the step's host time, ``a_min`` the all-reduce at the best bandwidth the replica count allows
    (backward's transient, a range maximum, is left out: the bounds stay lower bounds). Every quantity is a prefix difference
    (``pm_off`` per ``n``/``pm_on`` for memory, ``pr_off``/``pr_on`` for time, ``R = scale*diff + const``), so each family
    is monotone under interval containment, and so is their union.
    """

    def __init__(self, tables: CostTables, cfg: Config, batch_size: int, checkpointing: bool = True) -> None:
        cl = tables.cluster
        r, v, kk = cfg.replicas, cfg.chunks, cfg.ticks
        m = batch_size // (r * cfg.micro_batches)
        at = tables.at(m)
        fb = tables.fb_prefix(m)
        #: Per virtual stage: its micro-batches in flight (a stage's own, so bounds stay tight at every position).
        self.counts = [
            in_flight(cfg.schedule, cfg.stages, k % cfg.stages, cfg.micro_batches, k // cfg.stages)
            for k in range(cfg.virtual_stages)
        ]
        # gradients left out of the bounds where any stage may lack them
        fresh = any(fresh_stages(tables, cfg))
        #: One micro-batch of activations: the bound used for the memory objective of :func:`solve_memory`.
        self.pm = tables.memory_prefix(m, v, 1, fresh)
        c0 = min(at.stage_input)
        self._pm_off = {n: tables.memory_prefix(m, v, n, fresh) for n in set(self.counts)}
        # The messages a stage keeps, at least every inner cut's smallest: ``(msg - M) c`` received (a
        # stage's saved inputs are views of its M receive buffers) and ``msg c`` for gradients, inside a pipeline.
        msg, mb, nv = cfg.messages, cfg.micro_batches, cfg.virtual_stages
        cut = min(at.cuts[:-1]) if len(at.cuts) > 1 else 0
        #: Per stage: room for the plain family (``static + n a``) and the checkpointed one (``static + a``), in
        #: the prefixes' units (``v`` bytes each: ``v * memory <= v * limit``).
        self._cap_off: list[int] = []
        self._cap_on: list[int] = []
        limits = tables.limits(cfg, m)  # the split of cfg.shares: one relaxation per split
        #: The largest stage's room, for the memory objective of :func:`solve_memory` (a lower bound still).
        self.cap = v * max(limits)
        for k, n in enumerate(self.counts):
            send = msg * cut if k < nv - 1 else 0
            recv = cut if k > 0 else 0
            room = v * limits[k]
            self._cap_off.append(room - v * ((msg - mb) * recv + send))
            self._cap_on.append(room - v * (n * c0 + (msg - n) * recv + send) if checkpointing else -1)
        self.ck = max(self._cap_on) >= 0
        f2b = tables.fb_prefix(m, recompute=True) if self.ck else fb
        opt = tables.opt_us
        if r > 1:
            bw = (
                cl.inter_allreduce_bw
                if r > cl.devices_per_node
                else max(cl.intra_allreduce_bw, cl.inter_allreduce_bw)
            )
            coef = v * (2 * (r - 1) / r / bw * 1e6)
            self.const = v * (2 * (r - 1) * cl.latency_us)
            gr = tables.grads
            self.pr = [kk * a + coef * g + v * o for a, g, o in zip(fb, gr, opt, strict=True)]
            self.pr_on = (
                [kk * a + coef * g + v * o for a, g, o in zip(f2b, gr, opt, strict=True)]
                if self.ck
                else self.pr
            )
        else:
            self.const = 0.0
            self.pr = [kk * a + v * o for a, o in zip(fb, opt, strict=True)]
            self.pr_on = [kk * a + v * o for a, o in zip(f2b, opt, strict=True)] if self.ck else self.pr
        # Host overheads: the step's, and where the host does the math the micro-batches' (w only grows by them).
        self.const += cl.step_host_us + (
            kk * 2 * cl.action_us if cfg.pipelined and not cl.async_host else 0.0
        )
        self.scale = 1.0
        self.num_blocks = tables.num_blocks
        self.num_stages = cfg.virtual_stages

    def room(self, tau: float) -> float:
        """Largest ``pr`` difference a stage may span when every stage must be ``<= tau``."""
        if tau == INF:
            return INF
        return (tau + _SLACK * (abs(tau) + self.scale * self.pr_on[-1]) - self.const) / self.scale

    def reach(self, i: int, room: float, k: int) -> int:
        """Farthest end ``j`` such that blocks ``[i, j)`` as stage ``k`` are in either family (``room`` from
        :meth:`room`)."""
        pm, pr = self._pm_off[self.counts[k]], self.pr
        j = bisect_right(pm, pm[i] + self._cap_off[k]) - 1
        if room < INF:
            j = min(j, bisect_right(pr, pr[i] + room) - 1)
        cap_on = self._cap_on[k]
        if cap_on >= 0:
            pm, pr = self.pm, self.pr_on
            j2 = bisect_right(pm, pm[i] + cap_on) - 1
            if room < INF:
                j2 = min(j2, bisect_right(pr, pr[i] + room) - 1)
            j = max(j, j2)
        return j

    def start(self, j: int, room: float, k: int) -> int:
        """Smallest start ``i`` such that blocks ``[i, j)`` as stage ``k`` are in either family."""
        pm, pr = self._pm_off[self.counts[k]], self.pr
        i = bisect_left(pm, pm[j] - self._cap_off[k])
        if room < INF:
            i = max(i, bisect_left(pr, pr[j] - room))
        cap_on = self._cap_on[k]
        if cap_on >= 0:
            pm, pr = self.pm, self.pr_on
            i2 = bisect_left(pm, pm[j] - cap_on)
            if room < INF:
                i2 = max(i2, bisect_left(pr, pr[j] - room))
            i = min(i, i2)
        return i

    def bands(self, tau: float) -> list[tuple[int, int]] | None:
        """Where each boundary of a partition with every stage ``<= tau`` can lie; None when nowhere."""
        n, nv = self.num_blocks, self.num_stages
        room = self.room(tau)
        if room < 0:
            return None
        hi = [0] * (nv + 1)
        pos = 0
        for s in range(1, nv + 1):
            # Stages hold different micro-batches in flight, so a stage may not reach past the farthest end of
            # the one before (the stage before can end earlier): only a stage that cannot end at all fails.
            j = min(n - (nv - s), self.reach(pos, room, s - 1))
            if j < s:
                return None
            hi[s] = pos = j
        if pos < n:
            return None
        lo = [0] * (nv + 1)
        lo[nv] = pos = n
        for s in range(nv - 1, -1, -1):
            i = max(s, self.start(pos, room, s))
            if i > n - (nv - s):
                return None
            lo[s] = pos = i
        if pos > 0:
            return None
        bands = [(max(s, lo[s]), min(n - (nv - s), hi[s])) for s in range(nv + 1)]
        if any(a > b for a, b in bands):
            return None
        return bands

    def greedy(self, tau: float) -> tuple[int, ...] | None:
        """Boundaries of the greedy farthest-reaching partition with every ``R <= tau``; None if none, or if a
        stage could not reach past the one before (the farthest ends of the bands then do not rise: a stage of
        no blocks)."""
        bands = self.bands(tau)
        if bands is None:
            return None
        part = tuple(b for _, b in bands)
        return part if all(a < b for a, b in pairwise(part)) else None

    def memory_greedy(self, limit: int) -> tuple[int, ...] | None:
        """Greedy farthest-reaching partition with every relaxed memory (scaled) ``<= limit``; None if none."""
        n, nv, pm = self.num_blocks, self.num_stages, self.pm
        bounds = [0]
        pos = 0
        for s in range(1, nv + 1):
            j = min(n - (nv - s), bisect_right(pm, pm[pos] + limit) - 1)
            if j <= pos:
                return None
            bounds.append(j)
            pos = j
        return tuple(bounds) if pos == n else None

    def memory_lower_bound(self, rel: float = 1e-3) -> tuple[float, tuple[int, ...]]:
        """A lower bound on the smallest largest ``memory / limit`` and the greedy partition near it."""
        pm = self.pm
        lo = max(b - a for a, b in pairwise(pm)) - 1
        hi = pm[-1]
        part = self.memory_greedy(hi)
        assert part is not None
        while hi - lo > max(1, int(rel * hi)):
            mid = (lo + hi) // 2
            got = self.memory_greedy(mid)
            if got is None:
                lo = mid
            else:
                hi, part = mid, got
        return lo / max(1, self.cap), part  # a limit under a byte: an interleaved share of a tiny device

    def lower_bound(self, upper: float = INF, rel: float = 1e-4) -> tuple[float, tuple[int, ...] | None]:
        """Bisect the smallest ``tau`` the relaxation admits (a lower bound) and the greedy partition there."""
        if upper == INF:
            upper = self.scale * self.pr_on[-1] + self.const + 1.0
        if self.bands(upper) is None:
            return upper, None
        lo, hi = 0.0, upper
        while hi - lo > rel * hi:
            mid = 0.5 * (lo + hi)
            if self.bands(mid) is None:
                lo = mid
            else:
                hi = mid
        return lo, self.greedy(hi) or self.greedy(upper)
