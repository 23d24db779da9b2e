"""Where a computation mixes the samples of its batch, told from two runs of it at different batch sizes.

[Note: sample flow] A pipeline computes a step one micro-batch at a time, which is plain Lightning's step only
where every value of a sample depends on that sample alone until the loss averages them. Two runs of the same
computation at batch sizes ``a < b`` tell, for every value, which of its dimensions follow the batch (those
whose sizes differ), and the operations between them tell where values come from. A value is one of:

- *per-sample*: some dimension follows the batch;
- an *aggregate*: no dimension follows the batch, yet it is computed from per-sample values (a mean over the
  batch, a loss) or from other aggregates;
- a constant: neither (parameters, tables, values made from sizes alone).

Two things mix samples ([Note: values that mix samples] in batch_stats.py): a value with more than one
dimension that follows the batch (CLIP's ``(batch, batch)`` logits, a contrastive loss's ``z @ z.T``: "pairs"),
and a per-sample value computed from an aggregate (``x - x.mean(0)``, a Barlow Twins loss's normalization over
the batch: "statistics"). An aggregate that is only reduced further or combined with other aggregates (a loss,
a weighted mean, a mixture's load-balancing term) is what a step's loss is, and what accumulated gradients and
data parallelism average already. An aggregate of integer or boolean values alone (a count: the tokens each
expert of a mixture receives and the offsets of their groups, a flag that some value is infinite) routes or
guards samples without changing one by another's values, so only a floating one (a statistic) counts: the 19
mixtures of experts of the Hugging Face sweeps that group tokens by expert route by counts, and are not found.
A value converted to another dtype keeps its kind: those mixtures count their tokens with a histogram of the
expert indices converted to float.
Operations that read only the shape of their inputs (``zeros_like``) carry no value from them. Batch norms are
found by their operations instead (``batch_statistics`` in batch_stats.py): they combine the batch inside one
operation.

[Note: statistics transformed] A statistic that is a sum of its samples' terms (a sum or a mean over the batch,
a loss function's mean, a product that contracts the batch: ``z1.T @ z2``), scaled by constants or counts and
added to others, is what micro-batches give back: their mean (or sum) is the batch's. Any other operation on a
statistic transforms it (``sqrt(mse)``: a root-mean-square loss; a Dice loss's ratio of two sums; ``(c - I)
** 2`` of a cross-correlation; a variance or maximum over the batch), and the mean of the micro-batches'
transformed values is not the batch's: a pipeline trained a root-mean-square loss 0.3-0.7 % below plain
Lightning's, with other gradients, silently. Such a value is "transformed" (its first such operation kept as its
origin), and the values a caller names in a trace (a step's loss and what it logs) are told so
(:class:`TracedFlow`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["RecordOps", "SampleFlow", "Trace", "TracedFlow", "trace_flow", "walk_graph"]

#: Operations whose result depends on the shapes of their tensor inputs only, by overload packet name.
_SHAPE_ONLY = frozenset(
    {
        "sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "empty_like", "zeros_like", "ones_like",
        "full_like", "rand_like", "randn_like", "randint_like", "new_empty", "new_zeros", "new_ones", "new_full",
        "new_empty_strided", "_assert_tensor_metadata",
    }
)  # fmt: skip

#: Operations that convert their input to another dtype, by overload packet name.
_CONVERSIONS = frozenset(
    {
        "to", "_to_copy", "type_as", "convert_element_type", "_autocast_to_reduced_precision",
        "_autocast_to_full_precision",
    }
)  # fmt: skip

#: The kinds of value: per-sample (floating, or integer or boolean), and aggregates: a statistic (reduced from
#: floating per-sample values: a mean over the batch) or a count (from integer or boolean ones alone: how many
#: tokens each expert gets, whether any value is infinite).
#: And a statistic transformed otherwise than by the operations below ([Note: statistics transformed]).
_VALUES, _INDICES, _STATISTIC, _COUNT = "per-sample", "per-sample index", "statistic", "count"
_TRANSFORMED = "transformed statistic"

#: Operations that reduce per-sample values to a sum of their samples' terms, by overload packet name: sums and
#: means, products that contract the batch, and loss functions' means and sums.
_SUMS = frozenset(
    {
        "sum", "mean", "nansum", "nanmean", "mm", "bmm", "matmul", "dot", "vdot", "mv", "addmm", "addbmm",
        "baddbmm", "einsum", "tensordot", "trace", "index_add", "scatter_add", "mse_loss", "l1_loss",
        "smooth_l1_loss", "huber_loss", "nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss2d",
        "nll_loss_nd", "cross_entropy_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
        "soft_margin_loss", "multi_margin_loss", "multilabel_margin_loss_forward", "hinge_embedding_loss",
        "margin_ranking_loss", "poisson_nll_loss",
    }
)  # fmt: skip

#: Operations that keep a statistic a sum of its samples' terms: sums of statistics, views and copies of them.
_LINEAR = _CONVERSIONS | frozenset(
    {
        "add", "sub", "rsub", "neg", "sum", "mean", "nansum", "view", "_unsafe_view", "reshape", "_reshape_alias",
        "squeeze", "unsqueeze", "expand", "clone", "alias", "detach", "lift_fresh", "lift_fresh_copy", "select",
        "slice", "t", "transpose", "permute", "movedim", "diagonal", "diag", "cat", "stack", "index_select", "index",
        "unbind", "split", "split_with_sizes", "chunk", "narrow", "flatten", "contiguous", "copy", "as_strided",
        "nan_to_num", "trace",
    }
)  # fmt: skip

#: Products: a statistic times constants or counts stays one (divided: only as the dividend).
_PRODUCTS = frozenset({"mul", "div", "true_divide", "mm", "matmul", "mv", "dot"})
_DIVISIONS = frozenset({"div", "true_divide"})


def _base(op: str) -> str:
    """An operation's name without its in-place or copying suffix ("mul_", "view_copy": "mul", "view")."""
    if op.endswith("_copy") and op not in _CONVERSIONS:
        op = op[: -len("_copy")]
    return op[:-1] if op.endswith("_") and not op.endswith("__") else op


