"""Unit tests of the profilers: block records in both modes, memory accounting, measure mode's timing, and
profiles of captured models. Estimate mode's pricing is in test_profile_estimate.py, partial profiles in
test_profile_parts.py."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lightning_autopart.capture.graph import Block, CapturedModel, TensorInfo
from lightning_autopart.errors import ConfigError, ProfileError
from lightning_autopart.profile import calibrate_cpu, measure, profile
from lightning_autopart.profile.records import ModelProfile, TiedParam

F32 = 4


# ---------------------------------------------------------------------------------------------------------
# Hand-built captured models: one block per child module, one tensor crossing each cut.
# ---------------------------------------------------------------------------------------------------------


class Wrap(nn.Module):
    """A block program: runs one module and returns its output as a one-tuple."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.inner(*args),)


def _info(
    name: str, t: torch.Tensor, producer: int, consumers: tuple[int, ...], grad: bool = False
) -> TensorInfo:
    return TensorInfo(
        name,
        tuple(t.shape),
        str(t.dtype).removeprefix("torch."),
        t.numel() * t.element_size(),
        producer,
        consumers,
        grad and t.is_floating_point(),
    )


def _blocks_of(
    parts: Sequence[tuple[str, nn.Module, tuple[str, ...], tuple[str, ...]]], x: torch.Tensor
) -> tuple[list[Block], list[tuple[TensorInfo, ...]], TensorInfo]:
    first = _info("input0", x, -1, (0,))
    blocks, cuts = [], []
    value, value_info = x, first
    grad = False  # as the capture marks them: a value needs a gradient from the first trainable block on
    with torch.no_grad():
        for i, (name, module, params, buffers) in enumerate(parts):
            out = module(value)
            grad = grad or any(p.requires_grad for p in module.parameters())
            out_info = _info(f"block{i}.out0", out, i, (i + 1,), grad)
            blocks.append(
                Block(
                    i,
                    name,
                    (name,),
                    params,
                    buffers,
                    Wrap(module),
                    (value,),
                    (value_info,),
                    (out_info,),
                    op_count=1,
                )
            )
            cuts.append((out_info,))
            value, value_info = out, out_info
    return blocks, cuts, first


def chain(model: nn.Sequential, x: torch.Tensor) -> CapturedModel:
    """Capture a Sequential by hand: block i is child i, its args are the real (or meta) values of the run."""
    parts = [
        (
            name,
            child,
            tuple(f"{name}.{p}" for p, _ in child.named_parameters()),
            tuple(f"{name}.{b}" for b, _ in child.named_buffers()),
        )
        for name, child in model.named_children()
    ]
    blocks, cuts, first = _blocks_of(parts, x)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    return CapturedModel(model, "modules", blocks, cuts, (first,), x.shape[0], shapes)


class TiedLM(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(ids)))


def capture_tied(model: TiedLM, ids: torch.Tensor) -> CapturedModel:
    parts = [
        ("emb", model.emb, ("emb.weight",), ()),
        ("mid", model.mid, ("mid.weight", "mid.bias"), ()),
        ("head", model.head, ("head.weight",), ()),
    ]
    blocks, cuts, first = _blocks_of(parts, ids)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    return CapturedModel(
        model, "modules", blocks, cuts, (first,), ids.shape[0], shapes, tied={"emb.weight": (0, 2)}
    )


def profile_cpu(captured: CapturedModel, mode: str = "measure", **kwargs: Any) -> ModelProfile:
    """``profile`` on this machine's CPU even where CUDA is available (so the numbers below hold)."""
    kwargs.setdefault("device", "cpu")
    return profile(captured, mode, **kwargs)


def mlp(batch: int = 8) -> CapturedModel:
    return chain(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(batch, 64))


# ---------------------------------------------------------------------------------------------------------
# Measure mode
# ---------------------------------------------------------------------------------------------------------


