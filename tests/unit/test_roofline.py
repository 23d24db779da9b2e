"""Unit tests of the GEMM-aware roofline: device peaks, TF32, tiles and waves, and exact cost curves."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from examples.gpt import Block as GPTBlock
from examples.resnet import Bottleneck
from lightning_autopart.capture import capture
from lightning_autopart.capture.graph import Block, CapturedModel
from lightning_autopart.devices import device_spec, tf32_convolutions, tf32_matmuls
from lightning_autopart.errors import ConfigError
from lightning_autopart.profile import calibrate_cpu
from lightning_autopart.profile.estimate import batch_sizes, estimate_block, estimate_curve
from lightning_autopart.profile.gemms import Gemm, conv_gemms
from lightning_autopart.profile.opcount import SIMT_TILE, TENSOR_CORE_TILE, OpCounter, Roofline
from lightning_autopart.profile.precision import Precision, parse_precision
from tests.models import GPT

H100 = device_spec("h100")


@pytest.fixture
def restore_tf32() -> Iterator[None]:
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


# ---------------------------------------------------------------------------------------------------------
# Device specs
# ---------------------------------------------------------------------------------------------------------


def test_specs_have_sm_counts_and_tf32_peaks() -> None:
    sms = {"v100": 80, "a100": 108, "a100-80gb": 108, "h100": 132, "h200": 132}
    assert {name: device_spec(name).sm_count for name in sms} == sms
    assert device_spec("v100").tf32_flops == 0.0  # Volta has no TF32
    assert device_spec("a100").tf32_flops == 156e12 and H100.tf32_flops == 494.7e12
    for name in sms:
        s = device_spec(name)
        assert s.fp32_flops < s.matmul_flops("float32", tf32=True) <= s.bf16_flops or s.tf32_flops == 0.0


def test_matmul_peak_by_math() -> None:
    assert H100.matmul_flops("float32", tf32=False) == H100.fp32_flops == 67e12
    assert H100.matmul_flops("float32", tf32=True) == 494.7e12
    assert H100.matmul_flops("bfloat16", tf32=False) == H100.matmul_flops("float16", tf32=True) == 989e12
    assert H100.matmul_flops("float64", tf32=True) == H100.fp32_flops  # TF32 is for float32 only
    v100 = device_spec("v100")
    assert v100.matmul_flops("float32", tf32=True) == v100.fp32_flops  # asked for, but there is none
    assert H100.tensor_cores("float32", tf32=True) and not H100.tensor_cores("float32", tf32=False)
    assert H100.tensor_cores("bfloat16", tf32=False)


def test_cpu_spec_has_one_sm_and_no_tensor_cores() -> None:
    for spec in (device_spec("cpu"), calibrate_cpu()):
        assert spec.sm_count == 1 and spec.tf32_flops == 0.0
        assert spec.matmul_flops("float32", tf32=True) == spec.fp32_flops
        assert not spec.tensor_cores("float32", tf32=True) and not spec.tensor_cores("bfloat16", tf32=True)


def test_tf32_follows_torch_settings(restore_tf32: None) -> None:
    torch.set_float32_matmul_precision("highest")
    assert not tf32_matmuls()
    assert Roofline.of(H100, "float32").matmul == Roofline.of(H100, "float32", tf32=False).matmul
    for setting in ("high", "medium"):
        torch.set_float32_matmul_precision(setting)
        assert tf32_matmuls()
    rate = Roofline.of(H100, "float32").matmul
    assert rate is not None and rate.flops_per_us == pytest.approx(494.7e12 * H100.flops_efficiency / 1e6)
    torch.backends.cudnn.allow_tf32 = False
    assert not tf32_convolutions()
    conv = Roofline.of(H100, "float32").conv
    assert conv is not None and conv.flops_per_us == pytest.approx(67e12 * H100.flops_efficiency / 1e6)


def test_tf32_changes_the_float32_matmul_peak_only() -> None:
    off = Roofline.of(H100, "float32", waves=True, tf32=False, conv_tf32=False)
    on = Roofline.of(H100, "float32", waves=True, tf32=True, conv_tf32=False)
    assert off.matmul is not None and on.matmul is not None and on.conv is not None
    assert on.matmul.flops_per_us / off.matmul.flops_per_us == pytest.approx(494.7 / 67)
    assert (off.matmul.tile, on.matmul.tile) == (SIMT_TILE, TENSOR_CORE_TILE)
    assert on.conv == off.conv and on.flops_per_us == off.flops_per_us  # convolutions, other ops: unchanged
    g = Gemm("matmul", 1, 4096, 4096, 4096)
    assert on.op_us(g.flops, 0.0, (g,)) < off.op_us(g.flops, 0.0, (g,)) / 5
    bf16 = [Roofline.of(H100, "bfloat16", waves=True, tf32=t).matmul for t in (False, True)]
    assert bf16[0] == bf16[1]


# ---------------------------------------------------------------------------------------------------------
# Tiles and waves
# ---------------------------------------------------------------------------------------------------------


def _rate(dtype: str = "float32", tf32: bool = False, spec: Any = H100) -> Any:
    rate = Roofline.of(spec, dtype, waves=True, tf32=tf32).matmul
    assert rate is not None
    return rate


def test_wave_quantization_of_a_short_wide_product() -> None:
    rate = _rate()
    g = Gemm("matmul", 1, 512, 5000, 5000)  # (512 x 5000) @ (5000 x 5000)
    per_sm = 67e12 * 0.6 / 132 / 1e6
    # 128 x 128 tiles would make 160 tiles: 2 waves, 61 % of the SM-time busy; the library's 128 x 32 kernel
    # (as cuBLAS ran it on an H100) makes 628 tiles in 5 waves, 95 % busy, and is the fastest plan
    assert rate.waves(g) == (4 * 157, 1, 5)
    tile_us = 2 * 128 * 32 * 5000 / per_sm
    assert rate.compute_us(g) == (pytest.approx(5 * tile_us), 0.0)
    assert rate.compute_us(g)[0] < 2 * (2 * 128 * 128 * 5000 / per_sm)
    busy = (512 * 5000) / (5 * 132 * 128 * 32)  # useful outputs over the SM-time of five waves of tiles
    assert rate.compute_us(g)[0] == pytest.approx(g.flops / rate.flops_per_us / busy)


def test_a_misaligned_tensor_core_product_runs_one_element_per_load() -> None:
    """GPT-2's LM head (vocabulary 50257) in bfloat16: cuBLAS falls back to ``align1`` kernels, measured on an
    H100 at 95-148 TFLOP/s (8 x 1024 tokens, d 768); the peak over 8 elements per 16-byte load is 124."""
    rate = _rate("bfloat16")
    head, aligned = Gemm("matmul", 1, 8192, 50257, 768), Gemm("matmul", 1, 8192, 50256, 768)
    assert rate.misaligned(head) and not rate.misaligned(aligned)
    assert rate.compute_us(head)[0] == pytest.approx(head.flops / (989e12 / 8 / 1e6))
    assert rate.compute_us(head)[0] > 4 * rate.compute_us(aligned)[0]
    assert _rate("float32", tf32=True).align == 4 and _rate("float32").align == 1  # FMA units: no such rule


def test_a_channels_first_convolution_on_tensor_cores_pays_its_relayout() -> None:
    """cuDNN's tensor-core kernels take NHWC operands: an NCHW input and output are transposed (see
    [Note: conv relayout]); channels-last tensors and the FMA-unit path move only their own bytes."""
    conv = nn.Conv2d(64, 64, 3, padding=1, device="meta")
    act = 8 * 64 * 32 * 32 * 4

    def moved(tf32: bool, memory_format: torch.memory_format, layer: nn.Module = conv) -> float:
        x = torch.empty(8, 64, 32, 32, device="meta").contiguous(memory_format=memory_format)
        counter = OpCounter(Roofline.of(H100, "float32", waves=True, tf32=tf32, conv_tf32=tf32))
        with counter:
            counter.phase = "fwd"
            layer(x)
        return counter.counts["fwd"].nbytes

    plain = moved(False, torch.contiguous_format)
    assert (
        moved(True, torch.contiguous_format) == plain + 2 * 2 * act
    )  # input and output, each read + written
    assert moved(True, torch.channels_last) == moved(False, torch.channels_last) == plain
    # A channels-last weight makes cuDNN run channels-last: it copies the NCHW input in, and only that.
    last_weight = nn.Conv2d(64, 64, 3, padding=1, device="meta").to(memory_format=torch.channels_last)
    assert moved(True, torch.contiguous_format, last_weight) == plain + 2 * act


def test_a_large_product_fills_the_sms() -> None:
    rate = _rate()
    g = Gemm("matmul", 1, 8192, 2304, 768)  # (8192 x 768) @ (768 x 2304): GPT-2 small's qkv at 8 x 1024
    tiles, split, waves = rate.waves(g)
    assert split == 1 and tiles / (waves * 132) > 0.96  # 128 x 128 tiles would already fill 97 %
    assert rate.compute_us(g)[0] == pytest.approx(g.flops / rate.flops_per_us / (tiles / (waves * 132)))


def test_tensor_core_tile_takes_the_better_orientation() -> None:
    rate = _rate(tf32=True)
    assert rate.tile == (128, 256)
    assert rate.waves(Gemm("matmul", 1, 512, 5000, 5000)) == (80, 1, 1)
    assert rate.waves(Gemm("matmul", 1, 5000, 256, 64))[0] == 40  # 256 x 128: ceil(5000 / 256) x 2
    assert rate.waves(Gemm("matmul", 1, 256, 5000, 64))[0] == 40  # 128 x 256: 2 x ceil(5000 / 256)


def test_batched_products_share_the_waves() -> None:
    rate = _rate()
    g = Gemm("matmul", 96, 1024, 1024, 64)  # attention scores of 8 x 12 heads
    tiles, split, waves = rate.waves(g)
    assert split == 1 and waves == math.ceil(tiles / 132) and tiles % 96 == 0  # the heads' tiles, pooled


def test_small_outputs_split_k() -> None:
    rate = _rate()
    g = Gemm("matmul", 1, 768, 768, 8192)  # a weight gradient: 36 tiles, K = tokens
    tiles, split, waves = rate.waves(g)
    assert (tiles, split, waves) == (18, 7, 1)  # 256 x 128 tiles, K in 7 slices: 126 of 132 SMs busy
    us, extra = rate.compute_us(g)
    assert us == pytest.approx(2 * 256 * 128 * math.ceil(8192 / 7) / (rate.flops_per_us / 132))
    assert extra == 2 * 7 * 768 * 768 * 4  # float32 partial sums written and read
    assert rate.waves(Gemm("matmul", 1, 128, 128, 300)) == (4, 2, 1)  # 64 x 64 tiles; slices keep 256 of K


def test_tiles_never_exceed_the_matrix() -> None:
    r = Roofline.of(H100, "float32", waves=True, tf32=False)
    g = Gemm("matmul", 1, 2, 5000, 5000)  # a Linear(5000, 5000) at 2 samples: reads its 100 MB weight
    nbytes = (2 * 5000 * 2 + 5000 * 5000) * 4.0
    assert r.op_us(g.flops, nbytes, (g,)) == pytest.approx(nbytes / r.bytes_per_us + r.launch_us, rel=0.01)


def test_no_waves_on_one_sm_or_when_turned_off() -> None:
    g = Gemm("matmul", 1, 512, 5000, 5000)
    for r in (Roofline.of(calibrate_cpu(), "float32", waves=True), Roofline.of(H100, "float32", tf32=False)):
        assert r.matmul is not None
        assert r.op_us(g.flops, 0.0, (g,)) == pytest.approx(g.flops / r.matmul.flops_per_us + r.launch_us)
    plain = Roofline(1e6, 1e6, 1.0)  # no rates at all: a product costs its FLOPs at the plain rate
    assert plain.op_us(g.flops, 0.0, (g,)) == pytest.approx(g.flops / 1e6 + 1.0)


def test_other_ops_stay_on_the_plain_roofline() -> None:
    r = Roofline.of(H100, "float32", waves=True)
    assert r.op_us(1e9, 1e6) == pytest.approx(max(1e9 / r.flops_per_us, 1e6 / r.bytes_per_us) + r.launch_us)


# ---------------------------------------------------------------------------------------------------------
# The products the counter finds
# ---------------------------------------------------------------------------------------------------------


def _counted_ops(fn: Callable[[], Any]) -> list[Any]:
    counter = OpCounter(Roofline.of(H100, "float32", waves=True), keep_ops=True)
    with counter:
        counter.phase = "fwd"
        out = fn()
        counter.phase = "bwd"
        out.sum().backward()
        counter.phase = None
    return counter.ops


def test_counter_records_matmul_gemms() -> None:
    with torch.device("meta"):
        lin = nn.Linear(64, 32)
        x = torch.randn(8, 64, requires_grad=True)
        a, b = torch.randn(3, 5, 7, requires_grad=True), torch.randn(3, 7, 11, requires_grad=True)
    ops = _counted_ops(lambda: lin(x))
    gemms = [(o.phase, o.gemms[0]) for o in ops if o.gemms]
    assert gemms[0] == ("fwd", Gemm("matmul", 1, 8, 32, 64))  # addmm
    assert {g for _, g in gemms[1:]} == {
        Gemm("matmul", 1, 8, 64, 32),  # input gradient
        Gemm("matmul", 1, 32, 64, 8),  # weight gradient: K is the batch
    }
    ops = _counted_ops(lambda: torch.bmm(a, b))
    assert [o.gemms for o in ops if o.phase == "fwd"] == [(Gemm("matmul", 3, 5, 11, 7),)]
    for o in ops:
        assert sum(g.flops for g in o.gemms) == o.flops


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: nn.Conv2d(16, 32, 3, stride=2, padding=1), (4, 16, 20, 20)),
        (lambda: nn.Conv2d(16, 32, 1), (4, 16, 9, 9)),
        (lambda: nn.Conv1d(8, 12, 5, padding=2), (3, 8, 30)),
        (lambda: nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), (2, 16, 7, 7)),
    ],
)
def test_convolution_gemms_carry_the_convolutions_flops(
    make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    with torch.device("meta"):
        conv = make()
        x = torch.randn(*shape, requires_grad=True)
    ops = _counted_ops(lambda: conv(x))
    convs = [o for o in ops if o.gemms]
    assert [len(o.gemms) for o in convs] == [1, 2]  # forward; input and weight gradients
    for o in convs:
        assert all(g.kind == "conv" for g in o.gemms)
        assert sum(g.flops for g in o.gemms) == o.flops
    with FlopCounterMode(display=False) as flops:
        conv(x).sum().backward()
    assert sum(sum(g.flops for g in o.gemms) for o in convs) == flops.get_total_flops()


def test_grouped_convolution_gemms_per_group() -> None:
    # A depthwise 3x3 over 32 channels at 4 x 10 x 10 positions: 32 tiny products per pass.
    fwd, dgrad, wgrad = conv_gemms((32, 1, 3, 3), 32, 400, ("fwd", "dgrad", "wgrad"))
    assert fwd == Gemm("conv", 32, 400, 1, 9)
    assert dgrad == Gemm("conv", 32, 400, 9, 1)
    assert wgrad == Gemm("conv", 32, 1, 9, 400)
    assert fwd.flops == dgrad.flops == wgrad.flops == 2 * 400 * 32 * 9


# ---------------------------------------------------------------------------------------------------------
# Cost curves
# ---------------------------------------------------------------------------------------------------------


def _captures(make: Callable[[], nn.Module], example: Callable[[int], tuple[Any, ...]], *sizes: int) -> Any:
    with torch.device("meta"):
        model = make()
        return model, [capture(model, example(n), max_blocks=1) for n in sizes]


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[Any, ...]]]] = {
    "linear": (lambda: nn.Sequential(nn.Linear(5000, 5000)), lambda n: (torch.randn(n, 5000),)),
    "mlp": (
        lambda: nn.Sequential(nn.Linear(300, 1000), nn.ReLU(), nn.Linear(1000, 300), nn.LayerNorm(300)),
        lambda n: (torch.randn(n, 300),),
    ),
    "gpt-block": (lambda: nn.Sequential(GPTBlock(256, 4)), lambda n: (torch.randn(n, 128, 256),)),
    "gpt": (
        lambda: GPT(vocab=1000, dim=128, heads=4, depth=2, seq=64),
        lambda n: (torch.randint(0, 1000, (n, 64)),),
    ),
    "bottleneck": (
        lambda: nn.Sequential(Bottleneck(64, 32, stride=2)),
        lambda n: (torch.randn(n, 64, 28, 28),),
    ),
}


def _precision(model: nn.Module) -> Precision:
    return parse_precision(None, model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_curve_from_two_small_captures_matches_a_capture_at_512(case: str) -> None:
    model, (small, smaller, large) = _captures(*CASES[case], 2, 4, 512)
    precision = _precision(model)
    roofline = Roofline.of(H100, precision.compute_name, waves=True)
    assert small.num_blocks == smaller.num_blocks == large.num_blocks
    for k in range(large.num_blocks):
        curve = estimate_curve(small.blocks[k], smaller.blocks[k], precision, H100, [1, 2, 4, 64, 512])
        assert [p[0] for p in curve] == [1, 2, 4, 64, 512]
        exact = estimate_block(large.blocks[k], precision, roofline)
        n, fwd_us, bwd_us, activation, transient, cut = curve[-1]
        assert fwd_us == pytest.approx(exact.fwd_us, rel=1e-6)
        assert bwd_us == pytest.approx(exact.bwd_us, rel=1e-6)
        assert activation == exact.activation_bytes
        assert cut == 0  # not passed
        assert transient == pytest.approx(
            exact.transient_bytes, rel=0.05, abs=1024
        )  # a line through two peaks
        for n, point in zip((2, 4), curve[1:3], strict=True):  # the captures' own sizes come back too
            own = estimate_block((small if n == 2 else smaller).blocks[k], precision, roofline)
            assert point[1:4] == (pytest.approx(own.fwd_us), pytest.approx(own.bwd_us), own.activation_bytes)


def test_curve_is_exact_between_powers_of_two() -> None:
    model, (a, b, c) = _captures(*CASES["linear"], 2, 4, 300)
    precision = _precision(model)
    curve = estimate_curve(a.blocks[0], b.blocks[0], precision, H100, [300])
    exact = estimate_block(c.blocks[0], precision, Roofline.of(H100, "float32", waves=True))
    assert curve[0][1:3] == (pytest.approx(exact.fwd_us), pytest.approx(exact.bwd_us))


def test_linear_5000_turns_compute_bound_with_waves() -> None:
    model, (a, b) = _captures(*CASES["linear"], 2, 4)
    roofline = Roofline.of(H100, "float32", waves=True, tf32=False)
    curve = estimate_curve(a.blocks[0], b.blocks[0], _precision(model), roofline, [1, 2, 512])
    weight_read_us = 5000 * 5000 * 4 / roofline.bytes_per_us
    assert curve[0][1] == pytest.approx(curve[1][1], rel=0.01)  # 1 and 2 samples: reading the weight
    assert weight_read_us < curve[0][1] < 1.2 * weight_read_us
    fwd_512 = (
        5 * (2 * 128 * 32 * 5000) / (67e12 * 0.6 / 132 / 1e6) + roofline.launch_us
    )  # 5 waves of 128 x 32
    assert curve[2][1] == pytest.approx(fwd_512)
    assert curve[2][1] > 100 * curve[1][1] / 256  # far from linear in the batch


def test_curve_takes_a_roofline_and_fits_cut_and_transient_bytes() -> None:
    model, (a, b) = _captures(*CASES["mlp"], 2, 4)
    precision = _precision(model)
    roofline = Roofline.of(H100, "float32", waves=False)
    curve = estimate_curve(
        a.blocks[0],
        b.blocks[0],
        precision,
        roofline,
        [8, 1, 8],
        cut_bytes=(2400, 4800),
        transient_bytes=(10, 14),
    )
    assert [p[0] for p in curve] == [1, 8]
    assert [(p[4], p[5]) for p in curve] == [(8, 1200), (22, 9600)]


class Branchy(nn.Module):
    """Takes another path at larger batches: the two captures run different kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if x.shape[0] > 3:
            y = torch.relu(y) * 2
        return y