def _aggregate(op: str, read: list[str | None]) -> str | None:
    """The kind of a value with no dimension that follows the batch, made by ``op`` from values of the kinds
    ``read`` (in argument order): a statistic, a transformed one ([Note: statistics transformed]), a count, or
    None (a constant)."""
    kinds, op = set(read), _base(op)
    if _TRANSFORMED in kinds:
        return _TRANSFORMED
    if _VALUES in kinds:  # a reduction over the batch
        return _STATISTIC if op in _SUMS and _STATISTIC not in kinds else _TRANSFORMED
    if _STATISTIC in kinds:
        if op in _LINEAR:
            return _STATISTIC
        statistics = [i for i, k in enumerate(read) if k == _STATISTIC]
        if op in _PRODUCTS and len(statistics) == 1 and (op not in _DIVISIONS or statistics == [0]):
            return _STATISTIC
        return _TRANSFORMED
    return _COUNT if kinds & {_INDICES, _COUNT} else None


def _following(a: Any, b: Any) -> int | None:
    """How many dimensions of ``a`` and ``b`` (one value at two batch sizes) differ; None for other values."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.dim() != b.dim():
        return 1  # a dimension folded away at one size only (a squeeze of a batch of 1): it follows the batch
    # a size the data decides (a symbol: the tokens routed to one expert) follows the samples
    return sum(not (type(m) is int and type(n) is int) or m != n for m, n in zip(a.shape, b.shape, strict=True))


@dataclass
class SampleFlow:
    """The kinds of the values seen so far, and where samples were mixed ("pairs" or "statistics", by place)."""

    kinds: dict[Hashable, str] = field(default_factory=dict)
    found: dict[str, str] = field(default_factory=dict)
    #: Where each transformed statistic was first transformed ([Note: statistics transformed]), by key.
    origins: dict[Hashable, str] = field(default_factory=dict)

    def step(
        self,
        where: str,
        inputs: Iterable[Hashable],
        outputs: Iterable[tuple[Hashable, Any, Any]],
        same: bool = False,
        op: str = "",
    ) -> None:
        """One operation ``op`` at ``where``: the keys of the values it reads (in argument order), and each
        value it makes as ``(key, value at batch a, value at batch b)``; ``same``: it passes its input on (in
        another dtype, or under another name), which keeps its kind (expert indices converted to float for a
        histogram stay indices)."""
        keys = list(inputs)
        listed = [self.kinds.get(key) for key in keys]
        read = set(listed)
        for key, a, b in outputs:
            follows = _following(a, b)
            if follows is None:
                continue
            self.origins.pop(key, None)
            if follows > 1:
                self.found.setdefault(f"{where} {tuple(a.shape)}", "pairs")
            if follows:
                if read & {_STATISTIC, _TRANSFORMED}:
                    self.found.setdefault(f"{where} {tuple(a.shape)}", "statistics")
                if same and read & {_VALUES, _INDICES}:
                    self.kinds[key] = _VALUES if _VALUES in read else _INDICES
                else:
                    self.kinds[key] = _VALUES if a.is_floating_point() or a.is_complex() else _INDICES
            elif (kind := _aggregate("to" if same else op, listed)) is None:
                self.kinds.pop(key, None)  # a constant (an in-place write may have made it one)
            else:
                self.kinds[key] = kind
                if kind == _TRANSFORMED:
                    self.origins[key] = next((self.origins[k] for k in keys if k in self.origins), where)

    def mixed(self) -> tuple[str, ...]:
        """The places that mixed samples, as "place (shape at batch a)", in order."""
        return tuple(self.found)


def _name(target: Any) -> str:
    """An operation's overload packet name ("mean"), or its printed target."""
    packet = getattr(target, "_overloadpacket", None)
    return str(getattr(packet, "__name__", target))


def _node_keys(arg: Any) -> Iterator[Hashable]:
    """The keys of the values an fx argument reads: a node, or one element of a node's tuple."""
    for leaf in tree_leaves(arg, is_leaf=lambda x: isinstance(x, fx.Node)):
        if isinstance(leaf, fx.Node):
            yield leaf


