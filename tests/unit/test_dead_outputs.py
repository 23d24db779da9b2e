"""Model outputs the training loss does not read (a Hugging Face model's logits beside its loss) get no gradient
in the profile and are freed before backward, as in training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopart.planner import profile_model
from tests.hf_architectures import build as build_architecture


class _Head(nn.Module):
    """A body and a head that computes its own loss: returns (logits, loss), or the loss alone."""

    def __init__(self, with_logits: bool) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(32, 64), nn.Linear(64, 1000)
        self.with_logits = with_logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(torch.relu(self.body(x)))
        loss = F.cross_entropy(logits, labels)
        return (logits, loss) if self.with_logits else loss


def _loss(output: Any, samples: int) -> torch.Tensor:
    return output[1] if isinstance(output, tuple) else output


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_logits_beside_the_loss_cost_nothing_in_backward(mode: str) -> None:
    torch.manual_seed(0)
    x, labels = torch.randn(16, 32), torch.randint(0, 1000, (16,))
    profiles = {}
    for with_logits in (True, False):
        model = _Head(with_logits)
        device = "meta" if mode == "estimate" else "cpu"
        args = (x.to(device), labels.to(device))
        spec = "h100" if mode == "estimate" else None
        profiles[with_logits] = profile_model(model.to(device), args, profile=mode, spec=spec, loss=_loss)
    both, alone = profiles[True].blocks[-1], profiles[False].blocks[-1]
    assert both.activation_bytes == alone.activation_bytes
    assert both.transient_bytes == alone.transient_bytes  # no ones-like seed for the logits, no logits held
    if mode == "estimate":
        assert both.bwd_us == pytest.approx(alone.bwd_us)


def test_outputs_the_loss_reads_keep_their_gradient() -> None:
    """The loss reads the logits (computed outside the model): they are live, their gradient is priced."""
    model = _Head(with_logits=True)
    labels = torch.randint(0, 1000, (16,))

    def outside(output: Any, samples: int) -> torch.Tensor:
        return F.cross_entropy(output[0], labels[:samples].to(output[0].device))

    x = torch.randn(16, 32, device="meta")
    read = profile_model(model.to("meta"), (x, labels.to("meta")), profile="estimate", spec="h100", loss=outside)
    unread = profile_model(model, (x, labels.to("meta")), profile="estimate", spec="h100", loss=_loss)
    assert read.blocks[-1].transient_bytes > unread.blocks[-1].transient_bytes


class _Pooled(nn.Module):
    """A trunk, a pooling head of three modules (a SigLIP-style head) and a last layer after it, returning
    (hidden states, pooled)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 16))
        self.last = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.trunk(x)
        pooled = self.head(hidden.mean(dim=0, keepdim=True))
        return self.last(hidden), pooled


def _hidden_loss(output: Any, samples: int) -> torch.Tensor:
    return output[0].square().mean()


def _both_loss(output: Any, samples: int) -> torch.Tensor:
    return output[0].square().mean() + output[1].square().mean()


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_a_head_the_loss_skips_keeps_no_optimizer_state_and_no_saves(mode: str) -> None:
    """Plain training gives a head whose output the loss skips no gradient: the optimizer keeps no state for
    it, and its saves go with its graph when the output is dropped. A head split over several blocks counts
    whole: the blocks that feed only it are dead too."""
    torch.manual_seed(0)
    device = "meta" if mode == "estimate" else "cpu"
    x = torch.randn(16, 32, device=device)
    spec = "h100" if mode == "estimate" else None
    profiles = {
        name: profile_model(_Pooled().to(device), (x,), profile=mode, spec=spec, optimizer="adam", loss=loss)
        for name, loss in (("skipped", _hidden_loss), ("read", _both_loss))
    }
    for name, prof in profiles.items():
        head = [b for b in prof.blocks if b.name.startswith("head")]
        trunk = [b for b in prof.blocks if not b.name.startswith("head")]
        assert len(head) >= 2 and len(trunk) >= 2 and prof.blocks[-1].name == "last", [b.name for b in prof.blocks]
        for b in trunk:
            assert b.optimizer_bytes == 2 * b.param_bytes and b.optimizer_us >= 0, (name, b.name)
            assert b.unreached_grad_bytes == 0, (name, b.name)
        for b in head:  # gradient buffers stay priced, apart: replicas' buckets hold them, one replica not
            assert b.grad_bytes == b.param_bytes, (name, b.name)
            if name == "skipped":
                assert (b.optimizer_bytes, b.activation_bytes, b.optimizer_us) == (0, 0, 0.0), b
                assert b.unreached_grad_bytes == b.grad_bytes, b
            else:
                assert b.optimizer_bytes == 2 * b.param_bytes and b.unreached_grad_bytes == 0, (name, b.name)
    assert any(b.activation_bytes > 0 for b in profiles["read"].blocks if b.name.startswith("head"))