def test_measure_cpu_gives_positive_times() -> None:
    prof = profile_cpu(mlp(), warmup=1, repeats=3)
    assert prof.mode == "measure" and prof.device == "cpu" and prof.meta["timer"] == "perf_counter"
    assert prof.model == "Sequential" and prof.batch_size == 8 and prof.capture == "modules"
    assert prof.num_blocks == 3
    for b in prof.blocks:
        assert b.fwd_us > 0 and b.bwd_us > 0
        assert 0 < b.fwd_fixed_us <= 0.9 * b.fwd_us + 1e-9
        assert 0 < b.bwd_fixed_us <= 0.9 * b.bwd_us + 1e-9
    assert prof.blocks[0].fwd_flops == 2 * 8 * 64 * 128
    assert prof.input_bytes == 8 * 64 * F32
    assert [b.cut_bytes for b in prof.blocks] == [8 * 128 * F32, 8 * 128 * F32, 8 * 10 * F32]
    assert prof.meta["input_shapes"] == [[8, 64]] and prof.meta["repeats"] == 3


@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_activation_bytes_match_theory(mode: str) -> None:
    batch = 8
    prof = profile_cpu(mlp(batch), mode, spec="a100", warmup=0, repeats=1)
    # Linear saves its input, ReLU its output, the last Linear its input (the ReLU output, a new storage).
    assert [b.activation_bytes for b in prof.blocks] == [
        batch * 64 * F32,
        batch * 128 * F32,
        batch * 128 * F32,
    ]
    per_block = prof.meta["per_block"]
    assert [e["saved_input_bytes"] for e in per_block] == [batch * 64 * F32, 0, batch * 128 * F32]
    assert [e["saved_output_bytes"] for e in per_block] == [0, batch * 128 * F32, 0]
    fused = chain(nn.Sequential(nn.Sequential(nn.Linear(32, 48), nn.ReLU())), torch.randn(4, 32))
    assert (
        profile_cpu(fused, mode, spec="a100", repeats=1).blocks[0].activation_bytes
        == 4 * 32 * F32 + 4 * 48 * F32
    )


