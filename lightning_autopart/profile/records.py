"""Profiled blocks as flat records of numbers: the boundary between profiling and planning.

These records import nothing from torch, so the planner, the plan files and the CLI's ``show`` can use them
anywhere. Every field carries its unit in its name (``fwd_us``, ``activation_bytes``). Times and activation
sizes are given at ``ModelProfile.batch_size`` samples.

[Note: cost curves] A block's cost is not linear in the batch: a ``Linear(5000, 5000)`` at 2 samples is bound by
reading its weight, at 512 by its FLOPs. So a block also carries a curve: its costs at several batch sizes,
``(samples, fwd_us, bwd_us, activation_bytes, transient_bytes, cut_bytes)`` rising in ``samples``. Between two
points a cost is linear (an estimate puts points at every size where an operation turns from memory- to
compute-bound, so it is exact there; a measurement times sizes up to the largest micro-batch), beyond the last
point it follows the last segment, and below the first (curves start at one sample) it is the first point's.
:func:`cost_at` reads it; a profile without curves scales the fields as ``fixed + per_sample * batch``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_autopart.capture.graph import CapturedModel

__all__ = [
    "BlockCostAt",
    "BlockProfile",
    "CostPoint",
    "ModelProfile",
    "TiedParam",
    "capture_fingerprint",
    "cost_at",
    "fingerprint_of",
    "with_curve",
]

#: One point of a cost curve: (samples, fwd_us, bwd_us, activation_bytes, transient_bytes, cut_bytes).
CostPoint = tuple[int, float, float, int, int, int]

@dataclass(frozen=True, slots=True)
class BlockProfile:
    """One candidate pipeline unit: a contiguous piece of the model, cut only at its boundaries."""

    #: Block name, usually the FQN of the module it covers ("layers.3"), or "a..b" for merged glue.
    name: str
    #: FQNs of the modules this block owns (the stage that holds the block instantiates them).
    modules: tuple[str, ...]
    #: FQNs and shapes of the parameters first used by this block (tied parameters appear at first use).
    param_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    #: Number of parameter elements first used by this block.
    param_count: int
    #: Bytes of those parameters.
    param_bytes: int
    #: Bytes of their gradients (trainable parameters only).
    grad_bytes: int
    #: Bytes of optimizer state for them (by optimizer type).
    optimizer_bytes: int
    #: Bytes of buffers (BatchNorm statistics, ...).
    buffer_bytes: int
    #: Forward time in microseconds at ``ModelProfile.batch_size``.
    fwd_us: float
    #: Backward time in microseconds at ``ModelProfile.batch_size``.
    bwd_us: float
    #: Part of ``fwd_us`` that does not scale with batch size (kernel launches, Python overhead).
    fwd_fixed_us: float
    #: Part of ``bwd_us`` that does not scale with batch size.
    bwd_fixed_us: float
    #: Bytes saved for backward by this block at ``batch_size`` (measured with saved-tensor hooks).
    activation_bytes: int
    #: Bytes of every tensor crossing the cut right after this block at ``batch_size`` (skips and fan-out
    #: included); for the last block, the bytes of the model's outputs.
    cut_bytes: int
    #: Forward floating-point operations at ``batch_size`` (0 when unknown).
    fwd_flops: float = 0.0
    #: Bytes allocated at the peak of the block's forward and backward beyond its parameters and the tensors it
    #: saves (the gradients and temporaries of backward), at ``batch_size``.
    transient_bytes: int = 0
    #: The block's costs at several batch sizes (see [Note: cost curves]); empty: linear in the batch.
    curve: tuple[CostPoint, ...] = ()
    #: Time of the optimizer step over the parameters this block owns, once per step (memory bound).
    optimizer_us: float = 0.0
    #: Autocast's low-precision copies of the block's weights that each forward makes and its backward keeps
    #: ("-mixed"; [Note: weight casts] in partition/cost.py).
    cast_bytes: int = 0
    #: What ``transient_bytes`` grows by where backward makes the parameters' gradients instead of adding into
    #: them: those made by its peak ([Note: gradients made by the peak] in profile/transient.py).
    fresh_extra_bytes: int = 0
    #: Share of the bytes crossing the cut before this block that both this block and the previous one save
    #: for backward: one tensor when the two share a stage (see [Note: saved twice]).
    saved_by_previous: float = 0.0
    #: Shares of the bytes crossing the cut before this block (the model's inputs for the first) and of those
    #: crossing the cut after it that this block saves for backward as they are: a stage starting here saves
    #: part of its receive buffers, a stage ending here keeps the rest of its output until its backward (see
    #: [Note: pipeline buffers] in partition/cost.py).
    saved_input_share: float = 0.0
    saved_output_share: float = 0.0
    #: Shares of the bytes crossing the cut after this block that an earlier block made (its index, -1 for the
    #: model's inputs; ascending, one entry per producer) and that this block neither makes nor saves: a stage
    #: ending here and starting after their producer sends them as it received them, so the output it keeps
    #: is its receive buffer or the batch (see [Note: pipeline buffers] in partition/cost.py).
    passed_shares: tuple[tuple[int, float], ...] = ()
    #: The same for the values made before this block that it saves as it passes them on: a stage's outputs
    #: hold them as activations, and its sends of them are its receive buffer too.
    saved_passed_shares: tuple[tuple[int, float], ...] = ()
    #: Part of ``grad_bytes`` for parameters only blocks with every output dead use (a head the loss never
    #: reaches): no gradient is ever made for them, so a single replica never holds it; replicas' all-reduce
    #: buckets do (see [Note: unreached gradients] in partition/fresh.py).
    unreached_grad_bytes: int = 0
    #: Host time (Python, dispatch, kernel launches) of the forward and of the backward, per micro-batch, on a
    #: device the host feeds ahead of time (CUDA; see [Note: host and device] in cuda_clock.py). 0: unknown, or
    #: the host does the math itself (CPU), where ``fwd_us``/``bwd_us`` hold it.
    host_fwd_us: float = 0.0
    host_bwd_us: float = 0.0
    #: Time of adding one micro-batch's gradients into the parameters this block owns (every micro-batch but
    #: a step's first; see [Note: gradient accumulation] in step.py).
    accumulate_us: float = 0.0
    #: Bytes the forward saves for the block's dead outputs alone (a head the loss skips, a value nothing
    #: uses), at ``ModelProfile.batch_size``: freed before backward, so not in ``activation_bytes``, but held
    #: until the forward's end ([Note: a dead part's saves]).
    dropped_bytes: int = 0
    #: Whether the block differentiates nothing (every output dead, or none needs a gradient): it runs no
    #: backward, and ``transient_bytes`` is its forward's peak, the inputs it saves included.
    forward_only: bool = False


# [Note: saved twice]
# Blocks are profiled apart, each on its own copy of its inputs, so a tensor that block k-1 saves as its output
# and block k saves as its input (a ResNet block's ReLU output, which the next block's first convolution saves) is
# counted in both blocks' ``activation_bytes``. In one stage it is one tensor; across a stage boundary it is
# two (the receiver saves its own received copy). The same holds for an input that block k-1 saves and passes on
# to block k, which saves it too (an attention's query, key and value projections captured as blocks of their
# own, each saving the hidden states). The profiler records which inputs and outputs each block saves by name and
# sets ``saved_by_previous``; the planner subtracts that share of the cut from a block's activations unless the
# block starts its stage. Counting it twice overstated ResNet-50's saved activations by 28%; counting ALBERT's
# hidden states once per projection (and once more in the output its stage kept) put an interleaved rank's
# predicted peak at 1.107 of the measured one (1.021 since: ``bench/pipeline_sweep.py``).


@dataclass(frozen=True, slots=True)
class BlockCostAt:
    """A block's costs at one batch size."""

    fwd_us: float
    bwd_us: float
    activation_bytes: int
    transient_bytes: int
    cut_bytes: int


