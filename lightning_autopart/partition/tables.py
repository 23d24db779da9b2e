"""Prefix sums of one profile on one cluster: every interval cost of the planner in O(1)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError
from lightning_autopart.records import ModelProfile, optimizer_state_factor

__all__ = ["CostTables", "TiedCopy"]

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8": 1}


@dataclass(frozen=True, slots=True)
class TiedCopy:
    """A tied parameter: stages that use it without holding its owner block keep a full copy."""

    name: str
    owner: int
    #: ``next_user[i]``: smallest user block index >= i (L when none).
    next_user: tuple[int, ...]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    param_count: int


def _tied_copies(profile: ModelProfile) -> tuple[TiedCopy, ...]:
    blocks = profile.blocks
    n = len(blocks)
    try:
        factor = optimizer_state_factor(profile.optimizer)
    except ConfigError:
        total = sum(b.param_bytes for b in blocks)
        factor = sum(b.optimizer_bytes for b in blocks) / total if total else 0.0
    copies = []
    for t in profile.tied:
        users = sorted({u for u in t.blocks if 0 <= u < n})
        if len(users) < 2:
            continue
        owner = users[0]
        count = 0
        for name, shape in blocks[owner].param_shapes:
            if name == t.name:
                count = 1
                for d in shape:
                    count *= d
        if count == 0:
            count = t.param_bytes // _ITEMSIZE.get(profile.dtype, 4)
        trainable = blocks[owner].grad_bytes > 0
        nxt = [n] * (n + 1)
        k, cur = len(users) - 1, n
        for i in range(n, -1, -1):
            if k >= 0 and users[k] == i:
                cur = i
                k -= 1
            nxt[i] = cur
        copies.append(
            TiedCopy(
                t.name,
                owner,
                tuple(nxt),
                t.param_bytes,
                t.param_bytes if trainable else 0,
                round(t.param_bytes * factor) if trainable else 0,
                count,
            )
        )
    return tuple(copies)


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    acc = 0
    for x in values:
        acc += x
        out.append(acc)
    return out


class CostTables:
    """Prefix sums of one profile on one cluster; micro-batch-size dependent tables are built once per size."""

    def __init__(self, profile: ModelProfile, cluster: Cluster) -> None:
        if not profile.blocks:
            raise ConfigError("the profile has no blocks; capture the model again (it produced 0 blocks)")
        if profile.batch_size < 1:
            raise ConfigError(f"profile batch_size must be >= 1, got {profile.batch_size}")
        blocks = profile.blocks
        self.profile = profile
        self.cluster = cluster
        self.num_blocks = len(blocks)
        self.b0 = profile.batch_size
        self.usable = cluster.usable_memory_bytes
        self.cap = self.b0 * self.usable
        self.params = _prefix([b.param_bytes for b in blocks])
        self.grads = _prefix([b.grad_bytes for b in blocks])
        self.optim = _prefix([b.optimizer_bytes for b in blocks])
        self.buffers = _prefix([b.buffer_bytes for b in blocks])
        self.counts = _prefix([b.param_count for b in blocks])
        self.static = _prefix(
            [b.param_bytes + b.grad_bytes + b.optimizer_bytes + b.buffer_bytes for b in blocks]
        )
        self.acts = _prefix([b.activation_bytes for b in blocks])
        #: ``stage_input[i]``: bytes (at b0) a stage starting at block i receives.
        self.stage_input = [profile.input_bytes] + [b.cut_bytes for b in blocks[:-1]]
        self.cuts = [b.cut_bytes for b in blocks]
        self.tied = _tied_copies(profile)
        self._times: dict[int, tuple[list[float], list[float], float]] = {}
        self._fb: dict[tuple[int, bool], list[float]] = {}
        self._mem: dict[tuple[int, int, int], list[int]] = {}
        self._p2p: dict[tuple[int, bool], list[float]] = {}

    def times(self, m: int) -> tuple[list[float], list[float], float]:
        """Prefix sums of forward and backward time at ``m`` samples, and the largest ``f_k + b_k``."""
        got = self._times.get(m)
        if got is None:
            b0 = self.b0
            pf = [0.0]
            pb = [0.0]
            big = 0.0
            af = ab = 0.0
            for blk in self.profile.blocks:
                f = blk.fwd_fixed_us + (blk.fwd_us - blk.fwd_fixed_us) * m / b0
                b = blk.bwd_fixed_us + (blk.bwd_us - blk.bwd_fixed_us) * m / b0
                af += f
                ab += b
                pf.append(af)
                pb.append(ab)
                big = max(big, f + b)
            got = (pf, pb, big)
            self._times[m] = got
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

    def memory_prefix(self, m: int, v: int, held: int) -> list[int]:
        """Prefix sums of ``v*(b0*static + m*held*activation_bytes)``: scaled memory, ``held`` micro-batches."""
        got = self._mem.get((m, v, held))
        if got is None:
            vb0, vmh = v * self.b0, v * m * held
            got = self._mem[(m, v, held)] = [
                vb0 * s + vmh * a for s, a in zip(self.static, self.acts, strict=True)
            ]
        return got

    def p2p(self, m: int, intra: bool) -> list[float]:
        """``x[j]``: time to send the cut before block j at ``m`` samples (0 at j = 0 and j = L)."""
        got = self._p2p.get((m, intra))
        if got is None:
            c = self.cluster
            bw = c.intra_node_bw if intra else c.inter_node_bw
            lat = c.latency_us
            b0 = self.b0
            got = [0.0] + [cut * m / b0 / bw * 1e6 + lat for cut in self.cuts[:-1]] + [0.0]
            self._p2p[(m, intra)] = got
        return got

    def tied_extra(self, i: int, j: int) -> tuple[int, int, int, int]:
        """(param, grad, optimizer bytes, param count) of tied copies held by a stage of blocks ``[i, j)``."""
        p = g = o = n = 0
        for t in self.tied:
            if i > t.owner and t.next_user[i] < j:
                p += t.param_bytes
                g += t.grad_bytes
                o += t.optimizer_bytes
                n += t.param_count
        return p, g, o, n
