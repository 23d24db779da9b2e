"""Autocast on meta tensors: estimate mode's "-mixed" blocks cast, save and copy weights as autocast does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.profile import profile
from lightning_autopart.profile.autocast_meta import MetaAutocast
from lightning_autopart.profile.opcount import OpCounter
from lightning_autopart.profile.saved import SavedTensorMeter


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



def _saved_bytes(fn: Any) -> tuple[int, list[torch.dtype]]:
    """Bytes ``fn`` saves for backward (by storage), and the dtypes of the tensors it saves."""
    meter = SavedTensorMeter()
    dtypes: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> Any:
        dtypes.append(t.dtype)
        return meter.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, meter.unpack):
        fn()
    return meter.nbytes, dtypes


def test_cross_entropy_saves_a_bfloat16_log_softmax_and_a_float32_copy_as_cuda_does() -> None:
    """``F.cross_entropy`` is on none of CUDA's lists: its ``log_softmax`` keeps the logits' dtype and
    ``nll_loss`` (float32 list) saves a float32 copy of it. Logits already in float32 save one float32 tensor."""
    with torch.device("meta"):
        low = torch.empty(16, 100, dtype=torch.bfloat16, requires_grad=True)
        full = torch.empty(16, 100, requires_grad=True)
        labels = torch.zeros(16, dtype=torch.long)
    with MetaAutocast(torch.bfloat16):
        mixed, mixed_dtypes = _saved_bytes(lambda: F.cross_entropy(low, labels))
        plain, _ = _saved_bytes(lambda: F.cross_entropy(full, labels))
        smoothed, _ = _saved_bytes(lambda: F.cross_entropy(low, labels, label_smoothing=0.1))
        assert F.cross_entropy(low, labels).dtype == torch.float32
    assert mixed == 16 * 100 * (2 + 4) + 16 * 8 + 4  # and the labels, and nll_loss's total weight
    assert {torch.bfloat16, torch.float32} <= set(mixed_dtypes)
    assert plain == 16 * 100 * 4 + 16 * 8 + 4
    assert smoothed >= 16 * 100 * 4  # priced as a float32 cast of the logits


class _Head(nn.Module):
    """A linear head: under autocast its output, the loss's input, is bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_the_loss_runs_under_autocast_on_the_output_autocast_gives() -> None:
    """The step runs its loss inside the precision's autocast, on the bfloat16 output of a linear head
    ([Note: the loss] in loss.py): the profile records the output's dtypes, and a loss on the CPU's float32 list
    (``cross_entropy``) runs on the float32 copy autocast makes, in measure mode and on meta alike."""
    from lightning_autopart.planner import profile_model
    from lightning_autopart.profile.loss import profile_loss

    def loss(out: torch.Tensor, n: int) -> torch.Tensor:
        return F.cross_entropy(out, torch.zeros(n, dtype=torch.long, device=out.device))

    x = torch.randn(16, 32)
    mixed = profile_model(_Head(), x, profile="estimate", spec="cpu", up_to=16, loss=loss, dtype="bf16-mixed")
    full = profile_model(_Head(), x, profile="estimate", spec="cpu", up_to=16, loss=loss)
    assert mixed.meta["output_dtypes"] == ["bfloat16"] and mixed.meta["autocast"] == "cpu"
    assert "autocast" not in full.meta
    real = profile_loss(
        loss, torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True), 16, warmup=0, repeats=1,
        context=lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
    )  # fmt: skip
    with torch.device("meta"):
        out = torch.empty(16, 64, dtype=torch.bfloat16, requires_grad=True)
    meta = profile_loss(loss, out, 16, warmup=0, repeats=1, context=lambda: MetaAutocast(torch.bfloat16, "cpu"))
    bare = profile_loss(loss, out, 16, warmup=0, repeats=1)
    assert (real.saved_bytes, real.transient_bytes) == (meta.saved_bytes, meta.transient_bytes)
    assert real.saved_bytes >= 16 * 64 * 4 > bare.saved_bytes  # a float32 log-softmax, not a bfloat16 one
