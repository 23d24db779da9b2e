"""CUDA tests of the measuring profiler: event timing, no memory left behind, bfloat16, and agreement with the
roofline estimate. ``check_*`` functions take the device, so they can be tried on the CPU."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.devices import device_spec_names
from lightning_autopart.profile import profile
from lightning_autopart.profile.cuda_spec import CudaProperties, local_cuda_spec
from lightning_autopart.profile.records import ModelProfile
from tests.census import live_tensor_bytes
from tests.models import GPT
from tests.unit.test_profile import F32, chain, mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_event_timing() -> None:
    cap = mlp(64)
    profile(cap, warmup=1, repeats=1)  # CUDA's own once-per-thread state: cuBLAS workspaces of both threads
    allocated = torch.cuda.memory_allocated()
    prof = profile(cap, warmup=2, repeats=5)
    assert prof.device.startswith("cuda:") and prof.meta["timer"] == "cuda_event"
    for b in prof.blocks:
        assert b.fwd_us > 0 and b.bwd_us > 0 and b.fwd_fixed_us <= 0.9 * b.fwd_us
    assert prof.blocks[0].activation_bytes == 64 * 64 * F32
    assert prof.meta["launch_spec"] != "cpu"
    assert all(p.device.type == "cpu" and p.grad is None for p in cap.module.parameters())
    assert torch.cuda.memory_allocated() <= allocated + (1 << 20)  # the copies are gone


def test_this_device_gets_a_spec_named_or_derived_from_its_clocks() -> None:
    """[Note: derived device specs]: the driver reports the numbers the derivation needs, and the H100 SXM /
    H200 we are lent are their named specs."""
    props = torch.cuda.get_device_properties(0)
    numbers = CudaProperties.of(props)
    assert numbers.clock_khz > 0 and numbers.memory_clock_khz > 0 and numbers.memory_bus_width > 0
    spec = local_cuda_spec(props)
    assert spec.sm_count == props.multi_processor_count and spec.name in device_spec_names()
    if props.name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        assert spec.name in ("h100-80gb", "h200-141gb")
    print(f"{props.name}: {spec}")


class Chatty(nn.Module):
    """Many tiny elementwise kernels on a small tensor: the host takes longer to launch them than the device to
    run them, on any GPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(100):
            x = x * 1.0001 + 0.0001
        return x


class Syncing(nn.Module):
    """A host sync inside a block (``.item()``), with work after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.abs().max().item())
        return x / (scale + 1.0)


def test_host_and_device_time_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host and device]: behind a spin the events time the device alone, and the host's time is kept
    apart; without it (the timing of before) a host-bound block's events time the host's pace."""
    from lightning_autopart.profile import cuda_clock

    model = nn.Sequential(nn.Linear(64, 64), Chatty(), Syncing(), nn.Linear(64, 64))
    cap = chain(model, torch.randn(8, 64))
    blocks = profile(cap, device="cuda", warmup=2, repeats=7).blocks
    spun = blocks[1]
    assert blocks[2].host_fwd_us == blocks[2].fwd_us  # it waited for the device: serial, in every round
    monkeypatch.setattr(cuda_clock, "SPIN", False)
    serial = profile(cap, device="cuda", warmup=2, repeats=7).blocks[1]
    print(f"\nchatty block, us: spun fwd {spun.fwd_us:.0f} bwd {spun.bwd_us:.0f} host {spun.host_fwd_us:.0f} "
          f"{spun.host_bwd_us:.0f}; serial fwd {serial.fwd_us:.0f} bwd {serial.bwd_us:.0f}")  # fmt: skip
    assert spun.host_fwd_us > spun.fwd_us and spun.host_bwd_us > spun.bwd_us  # host-bound, and seen as such
    assert spun.fwd_us < 0.8 * serial.fwd_us  # the device's own time, without the host's pace
    assert (serial.host_fwd_us, serial.host_bwd_us) == (serial.fwd_us, serial.bwd_us)  # serial: host = device


def test_bfloat16_on_cuda() -> None:
    cap = chain(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)), torch.randn(32, 256))
    full = profile(cap, device="cuda", repeats=3)
    bf16 = profile(cap, device="cuda", dtype="bfloat16", repeats=3)
    mixed = profile(cap, device="cuda", dtype="bf16-mixed", repeats=3)
    assert bf16.dtype == "bfloat16" and bf16.blocks[0].param_bytes * 2 == full.blocks[0].param_bytes
    assert [b.activation_bytes * 2 for b in bf16.blocks] == [b.activation_bytes for b in full.blocks]
    assert mixed.dtype == "float32" and mixed.blocks[0].param_bytes == full.blocks[0].param_bytes
    # autocast saves the bfloat16 copy of the input it made for the matmul (for the weight's gradient); its copy
    # of a weight is counted apart as cast bytes where the backward keeps it (for the input's gradient: not in
    # the first layer, whose input needs none), not a bias's (dead at once)
    assert mixed.blocks[0].activation_bytes == 32 * 256 * 2
    assert mixed.blocks[2].activation_bytes == 32 * 512 * 2
    assert [mixed.blocks[i].cast_bytes for i in (0, 2)] == [0, 512 * 256 * 2]
    assert all(b.fwd_us > 0 and b.bwd_us > 0 for b in (*bf16.blocks, *mixed.blocks))
    est = profile(cap, "estimate", dtype="bfloat16")
    assert est.device != "cpu" and est.meta["peak_flops"] > 1e14


