"""Custom autograd Functions keep their backward, and activation checkpointing its gradients, in a capture
([Note: custom autograd functions] in lightning_autopart/capture/functions.py, [Note: Functions kept whole]
in kept_functions.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as checkpointing
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_autopart.capture import capture
from tests.eager import assert_grads_equal_eager
from tests.idioms import KeptFunctions, Reverse


class StraightThrough(torch.autograd.Function):
    """Rounding with the gradient passed straight through (quantization-aware training); new style."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.round()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Square(torch.autograd.Function):
    """The derivative written by hand, saving the input: exporting it changes nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class TanhGelu(torch.autograd.Function):
    """BLOOM's GeLU: saves its input alone and recomputes the tanh in backward (its operations save five tensors)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class Applies(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x)


def _kept(captured: Any) -> list[str]:
    """The Functions the captured graph calls whole ([Note: Functions kept whole])."""
    graph = captured.split_graph.graph if captured.split_graph is not None else None
    assert graph is not None
    found = []
    for module in captured.split_graph.modules():
        for node in getattr(module, "graph", graph).nodes:
            if node.op == "call_function" and node.target is torch.ops.autopart.function_call.default:
                found.append(node.args[0].split("#")[0].rsplit(".", 1)[-1])
    return found


@pytest.mark.parametrize("function", [Reverse, StraightThrough])
def test_a_function_whose_backward_is_not_the_derivative_runs_whole(function: type) -> None:
    """torch.export would differentiate the forward's operations; the Function runs whole instead."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Applies(function), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "export" and _kept(captured) == [function.__name__]
    assert any(function.__name__ in n and "runs whole" in n for n in captured.notes), captured.notes
    assert_grads_equal_eager(model, captured, x)
    assert torch.autograd.Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"  # put back


def test_a_function_is_kept_whole_on_meta_inputs_too() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Applies(Reverse), nn.Linear(4, 2))
        x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "export" and _kept(captured) == ["Reverse"]


def test_a_hand_written_derivative_runs_whole() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Applies(Square), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "export" and _kept(captured) == ["Square"]
    assert_grads_equal_eager(model, captured, x)


def _saved_bytes(run: Any) -> int:
    """Bytes of the tensors autograd saves for backward while ``run()`` runs."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def test_a_function_that_saves_less_than_its_operations_keeps_its_saving() -> None:
    """BLOOM's GeLU saves its input alone; exported as its operations, the stages held 7x the bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), Applies(TanhGelu), nn.Linear(256, 8))
    x = torch.randn(16, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: the stages save what eager training saves
        captured = capture(model, x)
    assert captured.method == "export" and _kept(captured) == ["TanhGelu"]
    assert_grads_equal_eager(model, captured, x)
    eager = _saved_bytes(lambda: model(x))
    assert eager == _saved_bytes(lambda: captured.split_graph(x))  # type: ignore[misc]


class Noisy(torch.autograd.Function):
    """Scales by a random mask it draws (a hand-written dropout): a second run in backward would draw another."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.rand_like(x) > 0.5).to(x.dtype) * 2.0
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask


