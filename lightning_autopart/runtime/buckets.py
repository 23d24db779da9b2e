"""Gradient buckets: the replicas' gradient all-reduce of one stage, overlapped with its backward.

[Note: overlapped all-reduce] As DDP does with ``gradient_as_bucket_view=True``, the replicas' gradient
all-reduce overlaps the last micro-batch's backward and copies nothing. Parameters are grouped into buckets of
``FIRST_BUCKET_BYTES``, then ``BUCKET_BYTES`` (DDP's sizes; one dtype each) in reverse registration order (about
the order backward finishes them). Each bucket owns one flat buffer and every parameter's ``.grad`` is a view
into it, attached before the schedule runs (zeroed, or holding the gradient the parameter already had), so
autograd accumulates in place. A post-accumulate-grad hook counts each parameter's accumulations; when every
parameter of a bucket has received its last micro-batch's gradient, the buffer is all-reduced asynchronously,
in place, and divided by the replicas after the schedule. The all-reduces start in bucket order, as DDP's
do: a ready bucket waits for those before it. Every replica then issues them in one order even where its graph
runs in another (a forward looping over a set of strings: [Note: rank-independent values] in
capture/keys.py), and the runner lists the parameters alike on every replica (in registration order). A bucket
that never became ready (a parameter that got no gradient) is reduced after the schedule, on every replica
alike, and a parameter that got no gradient and had none keeps ``.grad`` None, as autograd leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "GradBucket", "all_reduce_mean", "make_buckets"]

#: Gradient bytes per overlapped all-reduce bucket, DDP's defaults: a small first bucket (the last layers'
#: gradients, ready first) starts communication early; large ones after it keep the calls few, since each
#: all-reduce has a fixed cost and, on CPU, competes with backward for the cores.
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1024 * 1024, 25 * 1024 * 1024


class GradBucket:
    """Parameters of one dtype whose gradients live in one flat buffer, all-reduced in place when ready."""

    def __init__(self, params: list[nn.Parameter], micro_batches: int, group: dist.ProcessGroup) -> None:
        self.params = params
        self.micro_batches = micro_batches
        self.group = group
        self.active = False
        first = params[0]
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._counts = [0] * len(params)
        self._pending = len(params)
        self._had_grad = [False] * len(params)
        self._work: Any = None
        self._launched = False
        self._ready = False
        #: Every bucket of the stage, in launch order (set by :func:`make_buckets`).
        self.queue: list[GradBucket] = [self]
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._counts[index] += 1
            if self.active and self._counts[index] == self.micro_batches:
                self._pending -= 1
                if self._pending == 0:
                    self._ready = True
                    for bucket in self.queue:  # in order, up to the first that is not ready
                        if not bucket._ready:
                            break
                        if not bucket._launched:
                            bucket._launch()

        return hook

    def attach(self, active: bool) -> None:
        """Make every ``.grad`` a view into the buffer, keeping its value, and arm the bucket for a step
        (``active=False``: a step that does not all-reduce; its hooks only count)."""
        self._had_grad = [p.grad is not None for p in self.params]
        fresh = not any(self._had_grad)
        if fresh:
            self.flat.zero_()  # one memset instead of one per view
        for p, view in zip(self.params, self.views, strict=True):
            grad = p.grad
            if grad is None:
                if not fresh:
                    view.zero_()
                p.grad = view
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                p.grad = view
        self.active = active
        self._counts = [0] * len(self.params)
        self._pending = len(self.params)
        self._work = None
        self._launched = False
        self._ready = False

    def _launch(self) -> None:
        self._launched = True
        self._work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    def finish(self, replicas: int, sync: bool = True) -> None:
        """After the schedule: wait for the all-reduce (launching it now if backward never did) and average it
        in place (``sync``); a parameter that got no gradient this step and had none keeps ``.grad`` None."""
        if sync:
            if not self._launched:
                # Not every parameter got its last gradient (unused in the graph): the same on every replica.
                self._launch()
            self._work.wait()
            self.flat /= replicas
            self._work = None
        for p, count, had in zip(self.params, self._counts, self._had_grad, strict=True):
            if count == 0 and not had:
                p.grad = None  # as autograd would leave it


def make_buckets(
    params: list[nn.Parameter], micro_batches: int, group: dist.ProcessGroup
) -> list[GradBucket]:
    """Buckets of one dtype over ``params`` in reverse order (the order backward tends to finish them): the
    first of about FIRST_BUCKET_BYTES, the others of about BUCKET_BYTES, launched in that order."""
    buckets: list[GradBucket] = []
    current: dict[tuple[torch.dtype, torch.device], tuple[list[nn.Parameter], int]] = {}
    for p in reversed(params):
        key = (p.dtype, p.device)
        members, size = current.get(key, ([], 0))
        members.append(p)
        size += p.numel() * p.element_size()
        current[key] = (members, size)
        if size >= (BUCKET_BYTES if buckets else FIRST_BUCKET_BYTES):
            buckets.append(GradBucket(members, micro_batches, group))
            del current[key]
    buckets += [GradBucket(members, micro_batches, group) for members, _ in current.values()]
    for bucket in buckets:
        bucket.queue = buckets
    return buckets


def all_reduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup, divisor: int) -> None:
    """Sum ``grads`` over ``group`` in one flat message, then divide by ``divisor``, in place."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
