"""Unit tests of estimate mode: FLOPs and the roofline per block, device specs, attention, meta-only runs."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn

from lightning_autopart.devices import device_spec
from lightning_autopart.errors import ConfigError
from lightning_autopart.profile import calibrate_cpu
from lightning_autopart.profile.gemms import Gemm
from lightning_autopart.profile.opcount import Roofline
from tests.unit.test_profile import F32, chain, mlp, profile_cpu


def test_estimate_flops_of_linear() -> None:
    batch, dims = 16, [32, 64, 48]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.Linear(dims[1], dims[2]))
        x = torch.randn(batch, dims[0])
    prof = profile_cpu(chain(model, x), "estimate", spec="h100")
    fwd = [2 * batch * i * o for i, o in itertools.pairwise(dims)]
    assert [b.fwd_flops for b in prof.blocks] == fwd
    bwd = [e["bwd_flops"] for e in prof.meta["per_block"]]
    assert bwd == [fwd[0], 2 * fwd[1]]  # block 0 has no input gradient (its input is the model's)
    assert prof.device == "h100-80gb" and prof.mode == "estimate"
    for b in prof.blocks:
        assert b.fwd_us > b.fwd_fixed_us > 0 and b.bwd_us > b.bwd_fixed_us > 0


def test_estimate_roofline_numbers() -> None:
    batch, n = 64, 4096
    with torch.device("meta"):
        cap = chain(nn.Sequential(nn.Linear(n, n, bias=False)), torch.randn(batch, n))
    block = profile_cpu(cap, "estimate", spec="a100").blocks[0]
    flops = 2 * batch * n * n
    nbytes = (batch * n + n * n + batch * n) * F32  # mm reads x and w, writes y
    plain = max(flops / (19.5e12 * 0.6), nbytes / (1555e9 * 0.7)) * 1e6 + 4.0
    # Matrix products are priced by tiles and waves (see [Note: GEMM waves]): 32 output tiles on 108 SMs.
    waves = Roofline.of(device_spec("a100"), "float32", waves=True, tf32=False)
    assert block.fwd_us == pytest.approx(waves.op_us(flops, nbytes, (Gemm("matmul", 1, batch, n, n),)))
    assert block.fwd_us >= plain
    assert block.fwd_fixed_us == 4.0


def test_faster_spec_is_faster() -> None:
    cap = mlp(256)
    times = {
        s: sum(b.fwd_us + b.bwd_us for b in profile_cpu(cap, "estimate", spec=s).blocks)
        for s in ("v100", "a100", "h100")
    }
    assert times["h100"] < times["a100"] < times["v100"]
    bf16 = sum(b.fwd_us for b in profile_cpu(cap, "estimate", spec="h100", dtype="bf16").blocks)
    assert bf16 < sum(b.fwd_us for b in profile_cpu(cap, "estimate", spec="h100").blocks)


def test_estimate_on_cpu_spec_uses_calibration() -> None:
    prof = profile_cpu(mlp(), "estimate", spec="cpu")
    assert prof.device == "cpu" and prof.meta["launch_us"] == calibrate_cpu().launch_us


def test_unknown_spec() -> None:
    with pytest.raises(ConfigError, match=r"unknown device spec 'tpu-v9'; known specs: a100-40gb"):
        profile_cpu(mlp(), "estimate", spec="tpu-v9")


class SelfAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return (
            nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, t, d)
        )


def test_estimate_models_attention_as_a_fused_kernel() -> None:
    batch, seq, dim, heads = 2, 256, 32, 4
    cap = chain(nn.Sequential(nn.Linear(dim, dim), SelfAttention(dim, heads)), torch.randn(batch, seq, dim))
    est = profile_cpu(cap, "estimate", spec="a100")
    measured = profile_cpu(cap, warmup=0, repeats=1)
    scores = batch * heads * seq * seq * F32
    assert est.blocks[1].activation_bytes < scores  # math attention would save the T x T scores
    assert est.blocks[1].activation_bytes == measured.blocks[1].activation_bytes
    qkv_flops = 2 * batch * seq * dim * 3 * dim
    attention_flops = 4 * batch * heads * seq * seq * (dim // heads)  # q @ k^T and p @ v
    assert est.blocks[1].fwd_flops == measured.blocks[1].fwd_flops == qkv_flops + attention_flops
    assert est.meta["per_block"][1]["bwd_flops"] == measured.meta["per_block"][1]["bwd_flops"]


def test_estimate_does_not_touch_real_memory() -> None:
    cap = mlp()
    before = [p.data_ptr() for p in cap.module.parameters()]
    profile_cpu(cap, "estimate", spec="a100")
    assert [p.data_ptr() for p in cap.module.parameters()] == before


def test_estimate_is_fast_for_billions_of_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(5000, 5000) for _ in range(100)])
        x = torch.randn(32, 5000)
    cap = chain(model, x)
    start = time.perf_counter()
    prof = profile_cpu(cap, "estimate", spec="a100", optimizer="adam")
    assert time.perf_counter() - start < 10.0
    assert prof.param_count == 100 * 5000 * 5001
    assert prof.blocks[7].optimizer_bytes == 2 * 5000 * 5001 * F32


class PaddedEncoder(nn.Module):
    """Two bidirectional attention layers that share one boolean padding mask, as encoders pass it down."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.layers = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        mask = padding[:, None, None, :].bool().expand(b, 1, t, t)
        for layer in self.layers:
            q, k, v = layer(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + attended.transpose(1, 2).reshape(b, t, d)
        return x


@pytest.mark.parametrize("dtype", [None, "bf16-mixed"])
def test_estimate_saves_a_boolean_mask_as_each_kernel_does(dtype: str | None) -> None:
    """sdpa turns a boolean mask into an additive one in the query's dtype at every call, and a masked kernel
    saves that copy for backward: estimate mode must price the copy, not the boolean mask it was given."""
    from lightning_autopart.capture import capture

    batch, seq, dim = 2, 64, 32
    padding = torch.ones(batch, seq, dtype=torch.long)
    padding[0, seq // 2 :] = 0
    cap = capture(PaddedEncoder(dim), (torch.randn(batch, seq, dim), padding))
    est = profile_cpu(cap, "estimate", spec="a100", dtype=dtype)
    measured = profile_cpu(cap, warmup=0, repeats=1, dtype=dtype)
    saved = [b.activation_bytes for b in est.blocks]
    assert saved == [b.activation_bytes for b in measured.blocks]
    per_element = 2 if dtype else F32
    masks = 2 * batch * seq * seq * per_element  # one copy per layer, in the query's dtype
    assert sum(saved) > masks


class GroupedAttention(nn.Module):
    """Causal attention with 8 query heads sharing 2 key/value heads, passed to sdpa as ``enable_gqa=True``."""

    def __init__(self, dim: int = 64, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim * kv_heads // heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, d)


def test_estimate_runs_grouped_heads_as_a_gpu_does() -> None:
    """A GPU runs grouped key/value heads fused only in flash attention (half precision, no mask): estimate mode
    prices bf16 as the fused kernel, with the key/value heads unrepeated, and float32 as the math path."""
    batch, seq, heads = 2, 128, 8
    cap = chain(nn.Sequential(nn.Linear(64, 64), GroupedAttention(64, heads)), torch.randn(batch, seq, 64))
    bf16 = profile_cpu(cap, "estimate", spec="h100", dtype="bf16-mixed")
    measured = profile_cpu(cap, warmup=0, repeats=1, dtype="bf16-mixed")  # the CPU's flash takes groups too
    assert bf16.blocks[1].activation_bytes == measured.blocks[1].activation_bytes
    assert bf16.meta["per_block"][1]["bwd_flops"] == measured.meta["per_block"][1]["bwd_flops"]
    scores = batch * heads * seq * seq * F32
    assert bf16.blocks[1].activation_bytes < scores / 4
    assert profile_cpu(cap, "estimate", spec="h100").blocks[1].activation_bytes > scores


class DropoutAttention(SelfAttention):
    """Causal attention with dropout inside the kernel, as Hugging Face models pass it while training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, d)


def test_estimate_on_the_cpu_spec_runs_attention_as_the_cpu_does() -> None:
    """The CPU's flash kernel takes grouped heads in float32 but no dropout (the math path then saves the
    scores); a GPU's kernels take dropout. Each spec prices its own device's choice."""
    batch, seq = 2, 64
    scores = batch * 4 * seq * seq * F32
    dropout = chain(nn.Sequential(nn.Linear(32, 32), DropoutAttention(32, 4)), torch.randn(batch, seq, 32))
    grouped = chain(nn.Sequential(nn.Linear(64, 64), GroupedAttention(64, 8)), torch.randn(batch, seq, 64))
    for cap, on_cpu in ((dropout, "math"), (grouped, "flash")):
        cpu = profile_cpu(cap, "estimate", spec="cpu").blocks[1].activation_bytes
        assert cpu == profile_cpu(cap, warmup=0, repeats=1).blocks[1].activation_bytes
        gpu = profile_cpu(cap, "estimate", spec="h100").blocks[1].activation_bytes
        assert (cpu > scores) == (on_cpu == "math") and (gpu > scores) == (on_cpu == "flash")


class _OneKeyHead(torch.nn.Module):
    """Multi-query attention as Falcon calls it: one key/value head broadcast to four query heads, no
    ``enable_gqa``. A CPU's flash kernel takes no such heads, so it runs the math path (it keeps the scores)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(32, 32)
        self.kv = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 1, 16).transpose(1, 2).split(8, dim=-1)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, 32)


def test_the_cpu_s_kernels_for_broadcast_key_heads_are_the_math_path() -> None:
    from lightning_autopart.planner import profile_model

    model = torch.nn.Sequential(_OneKeyHead(), torch.nn.Linear(32, 32))
    x = torch.randn(2, 16, 32)
    measured = profile_model(model, x, profile="measure", spec="cpu")
    estimated = profile_model(model, x, profile="estimate", spec="cpu")
    assert [b.activation_bytes for b in estimated.blocks] == [b.activation_bytes for b in measured.blocks]
