"""Exact dynamic program over contiguous partitions of the blocks into the V stages of one configuration.

Tables (``k`` = virtual stage, ``j`` = blocks covered so far; :mod:`.cost` defines ``w_k(i, j)``)::

    best[0][0] = 0
    best[k][j] = min over i < j of max(best[k-1][i], w_{k-1}(i, j))   for stages holding blocks [i, j)
    arg[k][j]  = the minimising i;   answer = best[V][L], partition by following arg back from (V, L)

``w`` is infinite where the stage does not fit in memory, and depends on the stage index (in-flight
micro-batches, links), which is part of the state, so the recurrence is exact for the min-max objective.
Only values ``<= tau`` (the incumbent of the outer search) are of interest, which licenses three prunings
that never discard a partition of value ``<= tau``:

1. Bands. :class:`~.bounds.Relaxation` gives, for every stage, a necessary condition for ``w <= tau`` and memory
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

from lightning_autopart.partition.bounds import Relaxation
from lightning_autopart.partition.cost import INF, ConfigCosts, CostTables
from lightning_autopart.partition.fresh import fresh_excesses, sent_backs

__all__ = ["Budget", "solve", "solve_memory"]

_HUGE = 1e300
#: No input gradients held for their sends (a first stage, or none in flight).
_NONE = (0, 0)


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
    start, room = relax.start, relax.room(tau)
    at = cc.at
    ps, pg = tables.state(cc.cfg.replicas)  # [Note: unreached gradients] in fresh.py
    pf, pb, pa, po_ = cc.pf, cc.pb, at.acts, tables.opt_us
    sh, pc = at.shared, tables.casts
    cin, trans, ftrans, yf = at.stage_input, at.transient, at.fresh_transient, tables.opt_transient
    fwd = at.forward
    rv, al, sd, hd = at.recv, at.alias, at.send, cc.held
    batch, msg, capped = cc.batch, cc.messages, cc.capped
    kept = msg - cc.cfg.micro_batches  # finished micro-batches' messages kept to the step's end (interleaved)
    mbs, gp = cc.cfg.micro_batches, cc.cfg.schedule == "GPipe"
    back = cc.v == 1 and mbs > 1  # earlier input gradients held for their sends (fresh.py)
    tied = tables.tied
    kk, v, ck = cc.ticks, cc.v, cc.checkpointing
    host, adds, stp, hfb, hf = cc.host, cc.host_adds, cc.step_host, cc.host_fb, cc.host_f
    dq, dopen, dshare = cc.data, cc.data_open, cc.data_share
    multi = cc.cfg.replicas > 1
    # The largest finite value a cell may take: unreachable states (INF) then fail ``pv > lim`` at once.
    top = tau if tau < INF else _HUGE
    prev = [INF] * (n + 1)
    prev[0] = cc.data_floor  # no stage is quicker than the loader's workers ([Note: loader in the step])
    args: list[list[int]] = []
    for s in range(1, nv + 1):
        k = s - 1
        jlo, jhi = bands[s]
        plo, phi = bands[s - 1]
        infl, fresh, cap, bk = cc.in_flight[k], cc.fresh[k], cc.limit[k], batch[k]
        later = infl > 1
        pin, pout = cc.p2p_in[k], cc.p2p_out[k]
        coef, cst = cc.ar_coef[k], cc.ar_const[k]
        cur = [INF] * (n + 1)
        arg = [-1] * (n + 1)
        first = last = -1
        for j in range(jlo, jhi + 1):
            pfj, pbj, psj, paj, pgj, po, ooj = pf[j], pb[j], ps[j], pa[j], pg[j], pout[j], po_[j]
            hfbj, hfj = hfb[j], hf[j]
            # [Note: pipeline buffers] in cost.py: the batch and buffers (P) and the outputs held (Q), by j.
            pj, hdj = bk + msg * sd[j], hd[j]
            pt = hdj > 0 and bool(at.passed[j])  # an output sent on as received: no copy held
            rt = kept > 0 and bool(at.relayed[j])  # nor kept with the finished sends (saved or not)
            ilo = max(plo, start(j, room, k))
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
                wc = pc[j] - pc[i]  # a micro-batch's weight casts ([Note: weight casts] in cost.py)
                h = host + (hfbj - hfb[i])
                st += pj + msg * rv[i]
                ko = hdj
                if pt:  # [Note: pipeline buffers]: an output sent on as received is neither held nor kept
                    ko -= min(hdj, at.passed_through(i, j))
                q = infl * ko
                bs = _NONE
                if back and rv[i]:  # [Note: input gradients in flight] in fresh.py
                    bs = sent_backs(rv[i], a_sum + wc + ko - al[i], ko, cin[i], infl, mbs, gp, fresh)
                dr = fwd(i, j)  # the dead parts' saves ([Note: a dead part's saves] in cost.py)
                if fresh:  # gradients not yet made at the peak ([Note: fresh gradients] in fresh.py)
                    e_off, e_on = fresh_excesses(x, ftrans(i, j), gr, capped, a_sum + wc, cin[i], later, bs, dr)
                else:
                    e_off, e_on = (x if x > dr else dr) + bs[0], x + bs[1]
                if rt:
                    st -= kept * at.relayed_through(i, j)
                if st + max(e_off + infl * (a_sum + wc) + q - infl * al[i], y) <= cap:
                    comp = fb
                elif ck and st + max(e_on + a_sum + wc + q, y) <= cap:
                    comp = fb + f
                    h += hfj - hf[i]
                else:
                    continue
                busy = comp + h if adds else (comp if comp > h else h)
                t = busy + pin[i] + po
                w = (kk * t + v * (coef * gr + cst + opt) if multi else kk * t + v * opt) + stp
                if dopen:  # the next fetch overlaps the device ([Note: loader in the step] in cost.py)
                    lag = dopen + kk * h + stp - w
                    w += dq + dshare * lag if lag > 0 else dq
                else:
                    w += dq
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

    Same recurrence as :func:`solve` with ``w = memory / limit``, where a stage takes
    whichever of plain or checkpointed memory is smaller (plain only without checkpointing). Used to find the
    closest plan when nothing fits. Bands come from the monotone lower bound ``static + sum a_k``. Returns None
    when no partition is ``<= tau`` or when ``budget`` runs out first (then the caller keeps what it has).
    """
    n, nv = tables.num_blocks, cc.cfg.virtual_stages
    cap = cc.v * max(cc.limit)  # pm is in units of v bytes: the bands' relaxation takes the largest limit
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
    ps, pg = tables.state(cc.cfg.replicas)  # [Note: unreached gradients] in fresh.py
    pa, cin, trans, tied = at.acts, at.stage_input, at.transient, tables.tied
    sh, pc, yf = at.shared, tables.casts, tables.opt_transient
    rv, al, sd, hd = at.recv, at.alias, at.send, cc.held
    batch, msg, capped = cc.batch, cc.messages, cc.capped
    kept = msg - cc.cfg.micro_batches  # finished micro-batches' messages kept to the step's end (interleaved)
    mbs, gp = cc.cfg.micro_batches, cc.cfg.schedule == "GPipe"
    back = cc.v == 1 and mbs > 1  # earlier input gradients held for their sends (fresh.py)
    v, ck = cc.v, cc.checkpointing
    top = tau if tau < INF else _HUGE
    prev = [INF] * (n + 1)
    prev[0] = 0.0
    args: list[list[int]] = []
    plo, phi = 0, 0
    for s in range(1, nv + 1):
        infl, fresh, lim, bk = cc.in_flight[s - 1], cc.fresh[s - 1], max(1, cc.limit[s - 1]), batch[s - 1]
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
                if (pm[j] - pm[i]) / (v * lim) > best:
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
                ko = hd[j] - min(hd[j], at.passed_through(i, j))
                q = infl * ko
                wc = pc[j] - pc[i]  # [Note: weight casts] in cost.py
                bs = _NONE
                if back and rv[i]:  # [Note: input gradients in flight] in fresh.py
                    bs = sent_backs(rv[i], a_sum + wc + ko - al[i], ko, cin[i], infl, mbs, gp, fresh)
                dr = at.forward(i, j)  # [Note: a dead part's saves] in cost.py
                if fresh:
                    xf = at.fresh_transient(i, j)
                    e_off, e_on = fresh_excesses(x, xf, gr, capped, a_sum + wc, cin[i], infl > 1, bs, dr)
                else:
                    e_off, e_on = max(x, dr) + bs[0], x + bs[1]
                units = infl * (a_sum + wc) + e_off + q - infl * al[i]
                if ck:
                    units = min(units, a_sum + wc + e_on + q)
                st += bk + msg * (rv[i] + sd[j]) - kept * at.relayed_through(i, j)  # [Note: pipeline buffers]
                w = (st + max(units, int(gr * yf))) / lim
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