class Doubled(torch.autograd.Function):
    """Doubles its input in place (``mark_dirty``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        return x.mul_(2.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2.0


class _DoubledAfter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Doubled.apply(x * 1.0)


@pytest.mark.parametrize("function", [Noisy, Doubled])
def test_a_function_one_operator_cannot_stand_in_for_is_exported_as_its_operations(function: type) -> None:
    """One that draws random numbers or writes its input is checked as before (its derivative is right)."""
    torch.manual_seed(0)
    inner = Applies(Noisy) if function is Noisy else _DoubledAfter()
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 2))
    captured = capture(model, torch.randn(3, 4))
    assert captured.method == "export" and _kept(captured) == []
    assert not any("runs whole" in n for n in captured.notes), captured.notes


class Scaled(torch.autograd.Function):
    """Two outputs from a tensor, a weight and a constant, with a product autocast lowers and a clipped
    gradient (as a quantizer's scale)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        y = x @ w
        return y * scale, y.relu()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")  # the backward runs under the forward's autocast
    def backward(ctx: Any, g1: torch.Tensor, g2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        g = (g1 * ctx.scale + g2 * ((x @ w) > 0)).clamp(-0.5, 0.5)
        return g @ w.t(), x.t() @ g, None


class _Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = Scaled.apply(x, self.w, 0.5)
        return a + b


@pytest.mark.parametrize("autocast", [False, True])
def test_a_kept_function_with_weights_constants_and_outputs_trains_as_eagerly(autocast: bool) -> None:
    """Its backward runs its forward again under the autocast its forward ran in (bfloat16 on the CPU)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Quantized(), nn.Linear(8, 2))
    x = torch.randn(5, 8)
    captured = capture(model, x)
    assert captured.method == "export" and _kept(captured) == ["Scaled"]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        eager_out = model(x)
        got_out = captured.split_graph(x)[0]  # type: ignore[misc]
    assert got_out.dtype == eager_out.dtype
    eager_out.float().square().sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got_out.float().square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, eager[name], msg=name)


def test_checking_a_function_leaves_the_random_generators_as_they_were() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), Applies(Square), nn.Linear(4, 2))
    state = torch.get_rng_state()
    assert capture(model, torch.ones(3, 4)).method == "export"  # Square was checked, on random inputs
    assert torch.equal(torch.get_rng_state(), state)


class Checkpointed(nn.Module):
    """A layer that checkpoints its activations, reentrant (torch's default) or not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(lambda t: self.layer(t).tanh(), x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_layers_get_their_gradients(reentrant: bool) -> None:
    """Reentrant checkpointing runs its forward under no_grad, which torch.export recorded: the layers it
    wrapped had no gradient at all. The capture runs checkpointed functions plainly and says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Checkpointed(reentrant), Checkpointed(reentrant), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    captured = capture(model, x)
    assert captured.method == "export" and captured.num_blocks == 4
    assert any("checkpointing (torch.utils.checkpoint, 2 calls)" in n for n in captured.notes), captured.notes
    assert_grads_equal_eager(model, captured, x)
    assert checkpointing.CheckpointFunction.__name__ == "CheckpointFunction"  # put back


def test_hugging_face_reentrant_gradient_checkpointing_trains_every_parameter() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    captured = capture(model, {"input_ids": ids})
    assert captured.method == "export" and captured.split_graph is not None
    model(input_ids=ids).logits.square().mean().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    captured.split_graph(ids)[0].square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, eager[name], msg=name)


def test_estimate_mode_counts_a_kept_function_s_own_operations() -> None:
    """The operator runs the Function's forward, whose product the counter sees: no custom op priced blind."""
    from lightning_autopart.planner import profile_model

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), _Quantized(), nn.Linear(8, 2))
        x = torch.randn(5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "custom ops with no FLOP formula" warning
        prof = profile_model(model, ((x,), {}), spec="h100")
    assert "opaque_ops" not in prof.meta
    assert [b.fwd_flops for b in prof.blocks] == [2 * 5 * 8 * 8, 2 * 5 * 8 * 8, 2 * 5 * 8 * 2]


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_a_kept_function_that_returns_a_view_of_its_input_runs_under_a_dispatch_mode() -> None:
    """Below autograd a view is not marked as one: the operator tells its outputs' aliases by their storage
    (the profiler's and the tests' memory counters are dispatch modes)."""
    torch.manual_seed(0)
    model = KeptFunctions()
    x = torch.randn(4, 16)
    captured = capture(model, x)
    assert captured.method == "export" and sorted(_kept(captured)) == ["ClippedSqrt", "Reverse"]
    model(x).square().sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with _Passing():
        got = captured.split_graph(x)[0]  # type: ignore[misc]
        got.square().sum().backward()
    torch.testing.assert_close(got, model(x))
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, eager[name], msg=name)


def test_a_kept_function_s_products_are_lowered_by_autocast_on_meta() -> None:
    """Estimate mode's autocast on meta is a function mode, off while it handles the operator: the operator
    enters it again, so the Function's product runs in bfloat16 as under torch's autocast."""
    from lightning_autopart.profile.autocast_meta import MetaAutocast

    def kept_block(device: str) -> Any:
        torch.manual_seed(0)
        with torch.device(device):
            model = nn.Sequential(nn.Linear(8, 8), _Quantized(), nn.Linear(8, 2))
            return capture(model, torch.randn(5, 8)).blocks[1].program

    on_cpu, on_meta = kept_block("cpu"), kept_block("meta")
    x = torch.randn(5, 8, requires_grad=True)  # float32: only a lowered product gives bfloat16 outputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = on_cpu(x)[0]
    meta = x.detach().to("meta").requires_grad_()
    with MetaAutocast(torch.bfloat16, "cpu"):
        got = on_meta(meta)[0]
    assert got.dtype == want.dtype == torch.bfloat16
    got.float().sum().backward()  # the backward's second forward runs under it too
    assert meta.grad is not None and meta.grad.shape == x.shape


def test_a_library_s_function_named_like_torch_is_kept_whole() -> None:
    """torch's own Functions are left to torch.export; a library whose name starts with "torch" is a user's."""
    library = type("Library", (StraightThrough,), {"__module__": "torchvision.ops.quantize"})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Applies(library), nn.Linear(4, 2))
    captured = capture(model, torch.randn(3, 4))
    assert captured.method == "export" and _kept(captured) == ["Library"]


def test_a_function_defined_again_under_its_name_runs_its_new_code() -> None:
    """A notebook cell run again defines another class under the same name: its capture calls the new one."""

    def define(sign: float) -> type:
        class Flip(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x * 1.0

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return grad * sign

        return Flip

    x, grads = torch.randn(3, 4), []
    for sign in (1.0, -1.0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), Applies(define(sign)))
        captured = capture(model, x)
        assert _kept(captured) == ["Flip"]
        captured.split_graph(x)[0].sum().backward()  # type: ignore[misc]
        grads.append(model[0].weight.grad)
    torch.testing.assert_close(grads[1], -grads[0])
