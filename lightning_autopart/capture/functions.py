"""Custom ``torch.autograd.Function``s in a forward, whose backward torch.export drops.

[Note: custom autograd functions] torch.export (non-strict) records the operations a Function's forward runs
and drops the Function itself: the captured graph's backward is autograd's derivative of those operations, not
``Function.backward``. A straight-through estimator, a gradient reversal layer or a clipped gradient would
train silently wrong, and reentrant activation checkpointing, whose forward runs under ``no_grad``, left the
layers it wraps with no gradient at all. So, while the forward is exported:

- ``torch.utils.checkpoint`` runs its function plainly (both forms). The stages do not recompute what the
  user's forward checkpointed; the plan recomputes whole stages where memory needs it, and a note says so.
- A user's Function called with tensors and constants is kept whole, as one operator with the Function's own
  backward ([Note: Functions kept whole] in ``kept_functions.py``). After the export, each such call is
  checked on random inputs of the recorded shapes (:func:`check_kept`): the operator must give the Function's
  outputs and gradients, and the Function must neither draw random numbers nor write its inputs. A Function
  that fails is exported again as its operations, as below.
- Every other Function called (torch's own, or one the operator cannot stand in for) is checked after the
  export (:func:`check_function`): on random inputs of the recorded shapes, its backward must equal
  autograd's derivative of its forward. One that differs, or that cannot be checked, refuses the export, and
  capture falls back to module hooks, whose blocks call the Function itself at every step.
- The Functions torch generates for custom operators (``torch.library``) are not checked: such an operator
  stays one node of the graph, with its own backward.
- A Function exported as its operations may still save less for backward than they do (a GeLU that saves its
  input and recomputes the rest in backward while drawing random numbers): the check measures both with a
  saved-tensor hook; capture warns and notes it, with the fix (a custom operator keeps the Function's saving),
  and the plan prices what the stages save.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint as checkpointing
from torch.autograd import Function
from torch.utils import _pytree as pytree

from lightning_autopart.capture.kept_functions import apply_original, call_kept, keep, kept_call
from lightning_autopart.errors import CaptureError

__all__ = ["FunctionCalls", "Unkept", "check_function", "check_kept", "watch_functions"]

#: Inputs larger than this (elements, all tensors of one call) are checked with a batch of one.
_CHECK_ELEMENTS = 1 << 24
_SCALARS = (bool, int, float, str, type(None))


@dataclass
class FunctionCalls:
    """What an export's forward called: distinct custom Function calls, and activation checkpoints."""

    #: Each distinct call: (Function class, argument leaves with tensors as ``_TensorSpec``, argument spec).
    calls: dict[tuple[Any, ...], tuple[type[Function], list[Any], pytree.TreeSpec]] = field(
        default_factory=dict
    )
    checkpoints: int = 0
    #: Calls kept whole, by key: their tensor arguments as ``_TensorSpec`` ([Note: Functions kept whole]).
    kept: dict[str, list[Any]] = field(default_factory=dict)
    #: Functions kept as their operations that save more for backward than the Function: (name, bytes the
    #: Function saves, bytes its operations save), on the checked inputs.
    heavier: list[tuple[str, int, int]] = field(default_factory=list)

    def memory_notes(self) -> list[str]:
        """Functions whose operations save more than they did, and the fix (the capture warns of them)."""
        return [
            f"the autograd.Function {name} saves less for backward than its operations, as captured, do: the "
            f"stages hold {inlined / custom:.1f}x the bytes eager training holds there, and the plan prices that. "
            "To keep its saving, make it a custom operator (torch.library.custom_op, with register_fake and "
            "register_autograd): it then stays one operation with its own backward"
            for name, custom, inlined in self.heavier
        ]

    def notes(self) -> list[str]:
        """What the user should know of the capture: Functions kept whole or that saved less, checkpointing
        not kept."""
        kept = dict.fromkeys(kept_call(key).function.__qualname__ for key in self.kept)
        notes = [
            f"the autograd.Function {name} runs whole in the captured stages, with its own backward, which "
            "runs its forward again from its saved inputs"
            for name in kept
        ]
        notes += self.memory_notes()
        if self.checkpoints:
            notes.append(
                f"the forward's activation checkpointing (torch.utils.checkpoint, {self.checkpoints} calls) is "
                "not kept in the captured stages; the plan recomputes whole stages where memory needs it (its "
                "'checkpoint' column)"
            )
        return notes


