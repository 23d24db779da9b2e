"""Autocast on meta tensors: estimate mode's "-mixed" blocks cast, save and copy weights as autocast does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.profile import profile
from lightning_autopart.profile.autocast_meta import MetaAutocast
from lightning_autopart.profile.opcount import OpCounter


class _Residual(nn.Module):
    """A pre-norm residual MLP: autocast's float32 list (layer norm), its bf16 list (linear), and promotion."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def test_ops_take_autocasts_dtypes_on_meta() -> None:
    with torch.device("meta"):
        lin, x = nn.Linear(8, 8), torch.empty(4, 8)
        labels = torch.zeros(4, dtype=torch.long)
    with MetaAutocast(torch.bfloat16):
        y = lin(x)
        z = F.layer_norm(y, (8,))
        loss = F.cross_entropy(y, labels)
        w = torch.ops.aten.mm.default(x, x.t())  # an aten-level graph (torch.export) is cast as well
    assert (y.dtype, z.dtype, loss.dtype, w.dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.bfloat16,
    )
    assert (x + y).dtype == torch.float32  # everything else: type promotion


def test_a_weight_used_twice_is_cast_at_each_use() -> None:
    """Lightning's autocast runs with its cache off, so each use of a weight makes its own copy."""
    with torch.device("meta"):
        lin, x = nn.Linear(16, 16), torch.empty(2, 16)
    counter = OpCounter(keep_ops=True)
    with counter, MetaAutocast(torch.bfloat16):
        counter.phase = "fwd"
        lin(lin(x))
    casts = [o for o in counter.ops if o.op.startswith("aten._to_copy")]
    assert len(casts) == 5  # the weight and the bias at each use, and the input once


class _Loop(nn.Module):
    """One cell applied at every step of a sequence, as a hand-written recurrent network does."""

    def __init__(self, width: int, steps: int) -> None:
        super().__init__()
        self.cell, self.steps = nn.Linear(width, width), steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            x = torch.tanh(self.cell(x))
        return x


def test_a_loop_keeps_a_weight_copy_per_step_as_lightnings_autocast_does() -> None:
    """Under Lightning's bf16-mixed (autocast's cache off) a cell applied four times leaves four copies of its
    weight for the backward; measure and estimate mode both price them (a cached cast would price one)."""
    model = nn.Sequential(nn.Linear(64, 64), _Loop(64, 4))
    cap = capture(model, (torch.randn(8, 64),), max_blocks=2)
    real = profile(cap, device="cpu", dtype="bf16-mixed", repeats=1)
    meta = profile(cap, "estimate", spec="cpu", dtype="bf16-mixed")
    assert real.blocks[1].cast_bytes == meta.blocks[1].cast_bytes == 4 * 64 * 64 * 2
    assert real.blocks[1].activation_bytes == meta.blocks[1].activation_bytes


def test_estimate_meters_what_cpu_autocast_does() -> None:
    """The same blocks profiled for real under CPU autocast and estimated on meta: equal saved and cast bytes
    (the op lists this model uses are the same on CPU and CUDA)."""
    model = nn.Sequential(_Residual(64), _Residual(64))
    cap = capture(model, (torch.randn(16, 64),), max_blocks=2)
    real = profile(cap, device="cpu", dtype="bf16-mixed", repeats=1)
    meta = profile(cap, "estimate", dtype="bf16-mixed")
    assert [b.activation_bytes for b in meta.blocks] == [b.activation_bytes for b in real.blocks]
    assert [b.cast_bytes for b in meta.blocks] == [b.cast_bytes for b in real.blocks]
    # the two weights' copies, which the backward keeps (for the inputs' gradients); not the biases' (dead at once)
    assert all(b.cast_bytes == 64 * 256 * 2 * 2 for b in meta.blocks)


class _Gelu(nn.Module):
    """A tanh GELU written out as Hugging Face's ``gelu_new`` is (``pow`` on CUDA's float32 list, not the
    CPU's), then a softmax on its bfloat16 output (also float32 on CUDA only)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        g = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return torch.softmax(g, dim=-1)


def test_estimate_follows_the_op_lists_of_the_device_it_prices() -> None:
    """A CPU's autocast keeps ``pow`` and softmax in bfloat16, a GPU's in float32: estimated with the "cpu"
    spec, a block saves and hands on what a real CPU run does; with a GPU's, what the GPU does (more)."""
    model = nn.Sequential(nn.Linear(64, 64), _Gelu(64), nn.Linear(256, 64))
    cap = capture(model, (torch.randn(16, 64),), max_blocks=3)
    real = profile(cap, device="cpu", dtype="bf16-mixed", repeats=1)
    cpu = profile(cap, "estimate", spec="cpu", dtype="bf16-mixed")
    gpu = profile(cap, "estimate", spec="h100", dtype="bf16-mixed")
    assert [b.activation_bytes for b in cpu.blocks] == [b.activation_bytes for b in real.blocks]
    assert [b.cut_bytes for b in cpu.blocks] == [b.cut_bytes for b in real.blocks]
    assert [b.cast_bytes for b in cpu.blocks] == [b.cast_bytes for b in real.blocks]
    assert gpu.blocks[1].activation_bytes > cpu.blocks[1].activation_bytes
    assert gpu.blocks[1].cut_bytes == 2 * cpu.blocks[1].cut_bytes  # the softmax's output: float32 on a GPU


class _Einsum(nn.Module):
    """Funnel-style relative attention: an einsum of a float32 sum (activations plus a float32 bias) and a
    bfloat16 product; autocast casts both to bfloat16 through the products einsum decomposes into."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bid,bjd->bij", x + self.bias, self.k(x))
        return torch.tensordot(scores, self.q(x), dims=([2], [1])).sum(dim=2)


@pytest.mark.parametrize("spec", ["cpu", "h100"])
def test_an_einsum_of_mixed_dtypes_is_cast_as_autocast_casts_it(spec: str) -> None:
    """Estimate mode ran ``einsum`` as called: with one float32 operand and one bfloat16, meta's ``bmm`` refused
    the mix (Funnel in bf16-mixed). It is a product autocast casts; the estimate saves what a CPU run saves."""
    model = nn.Sequential(nn.Linear(32, 32), _Einsum(32), nn.Linear(32, 32))
    cap = capture(model, (torch.randn(4, 8, 32),), max_blocks=3)
    estimated = profile(cap, "estimate", spec=spec, dtype="bf16-mixed")
    if spec == "cpu":
        real = profile(cap, device="cpu", dtype="bf16-mixed", repeats=1)
        assert [b.activation_bytes for b in estimated.blocks] == [b.activation_bytes for b in real.blocks]
        assert [b.cut_bytes for b in estimated.blocks] == [b.cut_bytes for b in real.blocks]

