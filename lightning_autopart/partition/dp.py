"""Exact dynamic program over contiguous partitions of the blocks into the V stages of one configuration.

Tables (``k`` = virtual stage, ``j`` = blocks covered so far; :mod:`.cost` defines ``w_k(i, j)``)::

    best[0][0] = 0
    best[k][j] = min over i < j of max(best[k-1][i], w_{k-1}(i, j))   for stages holding blocks [i, j)
    arg[k][j]  = the minimising i;   answer = best[V][L], partition by following arg back from (V, L)

``w`` is infinite where the stage does not fit in memory, and depends on the stage index (in-flight
micro-batches, links), which is part of the state, so the recurrence is exact for the min-max objective.
Only values ``<= tau`` (the incumbent of the outer search) are of interest, which licenses three prunings
that never discard a partition of value ``<= tau``:

1. Bands. :class:`Relaxation` gives, for every stage, a necessary condition for ``w <= tau`` and memory
   feasibility that is monotone under interval containment (a union of two prefix-sum families: plain, and
   checkpointed with the recompute charged). Greedy farthest-reaching from the left (and from the right) then
   bounds where boundary ``k`` can lie in any partition of value ``<= tau``: ``b_k`` in
   ``[max(k, h_k), min(L - (V - k), g_k)]`` (exchange argument: if ``b_{k-1} <= g_{k-1}`` then
   ``[g_{k-1}, b_k)`` is inside ``[b_{k-1}, b_k)``, so it also passes and ``b_k <= g_k``). An empty band
   proves the configuration cannot reach ``tau`` in O(V log L).
2. Windows. For each ``j``, ``i`` starts at the smallest index passing the relaxation (bisection).
3. Early exit. Scanning ``i`` downwards, ``K*(F + Bw)`` only grows, so the scan stops once it exceeds the
   best value found for ``(k, j)``; states with ``best[k-1][i]`` above that value, or unreachable, are
   skipped, and stage ``k+1`` only starts from boundaries stage ``k`` actually reached (none: stop early).

Complexity: O(V log L) for the bands, then O(sum over k of |band_k| * window_k) interval evaluations, each
O(1) (+ O(#tied) with tied parameters) thanks to prefix sums; worst case O(V L^2) when ``tau`` is infinite.
With a tight ``tau`` the bands are about ``V * slack / mean block cost`` wide, so near-optimal incumbents make
the DP almost linear in L.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import pairwise

from lightning_autopart.partition.cost import INF, Config, ConfigCosts, CostTables, fresh_stages, in_flight

__all__ = ["Budget", "Relaxation", "solve", "solve_memory"]

#: Relative slack for the floating-point relaxations (they only prune, never decide the optimum).
_SLACK = 1e-9
_HUGE = 1e300


class Relaxation:
    """Monotone lower bounds of one configuration, valid for every layout and stage position.

    With ``n0`` the fewest in-flight micro-batches of any position and ``c0`` the smallest stage input, a stage
    of blocks ``[i, j)`` with term ``w <= tau`` lies in one of two families:

    - plain: ``static + n0*sum a_k <= limit`` and ``K*(F + Bw + h0) + v*(a_min + O) + H <= tau``;
    - checkpointed: ``static + sum a_k + n0*c0 <= limit`` and ``K*(2F + Bw + h0) + v*(a_min + O) + H <= tau``;

    where ``h0`` is the micro-batch's host time where it adds to the math (0 where it may hide behind it),
    ``H`` the step's host time, ``a_min`` the all-reduce at the best bandwidth the replica count allows
    (backward's transient, a range maximum, is left out: the bounds stay lower bounds). Every quantity is a prefix difference
    (``pm_off``/``pm_on`` for memory, ``pr_off``/``pr_on`` for time, ``R = scale*diff + const``), so each family
    is monotone under interval containment, and so is their union.
    """

    def __init__(self, tables: CostTables, cfg: Config, batch_size: int, checkpointing: bool = True) -> None:
        cl = tables.cluster
        r, v, kk = cfg.replicas, cfg.chunks, cfg.ticks
        m = batch_size // (r * cfg.micro_batches)
        at = tables.at(m)
        fb = tables.fb_prefix(m)
        n0 = min(in_flight(cfg.schedule, cfg.stages, p, cfg.micro_batches) for p in (0, cfg.stages - 1))
        self.cap = tables.cap
        #: One micro-batch of activations: the bound used for the memory objective of :func:`solve_memory`.
        fresh = any(fresh_stages(tables, cfg))  # gradients left out of the bounds where any stage may lack them
        self.pm = tables.memory_prefix(m, v, 1, fresh)
        self.pm_off = tables.memory_prefix(m, v, n0, fresh)
        self.cap_on = self.cap - v * n0 * min(at.stage_input) if checkpointing else -1
        self.ck = self.cap_on >= 0
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
                [kk * a + coef * g + v * o for a, g, o in zip(f2b, gr, opt, strict=True)] if self.ck else self.pr
            )
        else:
            self.const = 0.0
            self.pr = [kk * a + v * o for a, o in zip(fb, opt, strict=True)]
            self.pr_on = [kk * a + v * o for a, o in zip(f2b, opt, strict=True)] if self.ck else self.pr
        # Host overheads: the step's, and where the host does the math the micro-batches' (w only grows by them).
        self.const += cl.step_host_us + (kk * 2 * cl.action_us if cfg.pipelined and not cl.async_host else 0.0)
        self.scale = 1.0
        self.num_blocks = tables.num_blocks
        self.num_stages = cfg.virtual_stages

    def room(self, tau: float) -> float:
        """Largest ``pr`` difference a stage may span when every stage must be ``<= tau``."""
        if tau == INF:
            return INF
        return (tau + _SLACK * (abs(tau) + self.scale * self.pr_on[-1]) - self.const) / self.scale

    def reach(self, i: int, room: float) -> int:
        """Farthest end ``j`` such that blocks ``[i, j)`` are in either family (``room`` from :meth:`room`)."""
        pm, pr = self.pm_off, self.pr
        j = bisect_right(pm, pm[i] + self.cap) - 1
        if room < INF:
            j = min(j, bisect_right(pr, pr[i] + room) - 1)
        if self.ck:
            pm, pr = self.pm, self.pr_on
            j2 = bisect_right(pm, pm[i] + self.cap_on) - 1
            if room < INF:
                j2 = min(j2, bisect_right(pr, pr[i] + room) - 1)
            j = max(j, j2)
        return j

    def start(self, j: int, room: float) -> int:
        """Smallest start ``i`` such that blocks ``[i, j)`` are in either family."""
        pm, pr = self.pm_off, self.pr
        i = bisect_left(pm, pm[j] - self.cap)
        if room < INF:
            i = max(i, bisect_left(pr, pr[j] - room))
        if self.ck:
            pm, pr = self.pm, self.pr_on
            i2 = bisect_left(pm, pm[j] - self.cap_on)
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
            j = min(n - (nv - s), self.reach(pos, room))
            if j <= pos:
                return None
            hi[s] = pos = j
        if pos < n:
            return None
        lo = [0] * (nv + 1)
        lo[nv] = pos = n
        for s in range(nv - 1, -1, -1):
            i = max(s, self.start(pos, room))
            if i >= pos:
                return None
            lo[s] = pos = i
        if pos > 0:
            return None
        bands = [(max(s, lo[s]), min(n - (nv - s), hi[s])) for s in range(nv + 1)]
        if any(a > b for a, b in bands):
            return None
        return bands

    def greedy(self, tau: float) -> tuple[int, ...] | None:
        """Boundaries of the greedy farthest-reaching partition with every ``R <= tau``; None if none."""
        bands = self.bands(tau)
        if bands is None:
            return None
        return tuple(b for _, b in bands)

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
        return lo / self.cap, part

    def lower_bound(self, upper: float = INF, rel: float = 1e-4) -> tuple[float, tuple[int, ...] | None]:
        """Bisect the smallest ``tau`` the relaxation admits (a lower bound) and the greedy partition there."""
        if upper == INF:
            upper = self.scale * self.pr_on[-1] + self.const + 1.0
        part = self.greedy(upper)
        if part is None:
            return upper, None
        lo, hi = 0.0, upper
        while hi - lo > rel * hi:
            mid = 0.5 * (lo + hi)
            got = self.greedy(mid)
            if got is None:
                lo = mid
            else:
                hi, part = mid, got
        return lo, part


def solve(
    tables: CostTables, cc: ConfigCosts, tau: float = INF, relax: Relaxation | None = None
) -> tuple[float, tuple[int, ...]] | None:
    """Minimum over partitions of ``max_k w_k`` among those ``<= tau``, and its boundaries; None if none."""
    if relax is None:
        relax = Relaxation(tables, cc.cfg, cc.m * cc.cfg.replicas * cc.cfg.micro_batches, cc.checkpointing)
    bands = relax.bands(tau)
    if bands is None:
        return None
    n, nv = tables.num_blocks, cc.cfg.virtual_stages
    start, room, cap = relax.start, relax.room(tau), tables.cap
    at = cc.at
    pf, pb, ps, pa, pg, po_ = cc.pf, cc.pb, tables.static, at.acts, tables.grads, tables.opt_us
    sh = at.shared
    cin, trans, yf = at.stage_input, at.transient, tables.opt_transient
    tied = tables.tied
    kk, v, ck = cc.ticks, cc.v, cc.checkpointing
    host, adds, stp = cc.host, cc.host_adds, cc.step_host
    multi = cc.cfg.replicas > 1
    # The largest finite value a cell may take: unreachable states (INF) then fail ``pv > lim`` at once.
    top = tau if tau < INF else _HUGE
    prev = [INF] * (n + 1)
    prev[0] = 0.0
    args: list[list[int]] = []
    for s in range(1, nv + 1):
        k = s - 1
        jlo, jhi = bands[s]
        plo, phi = bands[s - 1]
        infl, fresh = cc.in_flight[k], cc.fresh[k]
        pin, pout = cc.p2p_in[k], cc.p2p_out[k]
        coef, cst = cc.ar_coef[k], cc.ar_const[k]
        cur = [INF] * (n + 1)
        arg = [-1] * (n + 1)
        first = last = -1
        for j in range(jlo, jhi + 1):
            pfj, pbj, psj, paj, pgj, po, ooj = pf[j], pb[j], ps[j], pa[j], pg[j], pout[j], po_[j]
            ilo = max(plo, start(j, room))
            lim, best, bi = top, INF, -1
            for i in range(min(j - 1, phi), ilo - 1, -1):
                pv = prev[i]
                if pv > lim:
                    continue
                f = pfj - pf[i]
                fb = f + (pbj - pb[i])
                if kk * fb > lim:
                    break
                st = psj - ps[i]
                gr = pgj - pg[i]
                opt = ooj - po_[i]
                if tied:
                    for tc in tied:
                        if i > tc.owner and tc.next_user[i] < j:
                            st += tc.param_bytes + tc.grad_bytes + tc.optimizer_bytes
                            gr += tc.grad_bytes
                            opt += tc.optimizer_us
                a_sum = paj - pa[i] + sh[i]
                x = trans(i, j)
                y = int(gr * yf)
                if fresh:  # gradients not yet made at the peak ([Note: fresh gradients] in cost.py)
                    d_off, d_on = min(a_sum, gr, x), min(cin[i], gr, x)
                else:
                    d_off = d_on = 0
                if v * (st + max(x + infl * a_sum - d_off, y)) <= cap:
                    comp = fb
                elif ck and v * (st + max(x + infl * cin[i] + a_sum - d_on, y)) <= cap:
                    comp = fb + f
                else:
                    continue
                busy = comp + host if adds else (comp if comp > host else host)
                t = busy + pin[i] + po
                w = (kk * t + v * (coef * gr + cst + opt) if multi else kk * t + v * opt) + stp
                if w < pv:
                    w = pv
                if w <= lim and w < best:
                    best = lim = w
                    bi = i
            if bi >= 0:
                cur[j] = best
                arg[j] = bi
                if first < 0:
                    first = j
                last = j
        if first < 0:
            return None
        # Only the reached boundaries matter for the next stage.
        bands[s] = (first, last)
        args.append(arg)
        prev = cur
    return _backtrack(prev, args, n, nv)


class Budget:
    """A count of interval evaluations a caller lets :func:`solve_memory` spend (shared across calls)."""

    def __init__(self, evaluations: int) -> None:
        self.remaining = evaluations


def solve_memory(
    tables: CostTables, cc: ConfigCosts, tau: float = INF, budget: Budget | None = None
) -> tuple[float, tuple[int, ...]] | None:
    """Partition minimising the largest ``memory / limit`` over stages (fitting or not), among those ``<= tau``.

    Same recurrence as :func:`solve` with ``w = v * memory / usable``, where a stage takes
    whichever of plain or checkpointed memory is smaller (plain only without checkpointing). Used to find the
    closest plan when nothing fits. Bands come from the monotone lower bound ``static + sum a_k``. Returns None
    when no partition is ``<= tau`` or when ``budget`` runs out first (then the caller keeps what it has).
    """
    n, nv = tables.num_blocks, cc.cfg.virtual_stages
    cap = tables.cap
    pm = tables.memory_prefix(cc.m, cc.v, 1, any(cc.fresh))
    room = int(tau * cap) + 1 if tau < INF else None
    hi = [0] * (nv + 1)
    pos = 0
    for s in range(1, nv + 1):
        j = n - (nv - s)
        if room is not None:
            j = min(j, bisect_right(pm, pm[pos] + room) - 1)
        hi[s] = pos = max(j, pos)
    if hi[nv] < n:
        return None
    lo = [0] * (nv + 1)
    lo[nv] = pos = n
    for s in range(nv - 1, -1, -1):
        i = s if room is None else max(s, bisect_left(pm, pm[pos] - room))
        lo[s] = pos = min(i, pos)
    if lo[0] > 0:
        return None
    at = cc.at
    ps, pa, cin, trans, tied = tables.static, at.acts, at.stage_input, at.transient, tables.tied
    sh = at.shared
    pg, yf = tables.grads, tables.opt_transient
    v, ck = cc.v, cc.checkpointing
    top = tau if tau < INF else _HUGE
    prev = [INF] * (n + 1)
    prev[0] = 0.0
    args: list[list[int]] = []
    plo, phi = 0, 0
    for s in range(1, nv + 1):
        infl, fresh = cc.in_flight[s - 1], cc.fresh[s - 1]
        cur = [INF] * (n + 1)
        arg = [-1] * (n + 1)
        first = last = -1
        for j in range(max(s, lo[s]), min(n - (nv - s), hi[s]) + 1):
            ilo = plo if room is None else max(plo, bisect_left(pm, pm[j] - room))
            best, bi = top, -1
            for i in range(min(j - 1, phi), ilo - 1, -1):
                pv = prev[i]
                if pv > best or (bi >= 0 and pv == best):
                    continue
                if (pm[j] - pm[i]) / cap > best:
                    break
                st = ps[j] - ps[i]
                gr = pg[j] - pg[i]
                a_sum = pa[j] - pa[i] + sh[i]
                if tied:
                    for tc in tied:
                        if i > tc.owner and tc.next_user[i] < j:
                            st += tc.param_bytes + tc.grad_bytes + tc.optimizer_bytes
                            gr += tc.grad_bytes
                x = trans(i, j)
                units = infl * a_sum - (min(a_sum, gr, x) if fresh else 0)
                if ck:
                    units = min(units, infl * cin[i] + a_sum - (min(cin[i], gr, x) if fresh else 0))
                w = v * (st + max(units + x, int(gr * yf))) / cap
                if w < pv:
                    w = pv
                if w < best or (bi < 0 and w <= best):
                    best, bi = w, i
            if bi >= 0:
                cur[j] = best
                arg[j] = bi
                if first < 0:
                    first = j
                last = j
            if budget is not None:
                budget.remaining -= j - ilo
                if budget.remaining < 0:
                    return None
        if first < 0:
            return None
        plo, phi = first, last
        args.append(arg)
        prev = cur
    return _backtrack(prev, args, n, nv)


def _backtrack(
    last: list[float], args: list[list[int]], n: int, nv: int
) -> tuple[float, tuple[int, ...]] | None:
    """The optimum ``last[n]`` and its boundaries, read back through the argmin tables ``args``; None if unreachable."""
    if last[n] == INF:
        return None
    cuts = [n]
    j = n
    for s in range(nv, 0, -1):
        j = args[s - 1][j]
        cuts.append(j)
    return last[n], tuple(reversed(cuts))
