"""Custom autograd Functions kept whole in an exported graph: one operator that calls the Function.

[Note: Functions kept whole] torch.export (non-strict) traces through a custom ``torch.autograd.Function``:
the graph holds its forward's operations, and the stages' backward would be autograd's derivative of those,
not ``Function.backward``. A clipped or straight-through gradient (RecurrentGemma's ``SqrtBoundDerivative``,
PhiMoE's ``PhimoeMultiplier``) would then train wrong, and a hand-written derivative that saves less (BLOOM's
GeLU saves its input alone) would hold 7x the bytes eager training holds. So, while a forward is exported,
each call of a user's Function (not torch's own) whose arguments are tensors and constants becomes one call
of the operator ``autopart::function_call(key, tensors)``:

- its forward calls ``Function.apply`` under ``no_grad`` (its fake implementation does the same on fake or
  meta tensors, so shapes and dtypes come from the Function itself); outputs that alias an input are copied;
- its autograd saves the call's tensor inputs and the autocast state it ran under, and its backward runs the
  Function's forward again on them, under that autocast, then ``Function.backward`` through
  ``torch.autograd.grad``. So the gradient is the Function's own, and what a stage holds for it between
  forward and backward is its inputs (what a Function that saves its input holds), at the cost of its forward
  once more in backward (for the elementwise Functions models carry, a small part of a step).

``key`` names the Function (with the order its class was met in, for a class defined again under the same
name) and the constants of its call (:data:`_CALLS`, filled when a forward is exported, in every process that
captures the model). A Function the operator cannot stand in for (one that draws random
numbers, which the backward's run would draw again; one that writes its inputs; one whose outputs through the
operator differ) is found by :func:`lightning_autopart.capture.functions.check_kept` after the export and
exported again as before ([Note: custom autograd functions] in ``functions.py``).

Estimate mode sees inside the operator: the op counter runs :func:`run_whole` itself, so the Function's
products are priced as products (``profile/opcount.py``), and ``MetaAutocast``, autocast's stand-in on meta, is
a function mode, off while it handles the operator, so it is entered again around the Function's runs
(:func:`modes_inside`). An output aliases an input where they share a storage: below autograd, where the
operator runs, a view is not marked as one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["CONSTANTS", "KeptCall", "apply_original", "call_kept", "keep", "kept_call", "modes_inside", "run_whole"]

#: The leaves a kept call may have besides tensors: they are part of its key.
CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)
#: ``Function.apply`` as torch defines it (the export patches the class attribute).
_APPLY = Function.__dict__["apply"].__func__


def apply_original(function: type[Function], *args: Any, **kwargs: Any) -> Any:
    """``function.apply(*args, **kwargs)`` as torch defines it, whatever stands in for it now."""
    return _APPLY(function, *args, **kwargs)


@dataclass
class KeptCall:
    """One Function with the constants of one call: what the operator's key stands for."""

    function: type[Function]
    #: The call's ``(args, kwargs)`` leaves, a marker where a tensor goes, and their structure.
    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec
    #: The outputs' structure and their constant leaves (the marker where a tensor is), once the call ran.
    outputs: tuple[pytree.TreeSpec, tuple[Any, ...]] | None = field(default=None)

    def fill(self, values: list[Any]) -> list[Any]:
        """The call's leaves with ``values`` in the tensors' places."""
        given = iter(values)
        return [next(given) if leaf is _TENSOR else leaf for leaf in self.leaves]

    def arguments(self, tensors: list[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's positional and keyword arguments, with ``tensors`` in the tensors' places."""
        args, kwargs = pytree.tree_unflatten(self.fill(tensors), self.spec)
        return args, kwargs

    def results(self, tensors: list[Tensor]) -> Any:
        """The Function's outputs, rebuilt from the operator's tensors."""
        assert self.outputs is not None, "the kept call has not run"
        spec, constants = self.outputs
        given = iter(tensors)
        return pytree.tree_unflatten([next(given) if c is _TENSOR else c for c in constants], spec)


class _Tensor:
    """The place of a tensor among a call's leaves."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()
#: Every kept call by key ([Note: Functions kept whole]).
_CALLS: dict[str, KeptCall] = {}
#: The Function classes met under each module-qualified name, in the order met.
_CLASSES: dict[str, list[type[Function]]] = {}


def keep(function: type[Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, list[Tensor]] | None:
    """The key and tensors of a call of ``function`` that the operator can stand in for, registered; None for
    a call with no tensor or with an argument that is neither a tensor nor a constant."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    if not tensors or not all(isinstance(leaf, (Tensor, *CONSTANTS)) for leaf in leaves):
        return None
    marked = tuple(_TENSOR if isinstance(leaf, Tensor) else leaf for leaf in leaves)
    text = repr((marked, spec, [(t.dtype, t.dim()) for t in tensors]))
    name = f"{function.__module__}.{function.__qualname__}"
    # a class defined again under the same name (a notebook cell run twice) is another Function
    named = _CLASSES.setdefault(name, [])
    if function not in named:
        named.append(function)
    key = f"{name}#{named.index(function)}/{hashlib.sha1(text.encode()).hexdigest()[:16]}"
    _CALLS.setdefault(key, KeptCall(function, marked, spec))
    return key, tensors


def call_kept(key: str, tensors: list[Tensor]) -> Any:
    """The Function's outputs through the operator (what a kept call is in the exported graph)."""
    return _CALLS[key].results(torch.ops.autopart.function_call(key, tensors))


def kept_call(key: str) -> KeptCall:
    """The kept call registered under ``key``."""
    return _CALLS[key]


#: Function modes the operator's own runs of the Function enter again (:func:`modes_inside`).
_MODES: list[TorchFunctionMode] = []


@contextmanager
def modes_inside(mode: TorchFunctionMode) -> Iterator[None]:
    """While the body calls the operator, its runs of the Function (forward, and backward's second forward)
    are under ``mode`` too: a function mode is off while it handles a call, so the operations inside an
    operator escape it (``MetaAutocast``, autocast's stand-in on meta, lowers a Function's products)."""
    _MODES.append(mode)
    try:
        yield
    finally:
        _MODES.pop()


def _under(contexts: Iterable[AbstractContextManager[Any]]) -> ExitStack:
    """All of ``contexts`` entered, in order (left when the stack is)."""
    stack = ExitStack()
    for context in contexts:
        stack.enter_context(context)
    return stack


def run_whole(key: str, tensors: list[Tensor]) -> list[Tensor]:
    """The operator's forward: the Function's, under ``no_grad``, outputs that alias an input copied. A
    dispatch mode that counts operations calls it to see the Function's own (``profile/opcount.py``)."""
    call = _CALLS[key]
    args, kwargs = call.arguments(tensors)
    with torch.no_grad(), _under(list(_MODES)):
        out = apply_original(call.function, *args, **kwargs)
    leaves, spec = pytree.tree_flatten(out)
    if call.outputs is None:
        call.outputs = (spec, tuple(_TENSOR if isinstance(leaf, Tensor) else leaf for leaf in leaves))
    made: list[Tensor] = []
    storages = {_storage(t) for t in tensors}
    for leaf in leaves:
        if isinstance(leaf, Tensor):  # an operator's outputs alias neither its inputs nor each other
            storage = _storage(leaf)
            aliased = leaf._is_view() or storage in storages or any(leaf is t for t in (*tensors, *made))
            made.append(leaf.clone() if aliased else leaf)
            storages.add(_storage(made[-1]))
    return made


def _storage(t: Tensor) -> int | None:
    """The identity of ``t``'s storage (a view's is its base's; below autograd a view is not marked as one)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own
        return None


@torch.library.custom_op("autopart::function_call", mutates_args=())
def _function_call(key: str, tensors: list[Tensor]) -> list[Tensor]:
    return run_whole(key, tensors)


@_function_call.register_fake
def _(key: str, tensors: list[Tensor]) -> list[Tensor]:
    return run_whole(key, tensors)


_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_now() -> tuple[tuple[str, torch.dtype], ...]:
    return tuple(
        (device, torch.get_autocast_dtype(device)) for device in _DEVICE_TYPES if torch.is_autocast_enabled(device)
    )


def _setup(ctx: Any, inputs: tuple[str, list[Tensor]], output: Any) -> None:
    key, tensors = inputs
    ctx.key = key
    ctx.needs = tuple(t.requires_grad for t in tensors)
    ctx.autocast = _autocast_now()
    ctx.modes = tuple(_MODES)
    ctx.save_for_backward(*tensors)


def _backward(ctx: Any, grads: list[Tensor | None]) -> tuple[None, list[Tensor | None]]:
    call = _CALLS[ctx.key]
    autocasts = [torch.autocast(device, dtype) for device, dtype in ctx.autocast]
    with torch.enable_grad(), _under([*autocasts, *ctx.modes]):
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, ctx.needs, strict=True)]
        args, kwargs = call.arguments(inputs)
        out = apply_original(call.function, *args, **kwargs)
    outputs = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, Tensor)]
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    got: list[Tensor | None] = [None] * len(wanted)
    if pairs and wanted:
        got = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    given = iter(got)
    return None, [next(given) if n else None for n in ctx.needs]


_function_call.register_autograd(_backward, setup_context=_setup)
