"""Rank layout: which global rank holds replica q of pipeline position p, and which links stay inside a node.

Two layouts are considered for ``r`` replicas of an ``S``-deep pipeline on ranks ``0 .. S*r - 1``:

- ``"pipeline-major"``: ``rank = q*S + p``; a pipeline occupies consecutive ranks, so point-to-point links
  tend to stay inside a node and the all-reduce of a stage's replicas crosses nodes.
- ``"stage-major"``: ``rank = p*r + q``; a stage's replicas occupy consecutive ranks, so the all-reduce tends
  to stay inside a node and point-to-point links cross nodes.

A link (or an all-reduce group) is *intra-node* when, for every replica, all ranks involved are on one node
(``node = rank // devices_per_node``); otherwise the slowest replica sets the pace and it is *inter-node*. With
interleaving (``v`` chunks per rank) virtual stage ``k`` lives at position ``k % S``, so the same rank holds
chunks ``p, p+S, ...`` and the link after position ``S-1`` wraps around to position 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = ["LAYOUTS", "LinkPattern", "link_pattern", "rank_of", "stage_ranks"]

#: Rank layouts the search evaluates, in order of preference on ties.
LAYOUTS = ("pipeline-major", "stage-major")


def rank_of(replica: int, position: int, stages: int, replicas: int, layout: str) -> int:
    """Global rank of ``replica`` q at pipeline ``position`` p under ``layout``."""
    if layout == "pipeline-major":
        return replica * stages + position
    if layout == "stage-major":
        return position * replicas + replica
    raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")


def stage_ranks(position: int, stages: int, replicas: int, layout: str) -> tuple[int, ...]:
    """Global ranks of the replicas of pipeline position ``position``, replica 0 first."""
    return tuple(rank_of(q, position, stages, replicas, layout) for q in range(replicas))


@dataclass(frozen=True, slots=True)
class LinkPattern:
    """Which links of one (S, r, layout) stay inside a node."""

    #: ``p2p_intra[p]``: the link from position p to position ``(p + 1) % S`` is intra-node for every replica.
    p2p_intra: tuple[bool, ...]
    #: ``allreduce_intra[p]``: the replicas of position p are all on one node.
    allreduce_intra: tuple[bool, ...]


@lru_cache(maxsize=4096)
def link_pattern(stages: int, replicas: int, devices_per_node: int, layout: str) -> LinkPattern:
    """The :class:`LinkPattern` of ``replicas`` pipelines of depth ``stages`` laid out by ``layout``."""
    d = devices_per_node
    p2p = []
    for p in range(stages):
        nxt = (p + 1) % stages
        p2p.append(
            all(
                rank_of(q, p, stages, replicas, layout) // d == rank_of(q, nxt, stages, replicas, layout) // d
                for q in range(replicas)
            )
        )
    ar = []
    for p in range(stages):
        nodes = {rank_of(q, p, stages, replicas, layout) // d for q in range(replicas)}
        ar.append(len(nodes) == 1)
    return LinkPattern(tuple(p2p), tuple(ar))
