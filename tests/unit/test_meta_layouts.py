"""Meta convolutions return the layout a GPU's (and the CPU's) return, so captures and estimates of a
channels-last model stay channels-last ([Note: channels-last on meta] in capture/meta_layouts.py), and three
kernels' outputs take the kernels' layouts ([Note: kernel layouts on meta])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.meta_layouts import MetaLayouts
from lightning_autopart.profile import profile
from lightning_autopart.profile.saved import SavedTensorMeter


def _last(t: torch.Tensor) -> bool:
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return t.is_contiguous(memory_format=fmt) and not t.is_contiguous()


def conv_layouts(
    device: str, dims: int, which: str, groups: int, dtype: torch.dtype = torch.float32
) -> tuple[bool, bool]:
    """Whether a convolution's output and input gradient come out channels-last on ``device``, with the
    input, the weight, both or neither (``which``) channels-last; under :class:`MetaLayouts`."""
    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
    torch.manual_seed(0)
    conv = (nn.Conv2d if dims == 2 else nn.Conv3d)(8, 8, 3, padding=1, groups=groups).to(device, dtype)
    x = torch.randn(2, 8, *[6] * dims, device=device, dtype=dtype)
    if which in ("weight", "both"):
        conv = conv.to(memory_format=fmt)
    if which in ("input", "both"):
        x = x.to(memory_format=fmt)
    x.requires_grad_(True)
    with MetaLayouts():
        y = conv(x)
        (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))  # as the kernel returns it
    return _last(y), _last(grad)


@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("which", ["neither", "input", "weight", "both"])
@pytest.mark.parametrize("groups", [1, 8])
def test_meta_convolutions_lay_out_their_outputs_and_gradients_as_cudnn_does(
    dims: int, which: str, groups: int
) -> None:
    """cuDNN runs channels-last when the input or the weight is; oneDNN on the CPU agrees except for a
    channels-last weight alone, which it keeps channels-first (in 3-D, and for 2-D input gradients)."""
    meta = conv_layouts("meta", dims, which, groups)
    assert meta == ((which != "neither"),) * 2  # cuDNN's rule
    if which != "weight":
        assert meta == conv_layouts("cpu", dims, which, groups)


def _batch_norm(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.batch_norm(x, None, None, training=True)


#: Operations whose kernels lay out an output otherwise than meta (see [Note: kernel layouts on meta]):
#: the input's shape, whether it is transposed (non-contiguous), and the forward.
LAYOUT_CASES = {
    "layer_norm": ((4, 8, 16), False, lambda x: nn.functional.layer_norm(x, (16,))),
    "log_softmax": ((4, 8, 16), False, lambda x: x.log_softmax(-1)),
    "batch_norm": ((4, 16, 8), False, _batch_norm),
    "batch_norm channels-last": ((2, 16, 4, 4), False, _batch_norm),
    "batch_norm transposed": ((2, 16, 4, 4), True, _batch_norm),
    "mse_loss": ((4, 8, 16), True, lambda x: nn.functional.mse_loss(x, 0 * x.detach(), reduction="none")),
    "softplus": ((4, 8, 16), True, nn.functional.softplus),
    "hardswish": ((4, 8, 16), True, nn.functional.hardswish),
    "elu": ((4, 8, 16), True, nn.functional.elu),
    "log_sigmoid": ((4, 8, 16), True, nn.functional.logsigmoid),
}


def kernel_strides(device: str, case: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The strides of ``case``'s output and of the input gradient its backward returns on ``device``, for an
    incoming gradient of permuted strides (as after a permute in the forward); under :class:`MetaLayouts`."""
    shape, transposed, forward = LAYOUT_CASES[case]
    x = torch.randn(*shape, device=device, dtype=dtype)
    if case.endswith("channels-last"):
        x = x.to(memory_format=torch.channels_last)
    if transposed:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    x.requires_grad_(True)
    with MetaLayouts():
        y = forward(x)
        g = torch.ones(*reversed(y.shape), device=device, dtype=dtype).permute(*reversed(range(y.dim())))
        (grad,) = torch.autograd.grad(y, x, g)  # as the kernel returns it
    return y.stride(), grad.stride()


#: Cases where the CPU's kernel lays out the forward's output otherwise than CUDA's, which meta follows:
#: CUDA's batch norm and log-sigmoid keep a transposed input's strides (an H200, twice), the CPU's make their
#: output contiguous.
CUDA_FORWARD = {"batch_norm transposed", "log_sigmoid"}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_meta_kernels_lay_out_their_outputs_as_the_cpus_do(case: str) -> None:
    meta, cpu = kernel_strides("meta", case), kernel_strides("cpu", case)
    if case in CUDA_FORWARD:
        shape = LAYOUT_CASES[case][0]
        transposed = torch.empty(shape).transpose(-1, -2).contiguous().transpose(-1, -2)
        assert meta[0] == transposed.stride() != cpu[0]  # as on CUDA: tests/gpu/test_meta_layouts_cuda.py
        meta, cpu = meta[1:], cpu[1:]
    assert meta == cpu


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()) for _ in range(3)]
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x).mean((2, 3)))


def _conv_times(channels_last: bool) -> list[float]:
    with torch.device("meta"):
        model = ConvNet()
    x = torch.randn(16, 32, 28, 28, device="meta")
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    captured = capture(model, x)
    convs = [k for k, b in enumerate(captured.blocks) if b.modules in [("layers.1.0",), ("layers.2.0",)]]
    assert len(convs) == 2
    assert all(_last(captured.blocks[k].args[0]) == channels_last for k in convs)  # carried channels-last
    estimated = profile(captured, mode="estimate", spec="h100")
    return [estimated.blocks[k].fwd_us + estimated.blocks[k].bwd_us for k in convs]


def test_a_channels_last_model_on_meta_is_priced_without_the_transposes_of_channels_first() -> None:
    """cuDNN transposes channels-first operands around its tensor-core kernels ([Note: conv relayout]); a
    channels-last model has none to pay after its first layer, as before it."""
    second, third = _conv_times(channels_last=True)
    nchw_second, nchw_third = _conv_times(channels_last=False)
    assert nchw_second == pytest.approx(nchw_third, rel=1e-6)
    assert second == pytest.approx(third, rel=1e-6)  # the same layer, the same layout: the same price
    assert second < 0.8 * nchw_second


def test_log_sigmoid_saves_no_buffer_on_meta_as_on_cuda() -> None:
    """CUDA's log-sigmoid keeps no buffer for its backward (tests/gpu/test_meta_layouts_cuda.py); the CPU's
    does. On meta only the input is saved, and the backward still runs."""
    x = torch.randn(4, 8, 16, device="meta", requires_grad=True)
    meter = SavedTensorMeter()
    with MetaLayouts(), meter.hooks():
        y = nn.functional.logsigmoid(x)
    assert meter.nbytes == x.numel() * x.element_size()
    with MetaLayouts():
        (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert grad.shape == x.shape