def test_the_meter_forgets_what_a_dropped_graph_saved() -> None:
    """Saves of a part of the forward whose output is dropped are freed with it, a saved output included (a
    meter that kept the output itself would keep its own node alive)."""
    from lightning_autopart.profile.saved import SavedTensorMeter

    x = torch.randn(64, 64, requires_grad=True)
    meter = SavedTensorMeter()
    with meter.hooks():
        kept = (x * 2).exp()  # exp saves its output
        dropped = x.tanh().exp()  # tanh and exp save their outputs
    assert meter.nbytes == 3 * 64 * 64 * 4
    del dropped
    meter.forget_freed()
    assert meter.nbytes == 64 * 64 * 4
    kept.sum().backward()  # what the meter hands back still differentiates
    assert torch.allclose(x.grad, 2 * (2 * x.detach()).exp())


def test_a_storage_made_where_a_dropped_save_was_freed_is_counted_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Storages are told apart by their address, which a storage made after another was freed may take: a MoE
    router's dropped group scores and a later save then shared one record, and a block's saves varied from one
    profile to the next. A storage at the address of one no node saves any more is a new one."""
    from lightning_autopart.profile import saved

    monkeypatch.setattr(saved, "storage_key", lambda t: 7)  # every storage at one address, as reuse would have it
    x = torch.randn(16, 16, requires_grad=True)
    meter = saved.SavedTensorMeter()
    with meter.hooks():
        dropped = x.exp()  # saves its 1 KiB output
        del dropped  # its node and the save are gone
        kept = x.repeat(4, 1).exp()  # a 4 KiB save at the same address
    meter.forget_freed()
    assert meter.nbytes == 4 * 16 * 16 * 4
    assert kept.requires_grad


def test_a_router_s_saves_are_the_same_in_every_profile() -> None:
    """DeepSeek-V3's router drops its group scores (only their order picks the experts): what its layer saves
    after them counts alike however the allocator places it (it varied by 7 % from one profile to the next)."""
    pytest.importorskip("transformers")
    from bench.hf_sweep import SWEEP
    from lightning_autopart.capture import capture
    from lightning_autopart.profile import profile

    model = build_architecture(SWEEP["deepseek_v3"], "cpu", dropout=False)
    captured = capture(model, ((), {"input_ids": torch.randint(0, 50, (2, 12))}))
    layer = next(k for k, b in enumerate(captured.blocks) if b.name == "model.layers.1")
    seen = {profile(captured, "estimate", spec="h100", blocks=[layer]).blocks[0].activation_bytes for _ in range(4)}
    assert len(seen) == 1, seen


class _Unused(nn.Module):
    """A trunk, a branch on it whose result nothing uses (its last block has no output: CANINE's upsampling
    beside its classification), and a head on the trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.Tanh())
        self.branch = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.LayerNorm(128))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(x)
        self.branch(hidden)
        return self.head(hidden)


def _output_loss(output: Any, samples: int) -> torch.Tensor:
    return output.square().mean()


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_a_branch_nothing_uses_keeps_no_optimizer_state_and_its_saves_only_through_the_forward(mode: str) -> None:
    """A value the forward computes and never uses ends in a block with no output: every block of its branch is
    dead (no gradient, no optimizer state, no activations), and what they save is held by the forward alone
    (``dropped_bytes``; the blocks that differentiate nothing are ``forward_only``). A block with no output
    counted as live kept the rest of the branch live: CANINE's plain step read 1.228 of its peak."""
    torch.manual_seed(0)
    device = "meta" if mode == "estimate" else "cpu"
    spec = "h100" if mode == "estimate" else None
    x = torch.randn(16, 32, device=device)
    prof = profile_model(_Unused().to(device), (x,), profile=mode, spec=spec, optimizer="adam", loss=_output_loss)
    branch = [b for b in prof.blocks if b.name.startswith("branch")]
    assert len(branch) >= 3, [b.name for b in prof.blocks]
    for b in branch:
        assert (b.optimizer_bytes, b.activation_bytes, b.unreached_grad_bytes) == (0, 0, b.grad_bytes), b
    assert all(b.forward_only for b in branch[1:]), branch
    assert sum(b.dropped_bytes for b in branch) >= 3 * 16 * 128 * 4  # GELU's, the Linear's and the norm's input
    for b in prof.blocks:
        if not b.name.startswith("branch"):
            assert b.optimizer_bytes == 2 * b.param_bytes and not b.forward_only and b.dropped_bytes == 0, b


def test_the_forward_peak_is_the_most_a_forward_holds_of_its_dead_parts_saves() -> None:
    """``ForwardPeak(i, j)``: the dead parts' saves all held at the forward's end, or those made before a block that
    runs no backward while it peaks, with the activations up to it, beyond all the activations of the stage."""
    import random

    from lightning_autopart.partition.tables import ForwardPeak

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        acts = [rng.randint(0, 100) for _ in range(n)]
        dropped = [rng.choice([0, 0, rng.randint(0, 100)]) for _ in range(n)]
        peaks = [rng.randint(0, 100) for _ in range(n)]
        only = [rng.random() < 0.4 for _ in range(n)]
        table = ForwardPeak(_prefix(acts), _prefix(dropped), peaks, only)
        for i in range(n):
            for j in range(i + 1, n + 1):
                moments = [sum(dropped[i:j])] + [
                    sum(acts[i : k + 1]) + sum(dropped[i:k]) + peaks[k] - sum(acts[i:j])
                    for k in range(i, j)
                    if only[k]
                ]
                assert table(i, j) == max(moments), (acts, dropped, peaks, only, i, j)


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
