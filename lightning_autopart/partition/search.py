"""Outer search: branch and bound over replicas x stages x micro-batches x schedule x layout, exact DP inside.

Algorithm:

1. Enumerate every valid configuration ``(r, S, M, schedule)`` (``r | B``, ``M | B/r``, ``M <= max_micro_batches``,
   ``S*r <= world``, ``S*v <= L``, schedule constraints, forced values) and give each a lower bound on its step
   time that holds for every partition and layout::

       LB = max( K * max_k (f_k + b_k),                                    (the largest block is in some stage)
                 K * (sum f + sum b + 2 (V-1) p2p_min) / V + v * a_avg )   (max >= mean over stages)

   where ``a_avg`` is the all-reduce of the whole model's gradients spread over V stages at the best all-reduce
   bandwidth the replica count allows. Configurations that cannot fit (all parameters, gradients, optimizer state
   and buffers exceed ``S * usable``, or one block alone exceeds a device, less the gradients a fresh stage may
   not hold yet) are dropped here.
2. Pop configurations in increasing LB (a heap). Stop as soon as ``LB > incumbent``: no later one can win.
3. Bound again with the layout-independent monotone relaxation of :class:`.dp.Relaxation` (O(V log L); empty
   bands => pruned). Until some plan fits, each configuration first gets a candidate from the greedy partition
   at the relaxation's bisected optimum, scored exactly (this seeds the incumbent cheaply).
4. For each layout with a distinct link pattern (one for S = 1 or r = 1), run the exact DP of :func:`.dp.solve`
   with ``tau = incumbent``; it returns only partitions ``<= tau``, and stops as soon as a stage reaches
   no boundary.

Ties: lower step time, then fewer stages, then lower peak memory. Exactness: every pruning step discards only
configurations or partitions whose step time provably exceeds the incumbent, so the result is the minimum over
the whole space (``tests/unit/test_dp.py`` checks it against brute-force enumeration).

Complexity: O(C) to enumerate and heapify C configurations (at most about ``d(B) * world * ln(world) * 3``
for ``d(B)`` divisors of the batch), O(log C) per pop, O(V log L) per relaxation check, plus the DP cost in
:mod:`.dp` for the few survivors. Measured (``bench/plan_speed.py``): 1,000 blocks on 1,024 devices in about
0.2 s of CPython.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace
from itertools import pairwise

from lightning_autopart.partition.bounds import Relaxation
from lightning_autopart.partition.configs import shares_for
from lightning_autopart.partition.cost import (
    CHUNKS,
    INF,
    Config,
    CostTables,
    config_costs,
)
from lightning_autopart.partition.dp import Budget, solve, solve_memory
from lightning_autopart.partition.placement import LAYOUTS, LinkPattern, link_pattern
from lightning_autopart.partition.scoring import Evaluation, evaluate_config

__all__ = ["Constraints", "SearchResult", "closest", "divisors", "search"]

#: Interval evaluations the exact memory DP may spend refining the closest plan (about a second of CPython).
_MEMORY_BUDGET = 2_000_000


@dataclass(frozen=True)
class Constraints:
    """The user's forced values and limits (None = searched)."""

    num_stages: int | None = None
    replicas: int | None = None
    micro_batches: int | None = None
    schedules: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B")
    max_micro_batches: int = 64
    checkpointing: bool = True


@dataclass
class SearchResult:
    """The best plan found (None when nothing fits) and search statistics."""

    best: Evaluation | None
    #: Valid configurations, and those left after the cheap memory check (the heap).
    valid: int = 0
    candidates: int = 0
    evaluated: int = 0
    pruned_bound: int = 0
    pruned_relaxation: int = 0
    infeasible: int = 0
    seconds: float = 0.0

    def notes(self) -> dict[str, float | int]:
        """Statistics for ``Plan.notes``."""
        return {
            "configs": self.valid,
            "candidates": self.candidates,
            "dp_runs": self.evaluated,
            "pruned_by_bound": self.pruned_bound,
            "pruned_by_relaxation": self.pruned_relaxation,
            "infeasible_memory": self.infeasible,
            "seconds": round(self.seconds, 4),
        }


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _valid_schedule(schedule: str, s: int, mb: int) -> bool:
    if s == 1:
        return schedule == "GPipe"
    if schedule == "GPipe":
        return True
    if mb < s:
        return False
    return schedule == "1F1B" or mb % s == 0