def cost_at(block: BlockProfile, samples: int, batch_size: int) -> BlockCostAt:
    """``block``'s costs at ``samples`` (see [Note: cost curves]); ``batch_size`` is its profile's batch."""
    curve = block.curve
    if not curve:
        scale = samples / batch_size
        return BlockCostAt(
            block.fwd_fixed_us + (block.fwd_us - block.fwd_fixed_us) * scale,
            block.bwd_fixed_us + (block.bwd_us - block.bwd_fixed_us) * scale,
            -(-block.activation_bytes * samples // batch_size),
            -(-block.transient_bytes * samples // batch_size),
            -(-block.cut_bytes * samples // batch_size),
        )
    if samples <= curve[0][0] or len(curve) == 1:
        lo = hi = curve[0]
    else:
        k = 1
        while k < len(curve) - 1 and curve[k][0] < samples:
            k += 1
        lo, hi = curve[k - 1], curve[k]
    span = hi[0] - lo[0]
    t = (samples - lo[0]) / span if span else 0.0

    def at(i: int) -> float:
        return max(0.0, lo[i] + (hi[i] - lo[i]) * t)

    return BlockCostAt(at(1), at(2), int(-(-at(3) // 1)), int(-(-at(4) // 1)), int(-(-at(5) // 1)))


def with_curve(block: BlockProfile, points: list[CostPoint] | tuple[CostPoint, ...]) -> BlockProfile:
    """``block`` with the cost curve ``points`` (ascending sizes), its figures those of the largest size."""
    top = points[-1]
    return dataclasses.replace(
        block,
        curve=tuple(points),
        fwd_us=top[1],
        bwd_us=top[2],
        activation_bytes=top[3],
        transient_bytes=top[4],
        cut_bytes=top[5],
    )


@dataclass(frozen=True, slots=True)
class TiedParam:
    """A parameter used by several blocks (a tied embedding and output head, say)."""

    #: FQN of the parameter.
    name: str
    #: Bytes of the parameter itself.
    param_bytes: int
    #: Indices of the blocks that use it, ascending; the first one owns it in ``BlockProfile.param_bytes``.
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class ModelProfile:
    """Everything the planner knows about a model: its blocks in execution order, profiled at one batch size."""

    #: Model class name.
    model: str
    #: Blocks in execution order.
    blocks: tuple[BlockProfile, ...]
    #: Samples in the batch the profile was taken at.
    batch_size: int
    #: Bytes of the model's inputs at ``batch_size`` (what the first stage receives).
    input_bytes: int
    #: Parameters shared between blocks.
    tied: tuple[TiedParam, ...] = ()
    #: "measure" (timed on a device) or "estimate" (roofline model of a device spec).
    mode: str = "estimate"
    #: Device the times refer to: a spec name ("a100-40gb") or the measured device ("cuda:0", "cpu").
    device: str = "cpu"
    #: Optimizer whose state ``optimizer_bytes`` counts.
    optimizer: str = "sgd"
    #: Parameter dtype.
    dtype: str = "float32"
    #: How the blocks were captured: "export" (torch.export graph) or "modules" (module hooks).
    capture: str = "export"
    #: Free-form details (input shapes, profiling settings).
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return len(self.blocks)

    @property
    def param_count(self) -> int:
        """Total parameter elements (tied parameters counted once)."""
        return sum(b.param_count for b in self.blocks)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the model in a plan file (see :func:`fingerprint_of`)."""
        return fingerprint_of(self.model, ((b.name, b.param_shapes, b.param_count) for b in self.blocks))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Inverse of :meth:`to_dict`."""
        blocks = tuple(
            BlockProfile(
                **{
                    **b,
                    "modules": tuple(b["modules"]),
                    "param_shapes": tuple((n, tuple(s)) for n, s in b["param_shapes"]),
                    "curve": tuple(tuple(p) for p in b.get("curve", ())),
                    **{
                        key: tuple((int(k), float(x)) for k, x in b.get(key, ()))
                        for key in ("passed_shares", "saved_passed_shares")
                    },
                }
            )
            for b in data["blocks"]
        )
        tied = tuple(TiedParam(t["name"], t["param_bytes"], tuple(t["blocks"])) for t in data.get("tied", ()))
        rest = {k: v for k, v in data.items() if k not in ("blocks", "tied")}
        return cls(blocks=blocks, tied=tied, **rest)


#: Per block: its name, the FQNs and shapes of the parameters it owns (first use), and their element count.
BlockParams = tuple[str, Sequence[tuple[str, Sequence[int]]], int]


def fingerprint_of(model: str, blocks: Iterable[BlockParams]) -> dict[str, Any]:
    """What identifies a model in a plan file: its class name and, per block, its name, parameter count and a
    digest of its parameters' names and shapes (plus the total count).

    The one definition behind :meth:`ModelProfile.fingerprint` (a plan made by ``autopart plan`` or by the
    strategy) and :func:`capture_fingerprint` (a model about to run a loaded plan), so the two always agree.
    """
    records = []
    total = 0
    for name, shapes, count in blocks:
        pairs = [[fqn, [int(d) for d in shape]] for fqn, shape in shapes]
        digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]
        records.append({"name": name, "param_count": count, "shapes_sha256": digest})
        total += count
    return {"model": model, "param_count": total, "blocks": records}


def capture_fingerprint(captured: CapturedModel) -> dict[str, Any]:
    """:func:`fingerprint_of` a captured model, without profiling it: equal to the fingerprint of its profile
    (ownership of tied parameters by first use, as the profiler counts it), so a loaded plan is checked
    against the one capture the runtime makes anyway."""
    from lightning_autopart.profile.memory import account_memory  # torch: only here, never at import

    owned, _ = account_memory(captured, None, 0.0)
    return fingerprint_of(
        type(captured.module).__name__,
        ((b.name, m.param_shapes, m.param_count) for b, m in zip(captured.blocks, owned, strict=True)),
    )