class _PlainCheckpoint:
    """Stands in for reentrant checkpointing's Function during export: calls the function plainly."""

    def __init__(self, found: FunctionCalls) -> None:
        self.found = found

    def apply(self, function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        self.found.checkpoints += 1
        return function(*args)


def _torch_own(function: type[Function]) -> bool:
    """Whether ``function`` is torch's own (not a library's named like it: torchvision, torch_geometric)."""
    module = function.__module__ or ""
    return module == "torch" or module.startswith("torch.")


class Unkept(CaptureError):
    """Functions the operator cannot stand in for (by class, with the reason): export them as operations."""

    def __init__(self, reasons: dict[type[Function], str]) -> None:
        self.reasons = reasons
        super().__init__("; ".join(f"{f.__qualname__}: {why}" for f, why in reasons.items()))


@contextmanager
def watch_functions(
    cls: str, skip: frozenset[type[Function]] = frozenset(), check: bool = True
) -> Iterator[FunctionCalls]:
    """Run the body (an export of ``cls``) with checkpointing plain, a user's Function calls kept whole
    (but those of the classes in ``skip``) and other Function calls recorded; on a normal exit and with
    ``check``, check each distinct call (see [Note: custom autograd functions]). Raises :class:`Unkept` for
    the kept Functions the operator cannot stand in for, so that the caller exports again without them."""
    found = FunctionCalls()
    apply = Function.__dict__["apply"]

    def recording_apply(function: type[Function], *args: Any, **kwargs: Any) -> Any:
        if not _torch_own(function) and function not in skip:
            kept = keep(function, args, kwargs)
            if kept is not None:
                key, tensors = kept
                found.kept.setdefault(key, [_describe(t) for t in tensors])
                return call_kept(key, tensors)
        if not function.__module__.startswith("torch._library"):  # custom ops keep their own backward
            leaves, spec = pytree.tree_flatten((args, kwargs))
            described = [_describe(leaf) for leaf in leaves]
            values = tuple(d if isinstance(d, (_TensorSpec, *_SCALARS)) else id(d) for d in described)
            found.calls.setdefault((function, values), (function, described, spec))
        return apply_original(function, *args, **kwargs)

    def plain_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
        found.checkpoints += 1  # checkpoint() runs the function itself between two next()
        yield

    # Module globals that checkpoint() reads at each call, however the model imported it.
    stand_ins = {
        "CheckpointFunction": _PlainCheckpoint(found),
        "_checkpoint_without_reentrant_generator": plain_generator,
    }
    originals = {name: vars(checkpointing)[name] for name in stand_ins if name in vars(checkpointing)}
    Function.apply = classmethod(recording_apply)  # type: ignore[method-assign, assignment]
    for name in originals:
        setattr(checkpointing, name, stand_ins[name])
    try:
        yield found
    finally:
        Function.apply = apply  # type: ignore[method-assign]
        for name, original in originals.items():
            setattr(checkpointing, name, original)
    if not check:
        return
    unkept: dict[type[Function], str] = {}
    for key, described in found.kept.items():
        reason = check_kept(key, described)
        if reason:
            unkept.setdefault(kept_call(key).function, reason)
    if unkept:
        raise Unkept(unkept)
    for function, described, spec in found.calls.values():
        reason = check_function(function, described, spec, found)
        if reason:
            raise CaptureError(
                f"{cls}.forward calls the autograd.Function {function.__qualname__}, whose backward "
                f"torch.export would drop ({reason}); module hooks run it as written"
            )


def check_kept(key: str, described: list[Any]) -> str:
    """Why the operator cannot stand in for the kept call ``key`` ("" where it can), on random tensors shaped
    as ``described``: the Function draws random numbers or writes an input, or the operator's outputs or
    gradients differ from the Function's ([Note: Functions kept whole])."""
    call = kept_call(key)
    full = call.fill(described)
    cuda = sorted({d.device.index or 0 for d in described if d.device.type == "cuda"})
    drew: list[str] = []

    def plain(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        versions, state = [t._version for t in tensors], _generator_states(cuda)
        out = apply_original(call.function, *args, **kwargs)
        if any(not torch.equal(a, b) for a, b in zip(state, _generator_states(cuda), strict=True)):
            drew.append("it draws random numbers, which its backward's second run would draw again")
        elif [t._version for t in tensors] != versions:
            drew.append("it writes its inputs in place")
        return out

    def through(*args: Any, **kwargs: Any) -> Any:
        return call_kept(key, [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])

    try:
        with torch.random.fork_rng(devices=cuda):
            want, want_inputs = _run(plain, full, call.spec, cuda)
            if drew:
                return drew[0]
            got, got_inputs = _run(through, full, call.spec, cuda)
            if len(want) != len(got) or any(not _close(w, g) for w, g in zip(want, got, strict=True)):
                return "its outputs through one operator differ from its own"
            keep_ = [k for k, o in enumerate(want) if o.requires_grad and got[k].requires_grad]
            if want_inputs and keep_ and not _same_gradients(want, want_inputs, got, got_inputs, keep_):
                return "its gradients through one operator differ from its own"
    except Exception as error:
        return f"it could not be checked as one operator: {type(error).__name__}: {_first_line(error)}"
    return ""


def _generator_states(cuda: list[int]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(i) for i in cuda)]


def _close(want: torch.Tensor, got: torch.Tensor, fp32_tolerance: float = 1e-5, equal_nan: bool = True) -> bool:
    """Equal shapes and values within a tolerance relative to ``want``'s largest value (1e-2 in 16 bits)."""
    tolerance = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) else fp32_tolerance
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    return want.shape == got.shape and torch.allclose(
        want.detach().float(), got.detach().float(), tolerance, tolerance * scale, equal_nan=equal_nan
    )


