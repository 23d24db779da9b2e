"""Tensors a block saves for backward that something else holds too: the previous block (one tensor where the two
share a stage, see [Note: saved twice] in records.py), a stage's receive buffers, or the output a stage keeps
until its backward (see [Note: pipeline buffers] in partition/cost.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lightning_autopart.capture.graph import CapturedModel, TensorInfo
from lightning_autopart.profile.precision import scaled_nbytes
from lightning_autopart.profile.records import BlockProfile

__all__ = ["with_shared_saves"]


def with_shared_saves(
    records: list[BlockProfile],
    indices: list[int],
    captured: CapturedModel,
    names: dict[int, tuple[frozenset[str], frozenset[str]]],
    cut_dtype: torch.dtype | None,
) -> list[BlockProfile]:
    """``records`` with ``saved_by_previous`` set where block k saves an input block k-1 saves too, as its output
    or as an input it passes on (see [Note: saved twice] in records.py; 0 where block k-1 was not profiled here),
    and with the shares of the cuts around each block that it saves as they are (its ``saved_input_share`` and
    ``saved_output_share``, a saved input it passes on included)."""

    def share(tensors: Sequence[TensorInfo], saved: frozenset[str]) -> float:
        total = sum(scaled_nbytes(t, cut_dtype) for t in tensors)
        part = sum(scaled_nbytes(t, cut_dtype) for t in tensors if t.name in saved)
        return min(1.0, part / total) if total > 0 else 0.0

    def every(k: int) -> frozenset[str]:  # a saved input that goes on past the block is a saved output too
        return names[k][0] | names[k][1]

    out = []
    for record, k in zip(records, indices, strict=True):
        if k in names:
            before = captured.cuts[k - 1] if k > 0 else captured.inputs
            record = dataclasses.replace(
                record,
                saved_input_share=share(before, names[k][0]),
                saved_output_share=share(captured.cuts[k], every(k)),
                passed_shares=_passed(captured.cuts[k], k, every(k), cut_dtype, saved=False),
                saved_passed_shares=_passed(captured.cuts[k], k, every(k), cut_dtype, saved=True),
            )
        if k > 0 and k - 1 in names and k in names:
            both = share(captured.cuts[k - 1], names[k][0] & every(k - 1))
            if both > 0:
                record = dataclasses.replace(record, saved_by_previous=both)
        out.append(record)
    return out


def _passed(
    cut: Sequence[TensorInfo], k: int, names: frozenset[str], cut_dtype: torch.dtype | None, saved: bool
) -> tuple[tuple[int, float], ...]:
    """Per producer before block ``k`` (ascending), the share of ``cut`` it made that block ``k`` does not save
    (``saved``: does save, ``names``) and that the wire sends as received (not a one-byte integer, which travels
    converted: [Note: wire format])."""
    total = sum(scaled_nbytes(t, cut_dtype) for t in cut)
    by: dict[int, int] = {}
    for t in cut:
        if t.producer < k and (t.name in names) == saved and _as_received(t.dtype):
            by[t.producer] = by.get(t.producer, 0) + scaled_nbytes(t, cut_dtype)
    return tuple((p, min(1.0, b / total)) for p, b in sorted(by.items()) if b > 0) if total > 0 else ()


def _as_received(dtype: str) -> bool:
    """Whether a value of ``dtype`` crosses a cut as a view of what the stage received."""
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        return False
    return found.is_floating_point or found.is_complex or found.itemsize > 1
