"""Meta convolutions under MetaLayouts lay out their outputs and gradients as cuDNN does on this GPU
([Note: channels-last on meta] in capture/meta_layouts.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopart.capture.meta_layouts import MetaLayouts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _layout(t: torch.Tensor) -> str:
    last = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return "last" if t.is_contiguous(memory_format=last) and not t.is_contiguous() else "first"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("which", ["neither", "input", "weight", "both"])
@pytest.mark.parametrize("groups", [1, 16])
def test_meta_convolutions_match_cudnn(dtype: torch.dtype, dims: int, which: str, groups: int) -> None:
    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
    layouts = {}
    for device in ("cuda", "meta"):
        conv = (nn.Conv2d if dims == 2 else nn.Conv3d)(16, 16, 3, padding=1, groups=groups)
        conv = conv.to(device=device, dtype=dtype)
        x = torch.randn(4, 16, *[8] * dims, device=device, dtype=dtype)
        if which in ("weight", "both"):
            conv = conv.to(memory_format=fmt)
        if which in ("input", "both"):
            x = x.to(memory_format=fmt)
        x.requires_grad_(True)
        with MetaLayouts():
            y = conv(x)
            grad_x, grad_w = torch.autograd.grad(y, (x, conv.weight), torch.ones_like(y))
        layouts[device] = (_layout(y), _layout(grad_x), _layout(grad_w))
    assert layouts["meta"][:2] == layouts["cuda"][:2], layouts
