"""The dtypes a "-mixed" precision gives the tensors crossing the blocks, found by one forward on meta.

[Note: cut dtypes under autocast] A model is captured in float32, so its blocks' inputs and the tensors at
its cuts are float32 in the capture. Under autocast they are whatever their producing op gives: a ResNet
block's ReLU output is bfloat16 (convolution, batch norm, add and ReLU all run in bf16), while a transformer's
residual stream stays float32 (a float32 embedding plus a bf16 projection promotes to float32). Profiling
each block on float32 inputs (as before) made autocast cast every input afresh: the cast copy was saved in
place of the input, so the tensor two neighbouring blocks both save was counted twice (ResNet-50x4 at batch 32
in bf16-mixed: 1.34x the H200's measured peak), and ops that run in their input's dtype (batch norm, ReLU)
saved float32 activations. Scaling every cut to the compute dtype instead halved a float32 residual stream.

:func:`with_autocast_dtypes` runs the blocks in order on meta under :class:`MetaAutocast` (the autocast op
lists of the device profiled or priced: CUDA's, or a CPU's), each on its inputs in the dtypes the earlier
blocks gave them, and returns the capture with every block's floating arguments and every cut in those
dtypes. The profiler then runs each block on the inputs it really gets. Where the chain cannot run on meta, the old assumption is kept (cuts in the compute dtype,
arguments as captured) and the profile's meta says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_autopart.capture.graph import Block, CapturedModel, TensorInfo
from lightning_autopart.profile.autocast_meta import MetaAutocast
from lightning_autopart.profile.precision import dtype_name, scaled_nbytes
from lightning_autopart.profile.sandbox import copy_program, release_program

__all__ = ["autocast_dtypes", "with_autocast_dtypes"]

_META = torch.device("meta")


def autocast_dtypes(captured: CapturedModel, compute: torch.dtype, device: str = "cuda") -> dict[str, torch.dtype]:
    """Dtype of every floating block output under ``device``'s autocast to ``compute``, by name (model inputs as
    given).

    Raises whatever a block's forward raises on meta; a block whose tensor arguments or outputs do not match
    its recorded inputs or outputs one for one raises ``ValueError``."""
    dtypes: dict[str, torch.dtype] = {}
    for block in captured.blocks:
        args = _retyped(block, dtypes, device=_META)
        program = copy_program(block.program, _META, torch.float32)
        try:
            with torch.no_grad(), MetaAutocast(compute, device):
                out = program(*args)
        finally:
            release_program(program, block.program)
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if len(leaves) != len(block.outputs):
            got, want = len(leaves), len(block.outputs)
            raise ValueError(f"block {block.name!r} gave {got} tensors for {want} outputs")
        for info, t in zip(block.outputs, leaves, strict=True):
            if t.is_floating_point():
                dtypes[info.name] = t.dtype
    return dtypes


def with_autocast_dtypes(
    captured: CapturedModel, compute: torch.dtype, device: str = "cuda"
) -> tuple[CapturedModel, str]:
    """``captured`` with its blocks' floating arguments and its cuts in the dtypes ``device``'s autocast to
    ``compute`` gives them (a shallow copy: programs are shared, ``captured`` is left as is), and how they were
    found.

    Where the blocks cannot run on meta, the cuts are taken to be in ``compute`` (arguments as captured)."""
    try:
        dtypes = autocast_dtypes(captured, compute, device)
        how = "autocast on meta"
    except Exception as error:  # the old assumption stands, and the profile's meta says why
        dtypes = {t.name: compute for cut in captured.cuts for t in cut if _floating(t)}
        how = f"assumed {compute} (autocast on meta failed: {type(error).__name__}: {error})"[:300]
        return dataclasses.replace(captured, cuts=[_infos(c, dtypes) for c in captured.cuts]), how
    blocks = [
        dataclasses.replace(
            b, args=_retyped(b, dtypes), inputs=_infos(b.inputs, dtypes), outputs=_infos(b.outputs, dtypes)
        )
        for b in captured.blocks
    ]
    cuts = [_infos(c, dtypes) for c in captured.cuts]
    return dataclasses.replace(captured, blocks=blocks, cuts=cuts), how


def _floating(info: TensorInfo) -> bool:
    dtype = getattr(torch, info.dtype, None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _infos(infos: tuple[TensorInfo, ...], dtypes: dict[str, torch.dtype]) -> tuple[TensorInfo, ...]:
    """``infos`` with the floating ones named in ``dtypes`` in that dtype (bytes scaled to match)."""
    return tuple(
        dataclasses.replace(i, dtype=dtype_name(dtypes[i.name]), nbytes=scaled_nbytes(i, dtypes[i.name]))
        if i.name in dtypes and _floating(i)
        else i
        for i in infos
    )


def _retyped(
    block: Block, dtypes: dict[str, torch.dtype], device: torch.device | None = None
) -> tuple[Any, ...]:
    """``block.args``, each floating tensor in the dtype ``dtypes`` gives its input (empty on ``device``)."""
    leaves, spec = tree_flatten(block.args)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(tensors) != len(block.inputs):
        got, want = len(tensors), len(block.inputs)
        raise ValueError(f"block {block.name!r} has {got} tensor arguments for {want} inputs")
    leaves = list(leaves)
    for i, info in zip(tensors, block.inputs, strict=True):
        t: torch.Tensor = leaves[i]
        dtype = dtypes.get(info.name, t.dtype) if t.is_floating_point() else t.dtype
        if device is not None:
            leaves[i] = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)
        elif dtype != t.dtype:
            leaves[i] = t.detach().to(dtype)
    return tuple(tree_unflatten(leaves, spec))
