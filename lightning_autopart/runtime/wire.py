"""What crosses a cut between pipeline stages: every tensor as a floating "carrier", on every torch version.

[Note: wire format] torch.distributed.pipelining sends the outputs of a stage and receives them into buffers
of the next, then sends gradients back the same way. Its versions differ on the values that need no gradient:
torch 2.11 marks every receive buffer ``requires_grad`` (which an integer tensor refuses) and expects a
gradient back for every one of them, newer versions skip them. So a stage is wrapped (:class:`WireStage`)
so that what the library sees is the same everywhere:

- every value crossing a cut travels as a floating carrier: floating tensors as they are; integer and bool
  tensors reinterpreted bit for bit (``int64`` as ``float64``, ``int32`` as ``float32``, ``int16`` as
  ``float16``) or, one byte wide, converted by value to ``float16`` (exact for 0..255 and -128..127);
- the receiving stage decodes each carrier back to the captured dtype. A value that needs no gradient (see
  ``TensorInfo.requires_grad``: a mask, token ids, labels, rotary tables) is detached there, so autograd spends
  nothing on it, and its carrier gets an exact zero gradient (:class:`_Touch`), which every version sends back
  and the sender ignores. Values that need a gradient keep their autograd link.
- the zeros are made with the input gradients, at the end of the stage's backward: the touch sits on a received
  value that needs a gradient (on an output, or the last stage's loss, where none does). Made at the start,
  they were held through the whole backward, beside every activation (ViT-MAE's relayed images: a micro-batch
  of images more at its last stage's peak; a 4-D float attention mask would be as large).

Shapes and dtypes are given to the library up front (no shape inference that would run user code on
uninitialised tensors); they are found by :func:`infer_wire_metadata`, one forward of zeros through the
pipeline inside the training step's own precision context, because autocast changes the dtype of floating
values (a ``bf16-mixed`` linear sends bfloat16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_autopart.capture.graph import TensorInfo

__all__ = ["WireMeta", "WireStage", "decode", "encode", "infer_wire_metadata"]

#: Carrier dtype of each non-floating dtype width (bytes), reinterpreted bit for bit.
_BIT_CARRIERS = {8: torch.float64, 4: torch.float32, 2: torch.float16}


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def encode(value: torch.Tensor) -> torch.Tensor:
    """The floating carrier of ``value`` (see [Note: wire format]); floating tensors are their own carrier."""
    if _floating(value.dtype):
        return value
    value = value.detach().contiguous()
    carrier = _BIT_CARRIERS.get(value.element_size())
    return value.view(carrier) if carrier is not None else value.to(torch.float16)


def decode(carrier: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` that :func:`encode` turned into ``carrier``."""
    if _floating(dtype):
        return carrier
    carrier = carrier.detach()
    if torch.empty((), dtype=dtype).element_size() in _BIT_CARRIERS:
        return carrier.view(dtype)
    return carrier != 0 if dtype == torch.bool else carrier.to(dtype)


class _Touch(torch.autograd.Function):
    """Identity on ``anchor`` whose backward also gives each carrier in ``carriers`` an exact zero gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *carriers: torch.Tensor) -> torch.Tensor:
        ctx.metas = [(c.shape, c.dtype, c.device) for c in carriers]
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.metas]
        return (grad, *zeros)


def touch(anchor: torch.Tensor, carriers: Sequence[torch.Tensor]) -> torch.Tensor:
    """``anchor``, such that backward from it gives every carrier in ``carriers`` a zero gradient."""
    live = [c for c in carriers if c.requires_grad]
    return _Touch.apply(anchor, *live) if live and anchor.requires_grad else anchor


class WireStage(nn.Module):
    """A stage module as torch.distributed.pipelining sees it: carriers in (but on the first stage, which takes
    the model's inputs), carriers out (but on the last stage, which returns the model's outputs).

    Args:
        stage: The stage module (see ``lightning_autopart.runtime.stages``).
        inputs: The values the stage receives, as captured (dtype, gradient need); None on the first stage.
        outputs: The values the stage sends on; None on the last stage.
    """

    def __init__(
        self,
        stage: nn.Module,
        inputs: Sequence[TensorInfo] | None,
        outputs: Sequence[TensorInfo] | None,
    ) -> None:
        super().__init__()
        self.stage = stage
        self._in = None if inputs is None else [(_dtype(t), t.requires_grad) for t in inputs]
        self._out = None if outputs is None else [_dtype(t) for t in outputs]
        #: Carriers received without a gradient need in the last forward, for the loss to touch.
        self.untouched: list[torch.Tensor] = []

    def forward(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...] | list[torch.Tensor]:
        """Decode the received carriers, run the stage, encode what it sends on (the last stage: its outputs, as a
        list)."""
        untouched: list[torch.Tensor] = []
        if self._in is not None:
            decoded: list[torch.Tensor] = []
            anchor = None
            for carrier, (dtype, needs_grad) in zip(values, self._in, strict=True):
                if needs_grad and _floating(dtype):
                    if anchor is None and carrier.requires_grad:
                        anchor = len(decoded)
                    decoded.append(carrier)
                else:  # detached, floating ones too: autograd would save what multiplies them (rotary tables)
                    decoded.append(decode(carrier.detach(), dtype))
                    untouched.append(carrier)
            if anchor is not None and untouched:  # their zeros come with the input gradients: [Note: wire format]
                decoded[anchor] = touch(decoded[anchor], untouched)
                untouched = []
            values = tuple(decoded)
        outputs = self.stage(*values)
        if self._out is None:  # the last stage: the loss touches the carriers (see [Note: wire format])
            self.untouched = untouched
            return list(outputs)  # emptied once the loss is computed: [Note: the last stage's outputs]
        carriers = [encode(o) for o in outputs]
        anchor = next((i for i, c in enumerate(carriers) if c.requires_grad), None)
        if anchor is not None and untouched:
            carriers[anchor] = touch(carriers[anchor], untouched)
        return tuple(carriers)


def _dtype(info: TensorInfo) -> torch.dtype:
    dtype = getattr(torch, info.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"value {info.name} crossing a cut is not a tensor ({info.dtype})")
    return dtype


@dataclass(frozen=True)
class WireMeta:
    """Shapes and dtypes of one stage's carriers, as meta tensors (what ``PipelineStage`` takes up front)."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