def walk_graph(flow: SampleFlow, ga: fx.Graph, gb: fx.Graph, where: Callable[[fx.Node], str],
               inputs: Sequence[Hashable] = ()) -> bool:  # fmt: skip
    """Add graph ``ga``'s operations to ``flow``, ``gb`` being the same graph at the other batch size; its
    placeholders read ``inputs`` (keys of values outside it), in order. False where the graphs differ."""
    nodes = list(ga.nodes), list(gb.nodes)
    if len(nodes[0]) != len(nodes[1]) or any(p.target != q.target for p, q in zip(*nodes, strict=True)):
        return False
    placeholders = iter(inputs)
    for p, q in zip(*nodes, strict=True):
        va, vb = p.meta.get("val"), q.meta.get("val")
        if p.op == "placeholder":
            outer = next(placeholders, None)
            flow.step(where(p), () if outer is None else (outer,), [(p, va, vb)], same=True)
        elif p.op == "output":
            continue
        elif p.target is operator.getitem and isinstance(p.args[0], fx.Node):
            source = p.args[0]
            flow.step(where(p), [(source, p.args[1])], [(p, va, vb)], same=True)
        else:
            read = [] if _name(p.target) in _SHAPE_ONLY else list(_node_keys((p.args, p.kwargs)))
            if isinstance(va, (tuple, list)) and isinstance(vb, (tuple, list)) and len(va) == len(vb):
                outputs = [((p, i), x, y) for i, (x, y) in enumerate(zip(va, vb, strict=True))]
                flow.step(where(p), read, outputs, op=_name(p.target))
                kinds = {flow.kinds.get(key) for key, _, _ in outputs}
                strongest = next((k for k in (_VALUES, _TRANSFORMED, _STATISTIC, _INDICES, _COUNT) if k in kinds), None)
                if strongest is not None:  # a consumer of the whole tuple reads what its parts are
                    flow.kinds[p] = strongest
            else:
                flow.step(where(p), read, [(p, va, vb)], same=_name(p.target) in _CONVERSIONS, op=_name(p.target))
    return True


@dataclass
class Trace:
    """The tensor operations of one run, in order: each as its name, the ids of the tensors it read, and the
    tensors it made; every tensor read, by id (all kept alive, so that no id is reused within the run); and the
    values the caller names (a step's loss and what it logs), told by :func:`trace_flow` where transformed."""

    ops: list[tuple[str, list[int], list[torch.Tensor]]] = field(default_factory=list)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    named: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class TracedFlow:
    """What two traces of one computation tell: where it mixes samples, each place as "where: operation (shape
    at a)" (:class:`SampleFlow`), and which of the named values are transformed statistics of the batch, with
    the place of their first transformation ([Note: statistics transformed])."""

    mixed: tuple[str, ...] = ()
    transformed: dict[str, str] = field(default_factory=dict)


class RecordOps(TorchDispatchMode):
    """Records every aten operation run inside into a :class:`Trace`."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        name = _name(func)
        self.trace.ops.append((name, [] if name in _SHAPE_ONLY else [id(t) for t in read], made))
        self.trace.tensors.update((id(t), t) for t in read)
        return out


def trace_flow(a: Trace, b: Trace, where: str) -> TracedFlow | None:
    """Where two traces of one computation at batch sizes ``a < b`` mix samples (see :class:`SampleFlow`),
    each place as "``where``: operation (shape at a)", and which values named in ``a`` are transformed
    statistics; None where the traces do not match op for op.

    The computation's inputs (tensors no operation made) are matched by the order in which it first reads them:
    per-sample where their sizes differ."""
    if len(a.ops) != len(b.ops):
        return None
    for x, y in zip(a.ops, b.ops, strict=True):
        if x[0] != y[0] or len(x[1]) != len(y[1]) or len(x[2]) != len(y[2]):
            return None
    flow = SampleFlow()
    keys: dict[int, str] = {}  # id of a tensor of run a -> its key: "in3" (an input), "op7.0" (made)
    for i, ((name, read_a, out_a), (_, read_b, out_b)) in enumerate(zip(a.ops, b.ops, strict=True)):
        for ia, ib in zip(read_a, read_b, strict=True):
            if ia not in keys:  # an input of the computation: per-sample or a constant
                keys[ia] = f"in{len(keys)}"
                flow.step(f"{where}: input", (), [(keys[ia], a.tensors.get(ia), b.tensors.get(ib))])
        read = [keys[ia] for ia in read_a]
        outputs = [(f"op{i}.{j}", ta, tb) for j, (ta, tb) in enumerate(zip(out_a, out_b, strict=True))]
        flow.step(f"{where}: {name}", read, outputs, same=name in _CONVERSIONS, op=name)
        keys.update((id(ta), key) for (key, ta, _) in outputs)
    named = {name: keys.get(id(t)) for name, t in a.named.items()}
    transformed = {name: flow.origins[key] for name, key in named.items() if key in flow.origins}
    return TracedFlow(flow.mixed(), transformed)