def test_curve_of_different_graphs_is_the_line_through_the_totals() -> None:
    model, (a, b) = _captures(lambda: nn.Sequential(Branchy()), lambda n: (torch.randn(n, 64),), 2, 4)
    precision = _precision(model)
    roofline = Roofline.of(H100, "float32", waves=True)
    at_a = estimate_block(a.blocks[0], precision, roofline)
    at_b = estimate_block(b.blocks[0], precision, roofline)
    assert at_a.fwd_kernels != at_b.fwd_kernels
    curve = estimate_curve(a.blocks[0], b.blocks[0], precision, H100, [2, 4, 8])
    assert curve[0][1:3] == (pytest.approx(at_a.fwd_us), pytest.approx(at_a.bwd_us))
    assert curve[1][1:3] == (pytest.approx(at_b.fwd_us), pytest.approx(at_b.bwd_us))
    assert curve[2][1] == pytest.approx(at_b.fwd_us + 2 * (at_b.fwd_us - at_a.fwd_us))


def test_batch_sizes_read_from_inputs() -> None:
    _, (a, b) = _captures(*CASES["gpt"], 2, 4)
    blocks: list[tuple[Block, Block]] = list(zip(a.blocks, b.blocks, strict=True))
    sizes = {x.name: batch_sizes(x, y) for x, y in blocks}
    assert sizes["layers.0"] == (2, 4) and sizes["head"] == (2, 4)
    assert sizes["pos"] == (1, 2)  # no batch-dependent input: a constant curve


def test_curve_errors() -> None:
    model, (a, b) = _captures(*CASES["mlp"], 2, 4)
    precision = _precision(model)
    with pytest.raises(ConfigError, match="0 < a < b"):
        estimate_curve(b.blocks[0], a.blocks[0], precision, H100, [1])
    with pytest.raises(ConfigError, match="at least 1 sample"):
        estimate_curve(a.blocks[0], b.blocks[0], precision, H100, [0, 1])


def test_estimate_block_default_roofline_is_unchanged() -> None:
    # profile()'s estimate mode builds Roofline.of(spec, dtype): no waves, so its numbers stay the plain roofline.
    cap: CapturedModel
    _, (cap,) = _captures(*CASES["linear"], 64)
    a100 = device_spec("a100")
    cost = estimate_block(
        cap.blocks[0], Precision("float32", None, None), Roofline.of(a100, "float32", tf32=False)
    )
    flops, nbytes = 2 * 64 * 5000 * 5000, (64 * 5000 * 2 + 5000 * 5000 + 5000) * 4
    assert cost.fwd_us == pytest.approx(max(flops / (19.5e12 * 0.6), nbytes / (1555e9 * 0.7)) * 1e6 + 4.0)