def enumerate_configs(
    tables: CostTables, batch: int, cons: Constraints
) -> tuple[list[tuple[float, int, int, int, int]], int, int]:
    """Heap entries ``(LB, S, r, M, schedule index)`` of the valid, possibly feasible configurations.

    Also returns the number of valid configurations and of those dropped because they cannot fit.
    """
    cl = tables.cluster
    n, world, usable = tables.num_blocks, cl.world_size, tables.usable
    scheds = list(cons.schedules)
    total_grad = tables.grads[-1]
    lat = cl.latency_us
    host_lb = 0.0 if cl.async_host else 2 * cl.action_us  # host time that adds to every micro-batch's math
    best_p2p = max(cl.intra_node_bw, cl.inter_node_bw) if cl.devices_per_node > 1 else cl.inter_node_bw
    total_opt = tables.opt_us[-1]
    rs = [cons.replicas] if cons.replicas is not None else [r for r in divisors(batch) if r <= world]
    entries: list[tuple[float, int, int, int, int]] = []
    valid = infeasible = 0
    for r in rs:
        per = batch // r
        static, grads = tables.state(r)  # [Note: unreached gradients] in fresh.py
        total_static = static[-1]
        block_mem = [s - p for p, s in pairwise(static)]
        block_grad = [s - p for p, s in pairwise(grads)]
        if cons.micro_batches is not None:
            ms = [cons.micro_batches] if per % cons.micro_batches == 0 else []
        else:
            ms = [d for d in divisors(per) if d <= cons.max_micro_batches]
        smax = min(n, world // r)
        ss = [cons.num_stages] if cons.num_stages is not None else list(range(1, smax + 1))
        ss = [s for s in ss if 1 <= s <= smax]
        if r > 1:
            ar_bw = (
                cl.inter_allreduce_bw
                if r > cl.devices_per_node
                else max(cl.intra_allreduce_bw, cl.inter_allreduce_bw)
            )
            ar_total = 2 * (r - 1) / r * total_grad / ar_bw * 1e6
            ar_lat = 2 * (r - 1) * lat
        for mb in ms:
            m = per // mb
            at = tables.at(m)
            pf, pb, big = at.pf, at.pb, at.big
            total = pf[-1] + pb[-1]
            p2p_min = (min(at.cuts[:-1]) if n > 1 else 0) / best_p2p * 1e6 + lat
            acts = [a - p for p, a in pairwise(at.acts)]
            one_block = max(s + a for s, a in zip(block_mem, acts, strict=True))
            if r == 1 and not tables.persistent_grads:  # fresh gradients may be absent at the peak
                one_block = max(s + max(0, a - g) for s, a, g in zip(block_mem, acts, block_grad, strict=True))
            for s in ss:
                for si, sched in enumerate(scheds):
                    if not _valid_schedule(sched, s, mb):
                        continue
                    v = CHUNKS[sched]
                    nv = s * v
                    if nv > n:
                        continue
                    valid += 1
                    # a chunk's share of its device is not known here ([Note: chunk shares]): at most all of it
                    if total_static > s * usable or one_block > tables.cap:
                        infeasible += 1
                        continue
                    k = v * mb + s - 1
                    avg = total / nv + (2 * (nv - 1) / nv) * p2p_min
                    lb = k * avg + v * total_opt / nv + (v * (ar_total / nv + ar_lat) if r > 1 else 0.0)
                    lb = max(lb, k * big) + (host_lb * k if nv > 1 else 0.0) + cl.step_host_us
                    entries.append((lb, s, r, mb, si))
    return entries, valid, infeasible


def _better(ev: Evaluation, inc: Evaluation | None) -> bool:
    if inc is None:
        return True
    a = (ev.step_us, ev.config.stages, ev.peak_memory_bytes)
    b = (inc.step_us, inc.config.stages, inc.peak_memory_bytes)
    return a < b


def _layouts(cfg_s: int, r: int, devices_per_node: int) -> list[str]:
    """Layouts with distinct link patterns (both coincide for one stage or one replica)."""
    if cfg_s == 1 or r == 1:
        return [LAYOUTS[0]]
    pats: dict[LinkPattern, str] = {}
    for lay in LAYOUTS:
        pats.setdefault(link_pattern(cfg_s, r, devices_per_node, lay), lay)
    return list(pats.values())


def _splits(cfg: Config) -> list[Config]:
    """``cfg`` with every split of a rank's device among its chunks ([Note: chunk shares] in tables.py)."""
    return [replace(cfg, shares=sh) for sh in shares_for(cfg.chunks)]


def _layouts_of(cfg: Config, devices_per_node: int) -> list[Config]:
    """``cfg`` in every rank layout with distinct links."""
    return [replace(cfg, layout=lay) for lay in _layouts(cfg.stages, cfg.replicas, devices_per_node)]


def search(tables: CostTables, batch: int, cons: Constraints) -> SearchResult:
    """Find the configuration and partition with the smallest step time (see the module docstring)."""
    t0 = time.perf_counter()
    entries, valid, infeasible = enumerate_configs(tables, batch, cons)
    res = SearchResult(best=None, valid=valid, candidates=len(entries), infeasible=infeasible)
    heapq.heapify(entries)
    inc: Evaluation | None = None
    dpn = tables.cluster.devices_per_node
    while entries:
        lb, s, r, mb, si = heapq.heappop(entries)
        if inc is not None and lb * (1 - 1e-9) > inc.step_us:
            res.pruned_bound = len(entries) + 1
            break
        sched = cons.schedules[si]
        for base in _splits(Config(r, s, mb, sched)):
            relax = Relaxation(tables, base, batch, cons.checkpointing)  # every layout alike
            if inc is None:
                if relax.bands(INF) is None:
                    res.infeasible += 1
                    continue
                # Seed the incumbent with the greedy partition at the relaxation's optimum, scored exactly.
                _, part = relax.lower_bound()
                if part is not None:
                    for cfg in _layouts_of(base, dpn):
                        ev = evaluate_config(tables, cfg, batch, part, cons.checkpointing)
                        if ev.fits and _better(ev, inc):
                            inc = ev
            tau = inc.step_us if inc is not None else INF
            if relax.bands(tau) is None:
                res.pruned_relaxation += 1
                continue
            for cfg in _layouts_of(base, dpn):
                cc = config_costs(tables, cfg, batch, cons.checkpointing)
                res.evaluated += 1
                got = solve(tables, cc, inc.step_us if inc is not None else INF, relax)
                if got is None:
                    continue
                ev = evaluate_config(tables, cfg, batch, got[1], cons.checkpointing)
                if ev.fits and _better(ev, inc):
                    inc = ev
    res.best = inc
    res.seconds = time.perf_counter() - t0
    return res


def closest(tables: CostTables, batch: int, cons: Constraints) -> Evaluation | None:
    """The plan with the smallest largest ``memory / limit`` among memory-lean configurations (nothing fits).

    Candidates: for every replica count and schedule, the deepest valid pipeline with the most micro-batches
    (the smallest micro-batch); GPipe is skipped where 1F1B is valid (it never needs less memory). Candidates
    are visited in increasing order of a relaxation bound, each seeded with a greedy partition and finished
    exactly by :func:`.dp.solve_memory`, stopping once the bound reaches the best ratio found. The exact
    refinement shares a budget of interval evaluations; past it, the greedy partitions stand (a diagnostic for
    the error message, so bounded time matters more than the last few bytes).
    """
    cl = tables.cluster
    n, world = tables.num_blocks, cl.world_size
    rs = [cons.replicas] if cons.replicas is not None else [r for r in divisors(batch) if r <= world]
    cands: list[tuple[float, int, Config, tuple[int, ...]]] = []
    for r in rs:
        per = batch // r
        if cons.micro_batches is not None:
            ms = [cons.micro_batches] if per % cons.micro_batches == 0 else []
        else:
            ms = [d for d in divisors(per) if d <= cons.max_micro_batches]
        ss = [cons.num_stages] if cons.num_stages is not None else list(range(min(n, world // r), 0, -1))
        chosen: dict[str, Config] = {}
        for sched in cons.schedules:
            for s in ss:
                good = [mb for mb in ms if _valid_schedule(sched, s, mb)]
                if good and s * CHUNKS[sched] <= n and s * r <= world:
                    chosen[sched] = Config(r, s, max(good), sched)
                    break
        one = chosen.get("1F1B")
        if one is not None and "GPipe" in chosen and chosen["GPipe"].stages == one.stages:
            del chosen["GPipe"]
        for cfg in chosen.values():
            relax = Relaxation(tables, cfg, batch, cons.checkpointing)
            lb, part = relax.memory_lower_bound()
            cands.append((lb, len(cands), cfg, part))
    cands.sort()
    budget = Budget(_MEMORY_BUDGET)
    best: Evaluation | None = None
    best_val = INF
    for lb, _, cfg, part in cands:
        if lb >= best_val:
            break
        ev = evaluate_config(tables, cfg, batch, part, cons.checkpointing)
        if ev.max_excess < best_val:
            best, best_val = ev, ev.max_excess
        cc = config_costs(tables, cfg, batch, cons.checkpointing)
        got = solve_memory(tables, cc, best_val, budget) if budget.remaining > 0 else None
        if got is not None:
            ev = evaluate_config(tables, cfg, batch, got[1], cons.checkpointing)
            if ev.max_excess < best_val:
                best, best_val = ev, ev.max_excess
    return best