def _same_gradients(
    want: list[torch.Tensor],
    want_inputs: list[torch.Tensor],
    got: list[torch.Tensor],
    got_inputs: list[torch.Tensor],
    keep: list[int],
    fp32_tolerance: float = 1e-5,
    equal_nan: bool = True,
) -> bool:
    """Whether two runs give their inputs the same gradients for the same random cotangents of outputs ``keep``."""
    generator = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(want[k].shape, generator=generator, device="cpu").to(want[k]) for k in keep]
    grads_want = _grads([want[k] for k in keep], want_inputs, cotangents)
    grads_got = _grads([got[k] for k in keep], got_inputs, cotangents)
    return all(_close(w, g, fp32_tolerance, equal_nan) for w, g in zip(grads_want, grads_got, strict=True))


def check_function(
    function: type[Function], described: list[Any], spec: pytree.TreeSpec, found: FunctionCalls | None = None
) -> str:
    """Why exporting ``function`` would change training ("" where it would not): its backward must equal
    autograd's derivative of its forward, on random inputs shaped as ``described`` (see
    :func:`watch_functions`), outputs that need a gradient alike. A Function that passes but saves less for
    backward than its operations do (BLOOM's GeLU saves its input alone) is listed in ``found.heavier``."""
    specs = [d for d in described if isinstance(d, _TensorSpec)]
    cuda = sorted({d.device.index or 0 for d in specs if d.device.type == "cuda"})
    from lightning_autopart.profile.saved import SavedTensorMeter  # the profiler's meter (no import cycle)

    saved_custom, saved_inlined = SavedTensorMeter(), SavedTensorMeter()
    try:
        with torch.random.fork_rng(devices=cuda):  # leaves the user's generators as they were
            with saved_custom.hooks():
                custom, custom_inputs = _run(function.apply, described, spec, cuda)
            with saved_inlined.hooks():
                inlined, inlined_inputs = _run(_inline(function), described, spec, cuda)
    except Exception as error:
        return f"it could not be checked: {type(error).__name__}: {_first_line(error)}"
    if [o.requires_grad for o in custom] != [o.requires_grad for o in inlined]:
        return "its backward gives no gradient where its forward's operations would, or the reverse"
    keep = [k for k, o in enumerate(custom) if o.requires_grad]
    if not custom_inputs or not keep:
        return ""
    try:
        same = _same_gradients(custom, custom_inputs, inlined, inlined_inputs, keep, 1e-4, equal_nan=False)
    except Exception as error:
        return f"its backward could not be checked: {type(error).__name__}: {_first_line(error)}"
    if not same:
        return "its backward is not the derivative of its forward"
    few, many = saved_custom.nbytes, saved_inlined.nbytes
    if found is not None and few and many > max(1.25 * few, few + 4096):
        found.heavier.append((function.__qualname__, few, many))
    return ""


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