def _metas(values: Sequence[torch.Tensor], requires_grad: bool) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.empty(v.shape, dtype=v.dtype, device="meta").requires_grad_(requires_grad and _floating(v.dtype))
        for v in values
    )


@torch.no_grad()
def infer_wire_metadata(
    stages: dict[int, WireStage],
    num_stages: int,
    first_inputs: Sequence[torch.Tensor] | None,
    device: torch.device,
    group: dist.ProcessGroup | None,
    rank_of_stage: dict[int, int],
) -> dict[int, WireMeta]:
    """Every local stage's carrier metadata, by one forward of zeros through the pipeline (no loss, no user step).

    Stages run in order; a stage on another rank sends its output metadata as an object. Buffers (BatchNorm
    statistics) and random state are restored, so the run leaves no trace.

    Args:
        stages: This rank's wire stages by stage index.
        num_stages: Stages of the pipeline.
        first_inputs: The first stage's micro-batch inputs (this rank holds stage 0), else None.
        device: This rank's device.
        group: The pipeline's process group (its ranks hold the stages).
        rank_of_stage: The global rank holding each stage of this pipeline.
    """
    out: dict[int, WireMeta] = {}
    me = dist.get_rank() if dist.is_initialized() else 0
    previous: tuple[torch.Tensor, ...] | None = None
    for s in sorted(stages):
        stage = stages[s]
        if s == 0:
            assert first_inputs is not None, "stage 0 needs the model's inputs"
            inputs = tuple(first_inputs)
            in_metas = _metas(inputs, requires_grad=False)
        else:
            if previous is None or rank_of_stage[s - 1] != me:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=rank_of_stage[s - 1], group=group, device=_obj_device(device))
                previous = box[0]
            assert previous is not None
            in_metas = _metas(previous, requires_grad=True)
            inputs = tuple(torch.zeros(m.shape, dtype=m.dtype, device=device) for m in in_metas)
        with _restored(stage, device):
            outputs = stage(*inputs)
        previous = _metas(outputs, requires_grad=False)
        out[s] = WireMeta(in_metas, _metas(outputs, requires_grad=s < num_stages - 1))
        if s < num_stages - 1 and rank_of_stage[s + 1] != me:
            dist.send_object_list([previous], dst=rank_of_stage[s + 1], group=group, device=_obj_device(device))
            previous = None
    return out


def _obj_device(device: torch.device) -> torch.device | None:
    """Object collectives stage their bytes on the process group's device (CUDA for NCCL)."""
    return device if device.type == "cuda" else None


class _restored:
    """Keep a stage's buffers and the random state as they were around a metadata forward."""

    def __init__(self, stage: nn.Module, device: torch.device) -> None:
        self._stage = stage
        self._devices = [device] if device.type == "cuda" else []

    def __enter__(self) -> None:
        self._saved = [(b, b.detach().clone()) for b in self._stage.buffers()]
        self._rng = torch.random.fork_rng(devices=self._devices)
        self._rng.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._rng.__exit__(*exc)
        for buffer, saved in self._saved:
            buffer.copy_(saved)
        self._saved = []
