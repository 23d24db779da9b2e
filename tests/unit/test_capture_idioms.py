"""Capture of real model code: tensors made in forward follow the device, structured outputs are rebuilt, shared
modules and non-chain children do not break the blocks."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from lightning_autopart.capture import capture, split_inputs
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.runtime.stages import build_stage_module
from tests.idioms import KVCache, StructuredOut
from tests.models import example, make


def _flat(example_inputs: Any) -> list[Any]:
    args, kwargs = split_inputs(example_inputs)
    return pytree.tree_leaves((args, kwargs))


def _run_stages(
    captured: CapturedModel, inputs: list[Any], bounds: list[int], device: str | None = None
) -> tuple[Any, ...]:
    """Chain the stages ``bounds`` delimits; with ``device``, each stage is first copied there (as a rank moves its
    stage to its device; the copy keeps the user's model where it is)."""
    values = tuple(inputs)
    for start, end in itertools.pairwise(bounds):
        stage = build_stage_module(captured, start, end)
        if device == "meta":
            stage = copy.deepcopy(stage).to(device)
        elif device is not None:
            stage = copy.deepcopy(stage).to_empty(device=device)
        values = stage(*values)
    return values


@pytest.mark.parametrize("name", ["factory", "gpt"])
def test_captured_on_cpu_stages_run_on_meta(name: str) -> None:
    """Tensors created in forward (arange, ones, triu, zeros, full, randn, new_ones, dropout) follow the stage's
    device: capture on the CPU, run every stage on meta (a stand-in for a GPU that CPU tests can use)."""
    model, x = make(name), example(name)
    model.train()
    captured = capture(model, x, max_blocks=8)
    assert captured.num_blocks >= 3
    (out,) = _run_stages(captured, [x.to("meta")], list(range(captured.num_blocks + 1)), "meta")
    assert out.is_meta and tuple(out.shape) == captured.cuts[-1][0].shape
    assert all(p.device.type == "cpu" for p in model.parameters())
    model.eval()
    with torch.no_grad():
        (cpu_out,) = _run_stages(captured, [x], [0, 2, captured.num_blocks])
        torch.testing.assert_close(cpu_out, model(x))


def test_device_constants_follow_the_inputs_in_every_program() -> None:
    captured = capture(make("factory"), example("factory"))
    devices = [
        n
        for b in captured.blocks
        for n in b.program.graph.nodes
        if any(isinstance(v, torch.device) for v in (*n.args, *n.kwargs.values()))
    ]
    assert devices == []  # every "device=cpu" became the device of an input, read at run time
    assert "getattr" in "".join(b.program.code for b in captured.blocks)


def test_structured_output_is_rebuilt_and_the_cache_dropped() -> None:
    model, (x, y) = make("structured"), example("structured")
    with pytest.warns(UserWarning, match=r"\.extra\['cache'\] \(KVCache\).*use_cache=False"):
        captured = capture(model, (x, y), max_blocks=8)
    assert captured.method == "export"
    tensors = _run_stages(captured, [x, y], [0, 2, captured.num_blocks])
    assert len(tensors) == len(captured.cuts[-1]) == 3  # loss, logits, h (logits deduplicated)
    out = captured.output.rebuild(tensors)
    reference = model(x, y)
    assert isinstance(out, StructuredOut) and isinstance(reference.extra["cache"], KVCache)
    torch.testing.assert_close(out.loss, reference.loss)
    torch.testing.assert_close(out.logits, reference.logits)
    assert type(out.extra["pair"]).__name__ == "Pair"
    torch.testing.assert_close(out.extra["pair"].first, reference.extra["pair"].first)
    assert out.extra["again"] is out.logits  # one tensor in two places stays one tensor
    assert out.extra["steps"] == 3 and out.extra["cache"] is None
    assert captured.output.dropped == (".extra['cache'] (KVCache)",)
    labels = captured.inputs[1]
    assert labels.dtype == "int64" and not labels.requires_grad
    assert all(labels in cut for cut in captured.cuts[:-1])  # the labels travel to the loss


class _DictOut(nn.Module):
    """Glue-free (hooks can capture it), returns a dict with a cache object."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.a(x)
        return {"logits": self.b(h), "hidden": h, "cache": KVCache([h])}


def test_hooks_capture_rebuilds_the_output_too() -> None:
    model, x = _DictOut(), torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"\['cache'\] \(KVCache\)"):
        captured = capture(model, x, method="modules")
    out = captured.output.rebuild(_run_stages(captured, [x], [0, 1, captured.num_blocks]))
    assert set(out) == {"logits", "hidden", "cache"} and out["cache"] is None
    torch.testing.assert_close(out["logits"], model(x)["logits"])


def test_which_cut_values_need_gradients() -> None:
    captured = capture(make("gpt"), example("gpt"), max_blocks=8)
    kinds = {(t.dtype, t.requires_grad) for cut in captured.cuts[:-1] for t in cut}
    assert kinds == {("bool", False), ("float32", True)}  # the mask needs none, activations do
    captured = capture(make("structured"), example("structured"))
    assert [t.requires_grad for t in captured.cuts[-1]] == [True, True, True]


def test_a_module_called_twice_is_two_blocks_with_a_tied_weight() -> None:
    model, x = make("called_twice"), example("called_twice")
    captured = capture(model, x)
    assert [b.name for b in captured.blocks] == ["shared", "mid", "shared#2", "last"]
    assert captured.tied == {"shared.weight": (0, 2), "shared.bias": (0, 2)}
    first, second = build_stage_module(captured, 0, 2), build_stage_module(captured, 2, 4)
    second(*first(x))[0].sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_repeated_layers_are_never_split() -> None:
    """A heavy residual block alone may be split by weight (its residual add stays inside the block's last run);
    repeated layers are kept whole: attention is never split into q/k/v."""
    captured = capture(make("wide_residual"), example("wide_residual"), max_blocks=64)
    assert [b.name for b in captured.blocks] == ["stem", "block.fc1", "block.fc2", "head"]
    assert captured.blocks[2].op_count > captured.blocks[1].op_count  # relu and the skip add ride with fc2
    captured = capture(make("gpt"), example("gpt"), max_blocks=64)
    assert [b.name for b in captured.blocks] == ["tok", "pos", "layers.0", "layers.1", "layers.2", "ln_f", "head"]


def test_meta_inputs_capture_programs_that_run_on_cpu() -> None:
    """Captured on meta (planning a model that does not fit), the stages still run on real tensors."""
    with torch.device("meta"):
        model = make("factory")
    captured = capture(model, torch.zeros(4, 6, dtype=torch.long, device="meta"))
    with torch.no_grad():
        (out,) = _run_stages(captured, [example("factory")], [0, 2, captured.num_blocks], "cpu")
    assert out.device.type == "cpu" and tuple(out.shape) == (4, 6, 20)


class Rotary(nn.Module):
    """A rotary embedding's angles: its frequencies (a buffer) moved to the activations' device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (positions[:, None].float() * self.freq.to(device=x.device)).cos()


class CounterFirst(nn.Module):
    """Like a Hugging Face decoder with a sliding-window cache: a counter made with ``torch.tensor`` (always
    on the CPU) offsets the positions, which a rotary block reads with no activation as input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rotary = Rotary()
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        seen = torch.tensor(0)
        positions = torch.arange(ids.shape[1], device=h.device) + seen
        return self.head(h + self.rotary(h, positions))


def test_a_cpu_constant_does_not_pin_a_meta_capture_to_the_cpu() -> None:
    """[Note: portable programs]: captured on meta, the program that computes the angles holds a CPU counter
    and the meta buffer, and no input; it reads its device from the buffer, so its stages run on meta
    (estimate mode) and on the CPU. (Reading it from the counter moved the meta buffer to the CPU: "Cannot
    copy out of meta tensor", which kept Mistral out of estimate mode.)"""
    with torch.device("meta"):
        model = CounterFirst()
    captured = capture(model, torch.zeros(2, 5, dtype=torch.long, device="meta"))
    ids = torch.zeros(2, 5, dtype=torch.long)
    bounds = list(range(captured.num_blocks + 1))
    (out,) = _run_stages(captured, [ids.to("meta")], bounds, "meta")
    assert out.is_meta and tuple(out.shape) == (2, 5, 4)
    with torch.no_grad():
        (cpu_out,) = _run_stages(captured, [ids], bounds, "cpu")
    assert cpu_out.device.type == "cpu" and tuple(cpu_out.shape) == (2, 5, 4)


class CpuIndexBias(nn.Module):
    """Like BEiT's relative position bias: an index built on the CPU (no device given) and filled with Python
    integers, which torch.export lifts as constants, then used to gather rows of a parameter table."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.zeros(x.shape[1], dtype=torch.long)
        index[1:] = torch.arange(1, x.shape[1]) % 5
        index[0] = 6
        return self.proj(x) + self.table[index]


def test_a_cpu_index_in_a_meta_capture_is_profiled_in_estimate_mode() -> None:
    """[Note: portable programs]: built on meta, the program fills a CPU index with constants that the profiler's
    meta copy must leave on the CPU (moved to meta, they had no values: "Cannot copy out of meta tensor")."""
    from lightning_autopart.profile import profile

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), CpuIndexBias())
    captured = capture(model, torch.zeros(2, 6, 8, device="meta"))
    prof = profile(captured, "estimate", spec="h100")
    assert all(b.fwd_us > 0 for b in prof.blocks) and prof.blocks[-1].fwd_flops > 0


class LegacyScale(nn.Module):
    """Like ImageGPT's layer norm and XLNet's attention: a parameter (and here a buffer) made by a legacy type
    constructor, which makes a CPU tensor whatever ``torch.device(...)`` is in effect."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.Tensor(width))
        self.register_buffer("shift", torch.FloatTensor(width))
        with torch.no_grad():
            self.weight.fill_(2.0)
            self.shift.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.shift


def test_a_meta_model_with_legacy_cpu_tensors_is_planned_as_wholly_on_meta() -> None:
    """[Note: tensors the meta device missed]: built on meta, the model holds a CPU parameter and buffer (as
    XLNet and ImageGPT do), which its forward mixed with meta activations ("Tensor on device cpu is not on
    the expected device meta!"). A GPU run moves them to the device with the rest, so capture and estimate
    mode run them on meta, and leave them on the CPU, values untouched, afterwards."""
    from lightning_autopart import Cluster, plan_model
    from lightning_autopart.profile import profile

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), LegacyScale(8), nn.Linear(8, 4))
    weight, shift = model[1].weight, model[1].shift
    assert weight.device.type == "cpu" and shift.device.type == "cpu" and model[0].weight.is_meta
    x = torch.zeros(4, 8, device="meta")
    captured = capture(model, x)
    for dtype in (None, "bf16-mixed"):
        prof = profile(captured, "estimate", spec="h100", dtype=dtype)
        assert all(b.fwd_us > 0 for b in prof.blocks) and prof.blocks[1].activation_bytes > 0
    plan = plan_model(model, x, Cluster.from_spec("h100", 2), 8, num_stages=2)
    assert sum(len(s.blocks) for s in plan.stages) == captured.num_blocks
    assert model[1].weight is weight and model[1].shift is shift  # the user's own tensors, back on the CPU
    assert not weight.is_meta and bool((weight == 2.0).all()) and bool((shift == 0.5).all())
    assert model[0].weight.is_meta


class GroupedAttention(nn.Module):
    """Attention with fewer key/value heads, its output merged as Hugging Face's sdpa path merges it:
    ``transpose(1, 2).contiguous()`` then, in the layer, ``view(batch, length, -1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = (y.view(b, t, 2, 4).transpose(1, 2) for y in self.kv(x).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).contiguous().view(b, t, -1))


def test_a_view_after_attention_holds_on_any_kernel_layout() -> None:
    """[Note: views on any layout]: the CPU's flash kernel lays attention's output out as (batch, length, heads,
    size), so the ``contiguous()`` after the transpose copied nothing and torch.export recorded none; a GPU's
    math path (grouped heads in float32), like meta's, returns (batch, heads, length, size), where the view
    that followed raised ("view size is not compatible", AFMoE in estimate mode). The view now copies where
    the layout needs it, as ``contiguous()`` does eagerly, and is the same view where it does not."""
    from lightning_autopart.profile import profile

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), GroupedAttention()), torch.randn(2, 6, 16)
    captured = capture(model, x)
    prof = profile(captured, "estimate", spec="h100")
    assert all(b.fwd_flops > 0 for b in prof.blocks)
    (out,) = _run_stages(captured, [x.to("meta")], list(range(captured.num_blocks + 1)), "meta")
    assert out.is_meta and tuple(out.shape) == (2, 6, 16)
    (got,) = _run_stages(captured, [x], [0, captured.num_blocks])
    got.square().sum().backward()
    captured_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for ours, eager in zip(captured_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(ours, eager)


def test_stages_follow_the_models_train_and_eval_modes() -> None:
    """Dropout and BatchNorm flags are read from the user's modules when the stages run (captured in train mode)."""
    model, x = make("factory"), example("factory")
    captured = capture(model.eval(), x, max_blocks=8)  # captured in training mode whatever the model's mode
    assert not model.training
    with torch.no_grad():
        (out,) = _run_stages(captured, [x], [0, 2, captured.num_blocks])
        torch.testing.assert_close(out, model(x))  # eval: dropout off
        model.train()
        torch.manual_seed(3)
        (out,) = _run_stages(captured, [x], [0, 2, captured.num_blocks])
        torch.manual_seed(3)
        torch.testing.assert_close(out, model(x))  # train: the same dropout mask

    net, image = make("resnet"), example("resnet")
    twin = copy.deepcopy(net)
    captured = capture(net, image, max_blocks=8)
    bounds = [0, 3, captured.num_blocks]
    for mode in ("train", "eval", "frozen"):
        for m in (net, twin):
            m.train(mode != "eval")
            if mode == "frozen":
                m.get_submodule("stage1").eval()  # a user's frozen BatchNorm inside a training model
        with torch.no_grad():
            (out,) = _run_stages(captured, [image], bounds)
            torch.testing.assert_close(out, twin(image), msg=mode)
        for (name, a), b in zip(net.named_buffers(), twin.buffers(), strict=True):
            torch.testing.assert_close(a, b, msg=f"{mode}: {name}")  # running stats and batch counts moved alike


class _FrozenStatistics(nn.Module):
    """A forward that writes the mode flags itself: running statistics only (frozen, never updated) and a
    dropout of its own choice, whatever the module's mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(self.lin(x), self.mean, self.var, training=False)
        return F.dropout(x, 0.5, training=False) + F.dropout(x, 0.5, training=self.training)


def test_flags_the_forward_writes_itself_stay() -> None:
    """Only a flag equal to its module's mode at capture is ``self.training``: a ``training=False`` written in a
    training forward stays False (before, the batch norm normalized by the batch and moved the frozen
    statistics)."""
    model, x = _FrozenStatistics(), torch.randn(8, 4)
    twin = copy.deepcopy(model)
    captured = capture(model, x)
    for training in (True, False):
        model.train(training), twin.train(training)
        torch.manual_seed(5)
        (out,) = _run_stages(captured, [x], [0, captured.num_blocks])
        torch.manual_seed(5)
        torch.testing.assert_close(out, twin(x), msg=f"training={training}")
        torch.testing.assert_close(model.mean, twin.mean)  # never updated


def test_what_capture_gives_up_is_noted_with_the_fix() -> None:
    """Falling back to module hooks, and merging a module whose forward holds glue, are said with the fix."""
    captured = capture(make("data_dependent"), example("data_dependent"))
    fallback, merged = captured.notes
    assert "torch.export cannot trace DataDependent" in fallback and "data-dependent control flow" in fallback
    assert merged.startswith("'gate' is one block: output 0 of 'gate' is computed in Gate.forward outside any")
    assert "move that computation into a submodule" in merged
    assert capture(make("gpt"), example("gpt")).notes == ()