class Scale(nn.Module):
    """``x * w``: autograd saves both x (for dw) and the parameter w (for dx)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_parameters_are_not_activations(mode: str) -> None:
    cap = chain(nn.Sequential(nn.Linear(16, 1000), Scale(1000)), torch.randn(2, 16))
    prof = profile_cpu(cap, mode, spec="a100", repeats=1)
    assert prof.blocks[1].activation_bytes == 2 * 1000 * F32  # x only; w (4000 bytes) is a parameter


@pytest.mark.parametrize(
    ("optimizer", "factor"), [("sgd", 0), ("sgd_momentum", 1), ("adam", 2), ("AdamW", 2)]
)
def test_optimizer_bytes(optimizer: str, factor: int) -> None:
    prof = profile_cpu(mlp(), "estimate", spec="a100", optimizer=optimizer)
    first = prof.blocks[0]
    assert first.param_count == 64 * 128 + 128
    assert first.param_bytes == first.grad_bytes == (64 * 128 + 128) * F32
    assert first.optimizer_bytes == factor * first.param_bytes
    assert prof.optimizer == optimizer


def test_frozen_parameters_have_no_grad_or_state() -> None:
    cap = mlp()
    cap.module[0].weight.requires_grad_(False)
    first = profile_cpu(cap, "estimate", spec="a100", optimizer="adam").blocks[0]
    assert first.param_bytes == (64 * 128 + 128) * F32
    assert first.grad_bytes == 128 * F32 and first.optimizer_bytes == 2 * 128 * F32


def test_unknown_optimizer() -> None:
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        profile_cpu(mlp(), "estimate", spec="a100", optimizer="lion")


def test_buffers_counted() -> None:
    cap = chain(nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6)), torch.randn(4, 8))
    bn = profile_cpu(cap, "estimate", spec="a100").blocks[1]
    assert bn.buffer_bytes == 6 * F32 * 2 + 8  # running mean and var, num_batches_tracked (int64)
    assert bn.param_bytes == 2 * 6 * F32
    assert profile_cpu(cap, "estimate", spec="a100", dtype="bf16").blocks[1].buffer_bytes == 6 * 2 * 2 + 8


@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_tied_parameter_counted_once(mode: str) -> None:
    model = TiedLM()
    prof = profile_cpu(capture_tied(model, torch.randint(0, 50, (4, 7))), mode, spec="a100", repeats=1)
    emb_bytes = 50 * 16 * F32
    assert [b.param_bytes for b in prof.blocks] == [emb_bytes, (16 * 16 + 16) * F32, 0]
    assert prof.blocks[2].param_shapes == ()
    assert prof.tied == (TiedParam("emb.weight", emb_bytes, (0, 2)),)
    assert prof.param_count == sum(p.numel() for p in model.parameters())
    assert prof.input_bytes == 4 * 7 * 8  # int64 ids


class SleepyProgram(nn.Module):
    """Sleeps for the next duration of a class-level schedule (class attributes survive deepcopy)."""

    schedule: ClassVar[list[float]] = []
    calls: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        SleepyProgram.calls += 1
        time.sleep(SleepyProgram.schedule.pop(0) if SleepyProgram.schedule else 0.0)
        return (self.lin(x),)


def _sleepy(schedule: list[float]) -> CapturedModel:
    cap = chain(nn.Sequential(nn.Linear(2, 2)), torch.randn(1, 2))
    cap.blocks[0].program = SleepyProgram()
    SleepyProgram.calls = 0
    SleepyProgram.schedule = schedule
    return cap


def test_host_rounds_go_on_until_they_span_the_budget() -> None:
    """[Note: host timing statistic]: fast rounds continue to 30; rounds past 0.3 s stop at ``repeats``."""
    profile_cpu(_sleepy([]), warmup=2, repeats=5)
    assert SleepyProgram.calls == 1 + 2 + measure._MAX_HOST_ROUNDS  # counting run, warm-up, timed rounds
    profile_cpu(_sleepy([0.0, 0.0, 0.0] + [0.07] * 40), warmup=2, repeats=5)
    assert SleepyProgram.calls == 1 + 2 + 5  # 5 x 70 ms already span 0.3 s


def test_host_times_are_the_mean_of_the_middle_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "_MAX_HOST_ROUNDS", 10)
    # One 80 ms stall among 4 ms rounds is dropped (the plain mean would be 11.6 ms).
    prof = profile_cpu(_sleepy([0.0] * 3 + [0.080] + [0.004] * 9), warmup=2, repeats=5)
    assert SleepyProgram.calls == 1 + 2 + 10
    assert 3_500 < prof.blocks[0].fwd_us < 9_000
    # A slow phase that lasts (3 of 10 rounds at 10 ms, 7 at 2 ms) counts, as it does in training: the median
    # says 2 ms, the mean of the middle 8 rounds 4 ms.
    prof = profile_cpu(_sleepy([0.0] * 3 + [0.002, 0.010] * 3 + [0.002] * 4), warmup=2, repeats=5)
    assert 3_500 < prof.blocks[0].fwd_us < 7_000


def test_live_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cap = chain(model, torch.randn(5, 8))
    args_before = [b.args[0].clone() for b in cap.blocks]
    profile_cpu(cap, warmup=1, repeats=2, dtype="bfloat16")
    profile_cpu(cap, "estimate", spec="a100")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(
        p.grad is None and p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()
    )
    assert not model.training
    assert all(
        torch.equal(b.args[0], a) and not b.args[0].requires_grad
        for b, a in zip(cap.blocks, args_before, strict=True)
    )


def test_measure_materializes_meta_capture() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.ReLU(inplace=True))
        ids = torch.zeros(4, 9, dtype=torch.long)
    cap = chain(model, ids)
    prof = profile_cpu(cap, device="cpu", warmup=0, repeats=1)
    assert all(b.fwd_us > 0 for b in prof.blocks)
    assert prof.blocks[1].activation_bytes == 4 * 9 * 32 * F32
    assert all(p.is_meta for p in model.parameters())


def test_inplace_op_on_block_input() -> None:
    cap = chain(nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)), torch.randn(3, 8))
    prof = profile_cpu(cap, warmup=1, repeats=2)
    assert prof.blocks[1].bwd_us > 0


class HoldsConstants(nn.Module):
    """A program with tensors outside its parameters and buffers (as a module-hook capture may keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._leaves = [torch.full((4,), 2.0)]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.lin(x) * self._leaves[0],)


@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_constant_tensors_travel_with_the_copy(mode: str) -> None:
    cap = chain(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(3, 4))
    program = HoldsConstants()
    cap.blocks[1].program = program
    prof = profile_cpu(cap, mode, spec="a100", repeats=1)
    # Linear saves its input; mul saves only the constant (to scale lin's gradient): not an activation
    assert prof.blocks[1].activation_bytes == 3 * 4 * F32
    assert program._leaves[0].device.type == "cpu" and torch.equal(program._leaves[0], torch.full((4,), 2.0))


