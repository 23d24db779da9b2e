"""Meta convolutions under MetaLayouts lay out their outputs and gradients as cuDNN does on this GPU
([Note: channels-last on meta] in capture/meta_layouts.py), and other kernels' outputs as
CUDA's kernels do ([Note: kernel layouts on meta])."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_meta_layouts import LAYOUT_CASES, conv_layouts, kernel_strides

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("which", ["neither", "input", "weight", "both"])
@pytest.mark.parametrize("groups", [1, 8])
def test_meta_convolutions_match_cudnn(dtype: torch.dtype, dims: int, which: str, groups: int) -> None:
    meta = conv_layouts("meta", dims, which, groups, dtype)
    assert meta == conv_layouts("cuda", dims, which, groups, dtype), (dims, which, groups, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_meta_kernels_lay_out_their_outputs_as_cudas_do(dtype: torch.dtype, case: str) -> None:
    assert kernel_strides("meta", case, dtype) == kernel_strides("cuda", case, dtype), (case, dtype)


def test_cudas_log_sigmoid_keeps_no_buffer() -> None:
    """What meta follows (tests/unit/test_meta_layouts.py: a log-sigmoid on meta saves no buffer)."""
    x = torch.randn(4, 8, 16, device="cuda")
    assert torch.ops.aten.log_sigmoid_forward(x)[1].numel() == 0