class _TensorSpec(NamedTuple):
    """A tensor argument as recorded during export (the values of a traced tensor are not known)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    device: torch.device


def _describe(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _TensorSpec(tuple(leaf.shape), leaf.dtype, leaf.requires_grad, leaf.device)
    return leaf


def _run(
    call: Any, described: list[Any], spec: pytree.TreeSpec, cuda: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``call`` on random inputs as ``described`` (the same values at every call): its floating outputs, and
    the inputs that need a gradient. Floats are normal and others zero, with a batch of one where large."""
    # A forward that draws (dropout) draws alike on both paths. Only the generators the caller forked are
    # seeded: torch.manual_seed would also reset every CUDA generator, which the user's run goes on with.
    torch.default_generator.manual_seed(0)
    for index in cuda:
        torch.cuda.default_generators[index].manual_seed(0)
    tensors = [d for d in described if isinstance(d, _TensorSpec)]
    shrink = sum(math.prod(d.shape) for d in tensors) > _CHECK_ELEMENTS
    generator = torch.Generator().manual_seed(0)
    leaves, inputs = [], []
    for d in described:
        if not isinstance(d, _TensorSpec):
            leaves.append(d)
            continue
        shape = (1, *d.shape[1:]) if shrink and d.shape else d.shape
        device = torch.device("cpu") if d.device.type == "meta" else d.device
        if d.dtype.is_floating_point:
            t = torch.randn(shape, generator=generator, device="cpu").to(device=device, dtype=d.dtype)
            if d.requires_grad:
                t = t.requires_grad_().clone()  # not a leaf, so a forward may write it in place
                inputs.append(t)
        else:
            t = torch.zeros(shape, dtype=d.dtype, device=device)
        leaves.append(t)
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    out = call(*args, **kwargs)
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return outputs, inputs


def _grads(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], cotangents: list[torch.Tensor]
) -> list[torch.Tensor]:
    grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]


class _Context:
    """A stand-in ``ctx`` for calling an old-style ``forward(ctx, ...)`` as plain code."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        self.saved_tensors: tuple[torch.Tensor, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _inline(function: type[Function]) -> Any:
    """``function``'s forward as plain code, as torch.export records it."""
    if function.setup_context is not Function.setup_context:  # new style: forward(*args), no ctx
        return function.forward

    def call(*args: Any, **kwargs: Any) -> Any:
        return function.forward(_Context(args), *args, **kwargs)

    return call