def test_estimate_is_in_the_right_range_of_a_measurement() -> None:
    """A large matmul chain is compute bound: the roofline of the matching spec lands within 4x."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)])
        x = torch.randn(2048, 4096)
    real = chain(nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]), torch.randn(2048, 4096))
    measured = profile(real, dtype="bfloat16", repeats=5)
    estimated = profile(chain(model, x), "estimate", dtype="bfloat16")  # spec matched to the device name
    ratio = sum(b.fwd_us for b in estimated.blocks) / sum(b.fwd_us for b in measured.blocks)
    assert 0.25 < ratio < 4.0


def check_measure_frees_its_copies(captured: CapturedModel, device: str) -> ModelProfile:
    """``profile(captured, "measure", device=...)`` twice; around the second, the device's allocated memory
    must come back to what it was, by reference counting alone: the collector is off meanwhile (no gc.collect,
    no automatic collection), so copies kept alive by a reference cycle count as leaked.

    The first call warms up what the device keeps for good (cuBLAS/cuDNN workspaces, autocast caches)."""
    profile(captured, "measure", device=device, warmup=1, repeats=1)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    before = _allocated(device)
    gc.disable()
    try:
        prof = profile(captured, "measure", device=device, warmup=2, repeats=3)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        after = _allocated(device)
    finally:
        gc.enable()
    assert after - before <= (1 << 20), (
        f"profile() left {(after - before) / 2**20:.1f} MB allocated on {device}"
    )
    return prof


def _allocated(device: str) -> int:
    """Bytes allocated on ``device``: the CUDA allocator's count; elsewhere a census of every live tensor."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device)
    return live_tensor_bytes()


def captured_gpt() -> CapturedModel:
    """tests/models.py GPT, wide enough that a leaked copy of its blocks is several MB, captured by torch.export."""
    torch.manual_seed(0)
    model = GPT(vocab=512, dim=256, heads=4, depth=2, seq=32)
    return capture(model, torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(0)))


def test_cuda_events_time_a_captured_model_and_nothing_leaks() -> None:
    """A torch.export capture (causal mask and position ids built in forward on the input's device), measured on
    CUDA: timed with CUDA events, positive times, the live model untouched, no memory left behind."""
    captured = captured_gpt()
    prof = check_measure_frees_its_copies(captured, "cuda")
    assert prof.device.startswith("cuda:") and prof.meta["timer"] == "cuda_event"
    assert len(prof.blocks) == captured.num_blocks > 1
    for b in prof.blocks:
        assert b.fwd_us > 0 and b.bwd_us > 0, b
    assert all(p.device.type == "cpu" and p.grad is None for p in captured.module.parameters())


def test_chained_runs_keep_host_and_device_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: chained runs]: without a synchronize between blocks the events still time the device alone, a
    syncing block still counts as serial, and the backward's hand-off is measured and taken off."""
    from lightning_autopart.profile import cuda_clock
    from lightning_autopart.profile.measure import backward_handoff_us

    model = nn.Sequential(nn.Linear(64, 64), Chatty(), Syncing(), nn.Linear(64, 64))
    cap = chain(model, torch.randn(8, 64))
    spun = profile(cap, device="cuda", warmup=2, repeats=7).blocks
    monkeypatch.setattr(cuda_clock, "CHAIN", True)
    chained = profile(cap, device="cuda", warmup=2, repeats=7).blocks
    handoff = backward_handoff_us(torch.device("cuda"))
    print(f"\nchatty block, us: spun fwd {spun[1].fwd_us:.0f} host {spun[1].host_fwd_us:.0f} "
          f"{spun[1].host_bwd_us:.0f}; chained fwd {chained[1].fwd_us:.0f} host {chained[1].host_fwd_us:.0f} "
          f"{chained[1].host_bwd_us:.0f}; hand-off {handoff:.0f}")  # fmt: skip
    assert chained[2].host_fwd_us == chained[2].fwd_us  # it waited for the device: serial
    assert chained[1].host_fwd_us > chained[1].fwd_us  # host-bound, and seen as such
    assert chained[1].fwd_us < 1.5 * spun[1].fwd_us  # the device's own time, not the host's pace
    assert 0.0 <= handoff < 5e3