def test_bfloat16_and_mixed_precision() -> None:
    cap = mlp()
    full = profile_cpu(cap, "estimate", spec="a100")
    bf16 = profile_cpu(cap, "estimate", spec="a100", dtype="bfloat16")
    mixed = profile_cpu(cap, "estimate", spec="a100", dtype="bf16-mixed")
    assert full.dtype == "float32" and bf16.dtype == "bfloat16" and mixed.dtype == "float32"
    assert mixed.meta["compute_dtype"] == "bfloat16"
    assert bf16.blocks[0].param_bytes * 2 == full.blocks[0].param_bytes == mixed.blocks[0].param_bytes
    assert bf16.blocks[1].activation_bytes * 2 == full.blocks[1].activation_bytes
    assert bf16.blocks[0].cut_bytes * 2 == full.blocks[0].cut_bytes
    measured = profile_cpu(cap, dtype="bf16-mixed", warmup=0, repeats=1)
    assert measured.dtype == "float32" and measured.blocks[0].param_bytes == full.blocks[0].param_bytes
    with pytest.raises(ConfigError, match="unknown dtype 'int3'"):
        profile_cpu(cap, "estimate", spec="a100", dtype="int3")


def test_block_failure_names_the_block() -> None:
    cap = mlp()
    cap.blocks[2].args = (torch.randn(8, 7),)  # wrong width for Linear(128, 10)
    with pytest.raises(ProfileError, match=r"block 2 \('2'\).*RuntimeError"):
        profile_cpu(cap, repeats=1)


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match="unknown profile mode"):
        profile_cpu(mlp(), "guess")
    with pytest.raises(ConfigError, match=r"blocks \[3\] out of range"):
        profile_cpu(mlp(), blocks=[0, 3])
    with pytest.raises(ConfigError, match="repeats >= 1"):
        profile_cpu(mlp(), repeats=0)
    with pytest.raises(ConfigError, match="not 'meta'"):
        profile_cpu(mlp(), device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            profile_cpu(mlp(), device="cuda")


def test_calibrate_cpu() -> None:
    calibrate_cpu.cache_clear()
    start = time.perf_counter()
    spec = calibrate_cpu()
    assert time.perf_counter() - start < 5.0  # takes 0.1-0.5 s; CI shares its two cores
    assert spec.name == "cpu"
    assert spec.fp32_flops > 1e8 and spec.memory_bw > 1e8 and 0 < spec.launch_us < 1000
    assert calibrate_cpu() is spec  # cached


# ---------------------------------------------------------------------------------------------------------
# Through the real capture front end, once it exists
# ---------------------------------------------------------------------------------------------------------

needs_capture = pytest.mark.skipif(
    importlib.util.find_spec("lightning_autopart.capture") is None,
    reason="lightning_autopart.capture not built yet",
)


@needs_capture
@pytest.mark.parametrize("method", ["export", "modules"])
def test_profile_of_captured_tied_model(method: str) -> None:
    from lightning_autopart.capture import capture

    model = TiedLM()
    captured = capture(model, (torch.randint(0, 50, (4, 7)),), method=method)
    measured = profile_cpu(captured, warmup=1, repeats=2, optimizer="adam")
    estimated = profile_cpu(captured, "estimate", spec="a100", optimizer="adam")
    for prof in (measured, estimated):
        assert prof.capture == method and prof.param_count == sum(p.numel() for p in model.parameters())
        assert [t.blocks for t in prof.tied] == [(0, captured.num_blocks - 1)]
        assert sum(b.optimizer_bytes for b in prof.blocks) == 2 * 4 * prof.param_count
    assert [b.activation_bytes for b in measured.blocks] == [b.activation_bytes for b in estimated.blocks]
    assert [b.fwd_flops for b in measured.blocks] == [b.fwd_flops for b in estimated.blocks]


@needs_capture
@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_profile_of_captured_mlp(mode: str) -> None:
    from lightning_autopart.capture import capture

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    captured = capture(model, (torch.randn(4, 32),))
    prof = profile_cpu(captured, mode, spec="a100", warmup=1, repeats=2)
    assert prof.num_blocks == captured.num_blocks
    assert prof.param_count == sum(p.numel() for p in model.parameters())
    assert sum(b.fwd_flops for b in prof.blocks) == 2 * 4 * (32 * 64 + 64 * 64 + 64 * 8)
    assert all(b.fwd_us > 0 for b in prof.blocks)
    assert all(p.grad is None for p in model.parameters())
