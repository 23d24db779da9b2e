"""Capture by module hooks: one eager forward, each block's inputs and outputs tracked by tensor identity."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_autopart.capture.assemble import RawBlock, assemble
from lightning_autopart.capture.attributes import MODE_FIX, AttributeWatch, state_fix
from lightning_autopart.capture.backward_hooks import has_backward_hooks, watch_tensor_hooks
from lightning_autopart.capture.glue import Glue, forward_message, glue_message
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.capture.host_random import HostRandom, record_seeding
from lightning_autopart.capture.meta_layouts import meta_layouts
from lightning_autopart.capture.modes import evaluating
from lightning_autopart.capture.outputs import flatten_output
from lightning_autopart.capture.tree import ancestors, block_modules, collapse, keep_whole, param_weight
from lightning_autopart.errors import CaptureError

__all__: list[str] = []


class ModuleProgram(nn.Module):
    """A block module called as in the captured forward: tensors in, the block's used outputs out as a tuple."""

    def __init__(
        self,
        module: nn.Module,
        spec: pytree.TreeSpec,
        leaves: list[Any],
        slots: list[int | None],
        picks: list[int],
    ) -> None:
        super().__init__()
        self.module = module
        self._spec = spec
        self._leaves = leaves  # constant leaves; None where ``slots`` names a program argument
        self._slots = slots
        self._picks = picks  # positions of the returned tensors among the module's output leaves

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Call the module with ``tensors`` in their places; return the outputs later blocks use."""
        leaves = [
            leaf if slot is None else tensors[slot]
            for leaf, slot in zip(self._leaves, self._slots, strict=True)
        ]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out = pytree.tree_leaves(self.module(*args, **kwargs))
        return tuple(out[j] for j in self._picks)


@dataclass
class _Call:
    """One block module call seen in the forward."""

    fqn: str
    spec: pytree.TreeSpec
    leaves: list[Any]
    slots: list[int | None]
    inputs: list[str]
    args: list[torch.Tensor]
    extra: set[str] = field(default_factory=set)  # root params/buffers passed in, modules called inside
    outputs: list[tuple[int, str]] = field(default_factory=list)  # (leaf position, value name)
    ops: int = 0


class _Tracker(TorchDispatchMode):
    """Hooks' state for one forward; as a dispatch mode it also counts the operations of each block."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.values: dict[int, tuple[str, torch.Tensor, int]] = {}  # id -> (name, tensor, version)
        self.examples: dict[str, torch.Tensor] = {}  # name -> tensor, for every value ever produced
        self.attrs: dict[int, str] = {
            id(t): n for n, t in (*module.named_parameters(), *module.named_buffers())
        }
        self.stack: list[tuple[str, str]] = []  # (fqn, "block" | "ancestor" | "inside")
        self.calls: list[_Call] = []
        self.active: _Call | None = None
        self.host = HostRandom(module)
        self.rng = self.host.state()  # the host's random streams where the last block ended
        self.python = AttributeWatch(module)  # the modules' Python attributes where the last block ended

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active is not None:
            self.active.ops += 1
        return func(*args, **(kwargs or {}))

    def owner(self) -> str:
        """The innermost ancestor whose forward is running (its code is what calls the next module)."""
        return next((f for f, kind in reversed(self.stack) if kind == "ancestor"), "")

    def lookup(self, t: torch.Tensor, owner: str, what: str) -> str | None:
        """Name of a tracked value; None for a parameter or buffer; Glue if computed outside any block."""
        entry = self.values.get(id(t))
        if entry is not None and entry[1] is t:
            if t._version != entry[2]:
                raise Glue(owner, f"{what} is modified in place in {{owner}}.forward outside any submodule")
            return entry[0]
        if id(t) in self.attrs:
            return None
        raise Glue(owner, f"{what} is computed in {{owner}}.forward outside any submodule")

    def check_host(self, owner: str) -> None:
        """Glue if ``owner``'s forward drew host random numbers or changed a module's Python attribute since
        the last block ended: the path it took at capture is frozen into the stages (see [Note: host random
        numbers] and [Note: Python state in the forward])."""
        reseeds = self.host.reseeded(self.rng)
        if reseeds:
            raise Glue(
                owner,
                f"torch's random generator is reseeded ({reseeds}) in {{owner}}.forward outside any "
                "submodule",
                "Reseed inside a submodule",
                exportable=False,
            )
        streams = self.host.drawn(self.rng)
        if streams:
            raise Glue(
                owner,
                f"random numbers are drawn with {streams} in {{owner}}.forward outside any submodule",
                "Draw them with torch (torch.rand), or inside a submodule",
                exportable=False,
            )
        changes = self.python.changes()
        if changes:
            raise Glue(
                owner,
                f"{{owner}}.forward changes the Python attribute{'s' if len(changes) > 1 else ''} "
                f"{', '.join(changes[:3])} outside any submodule",
                "Keep that state in a submodule's forward or in a buffer"
                if state_fix(changes) != MODE_FIX
                else "Set that mode in an override of train(), or in a submodule's forward",
                exportable=False,
            )

    def check_tensor_hook(self) -> None:
        """Glue if a hook is registered on a tensor outside any block: the stages would not register it (see
        [Note: backward hooks])."""
        if self.active is None:
            raise Glue(
                self.owner(),
                "a hook is registered on a tensor (Tensor.register_hook) in {owner}.forward outside any "
                "submodule",
                "Register it inside a submodule",
                exportable=False,
            )

    def mark_host(self) -> None:
        """The host state a block leaves: its own draws and assignments run again at every call."""
        self.rng = self.host.state()
        self.python.rebase()

    def produce(self, t: torch.Tensor, name: str) -> None:
        self.values[id(t)] = (name, t, t._version)
        self.examples[name] = t

    def pre_block(self, fqn: str, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.active is not None:
            self.active.extra.add(fqn)
            self.stack.append((fqn, "inside"))
            return
        self.check_host(self.owner())
        if any(c.fqn == fqn for c in self.calls):
            raise Glue(
                self.owner(),
                f"block '{fqn}' is called more than once in {{owner}}.forward",
                "Call each submodule once (wrap the repeated calls in one submodule)",
            )
        leaves, spec = pytree.tree_flatten((args, kwargs))
        call = _Call(fqn, spec, [], [], [], [])
        for i, leaf in enumerate(leaves):
            name = None
            if isinstance(leaf, torch.Tensor):
                name = self.lookup(leaf, self.owner(), f"input {i} of block '{fqn}'")
                if name is None:
                    call.extra.add(self.attrs[id(leaf)])
            if name is None:
                call.leaves.append(leaf)
                call.slots.append(None)
                continue
            if name not in call.inputs:
                call.inputs.append(name)
                call.args.append(leaf)
            call.leaves.append(None)
            call.slots.append(call.inputs.index(name))
        self.calls.append(call)
        self.stack.append((fqn, "block"))
        self.active = call

    def post_block(self, fqn: str, _: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.stack.pop()[1] != "block":
            return
        call, k = self.calls[-1], len(self.calls) - 1
        self.active = None
        self.mark_host()
        for t in call.args:  # the block may have changed its inputs in place
            if self.values[id(t)][1] is t:
                self.values[id(t)] = (*self.values[id(t)][:2], t._version)
        seen: set[int] = set()
        for j, leaf in enumerate(pytree.tree_leaves(output)):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
                seen.add(id(leaf))
                call.outputs.append((j, f"block{k}.out{j}"))
                self.produce(leaf, f"block{k}.out{j}")

    def pre_ancestor(self, fqn: str, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.active is not None:
            self.active.extra.add(fqn)
            self.stack.append((fqn, "inside"))
            return
        self.check_host(self.owner())
        for i, leaf in enumerate(pytree.tree_leaves((args, kwargs))):
            if isinstance(leaf, torch.Tensor):
                self.lookup(leaf, self.owner(), f"input {i} of '{fqn}'")
        self.stack.append((fqn, "ancestor"))

    def post_ancestor(self, fqn: str, _: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.stack.pop()[1] != "ancestor":
            return
        self.check_host(fqn)
        for j, leaf in enumerate(pytree.tree_leaves(output)):
            if isinstance(leaf, torch.Tensor):
                self.lookup(leaf, fqn, f"output {j} of '{fqn}'")


def capture_modules(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_blocks: int,
    export_error: str | None,
    whole: Sequence[str] = (),
    check_eval: bool = False,
) -> CapturedModel:
    """Capture with hooks on the block modules; coarsen a block whose parent's forward holds glue, and retry.
    ``whole``: modules that must stay one block each (their forwards register tensor hooks). With
    ``check_eval``, the forward runs again in evaluation mode: the glue between blocks is frozen too, so
    blocks called otherwise there are a branch on the mode ([Note: Python branches on the mode])."""
    cls = type(module).__name__
    weight = param_weight(module)
    modules = dict(module.named_modules(remove_duplicate=False))
    fqns = block_modules(
        module, max_blocks, weight if weight("") > 0 else lambda f: len(list(modules[f].modules()))
    )
    notes: list[str] = []
    if export_error is not None:
        notes.append(
            f"torch.export cannot trace {cls} ({export_error}), so it was captured with module hooks, which cut "
            "only between submodules: remove data-dependent control flow from the forward for finer blocks"
        )
    if "" in whole:
        raise CaptureError(
            f"cannot capture {cls}: {cls}.forward registers hooks on tensors (Tensor.register_hook) outside "
            "any submodule, and a pipeline runs only its submodules; register them inside a submodule"
        )
    fqns = keep_whole(fqns, whole)
    for _ in range(len(modules)):  # each retry turns one more module above the blocks into a block
        try:
            captured = _capture_once(module, args, kwargs, fqns)
            branches = _eval_glue(module, args, kwargs, fqns, captured) if check_eval else ()
            if branches:
                notes.append(
                    f"in evaluation mode {cls}'s forward calls its blocks otherwise (a Python branch on "
                    "self.training between them): pipelined validation, test and predict steps are refused"
                )
            return dataclasses.replace(captured, notes=tuple(notes), eval_branches=branches)
        except Glue as glue:
            if glue.owner == "":
                raise CaptureError(glue_message(module, glue, export_error)) from None
            owner = type(modules[glue.owner]).__name__
            notes.append(
                f"'{glue.owner}' is one block: {glue.what.format(owner=owner)} ({glue.fix.lower()} to cut inside it)"
            )
            fqns = collapse(fqns, glue.owner)
        except Exception as error:
            raise CaptureError(forward_message(module, args, kwargs, error, export_error)) from error
    raise CaptureError(f"cannot capture {cls} with module hooks: no choice of blocks covers its forward")


def _eval_glue(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], fqns: list[str], captured: CapturedModel
) -> tuple[str, ...]:
    """``(module's class,)`` if its forward, run in evaluation mode, calls the blocks ``fqns`` with other
    inputs, in another order or to other outputs than ``captured`` records; ``()`` if alike."""
    try:
        with evaluating(module):
            other: CapturedModel | None = _capture_once(module, args, kwargs, fqns)
    except Exception:  # its glue draws, changes state or computes in evaluation mode only: another path
        other = None

    def wiring(c: CapturedModel) -> list[Any]:
        return [(b.modules, b.inputs, b.outputs) for b in c.blocks] + [c.cuts[-1]]

    if other is not None and wiring(other) == wiring(captured):
        return ()
    return (type(module).__name__,)


def _capture_once(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], fqns: list[str]
) -> CapturedModel:
    """One forward with hooks on the blocks ``fqns`` and on the modules above them."""
    tracker = _Tracker(module)
    modules = dict(module.named_modules(remove_duplicate=False))
    leaves = pytree.tree_leaves((args, kwargs))
    inputs = [(f"input{i}", leaf) for i, leaf in enumerate(leaves)]
    for name, leaf in reversed(inputs):  # reversed: the first name wins for a tensor passed twice
        if isinstance(leaf, torch.Tensor):
            tracker.produce(leaf, name)
    above = {a for f in fqns for a in ancestors(f)}
    for fqn in sorted(above):  # a block module's own backward hooks run: the stages call it
        if has_backward_hooks(modules[fqn]):
            raise Glue(
                fqn,
                "{owner} has backward hooks, which run only when it is called as one module",
                "Register them on its submodules",
                exportable=False,
            )
    handles = []
    for fqn, pre, post in [(f, tracker.pre_block, tracker.post_block) for f in fqns] + [
        (a, tracker.pre_ancestor, tracker.post_ancestor) for a in sorted(above)
    ]:
        handles.append(modules[fqn].register_forward_pre_hook(_bind(pre, fqn), with_kwargs=True))
        handles.append(modules[fqn].register_forward_hook(_bind(post, fqn), with_kwargs=True))
    try:
        with (
            torch.no_grad(),
            meta_layouts([*leaves, *module.parameters()]),  # before the tracker (channels-last on meta)
            tracker,
            watch_tensor_hooks(tracker.check_tensor_hook, no_grad_run=True),
            record_seeding(),
        ):
            output = module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    tracker.check_host("")
    out_tensors, output_spec = flatten_output(output)
    out_names = [tracker.lookup(t, "", f"model output {j}") or "" for j, t in enumerate(out_tensors)]
    if "" in out_names:
        raise Glue(
            "", "a model output is a parameter or buffer, returned by {owner}.forward outside any submodule"
        )
    used = set(out_names) | {name for call in tracker.calls for name in call.inputs}
    params = {id(p): n for n, p in module.named_parameters()}
    buffers = {id(b): n for n, b in module.named_buffers()}
    raw = []
    for call in tracker.calls:
        outputs = [(j, name) for j, name in call.outputs if name in used]
        owned = [call.fqn, *sorted(call.extra)]
        tensors = {
            id(t): t for f in owned if f in modules for t in (*modules[f].parameters(), *modules[f].buffers())
        }
        tensors |= {
            id(t): t for n, t in (*module.named_parameters(), *module.named_buffers()) if n in call.extra
        }
        program = ModuleProgram(
            modules[call.fqn], call.spec, call.leaves, call.slots, [j for j, _ in outputs]
        )
        raw.append(
            RawBlock(
                name=call.fqn or type(module).__name__,
                modules=(call.fqn,),
                params=tuple(params[i] for i in tensors if i in params),
                buffers=tuple(buffers[i] for i in tensors if i in buffers),
                program=program,
                args=tuple(call.args),
                inputs=tuple(call.inputs),
                outputs=tuple(name for _, name in outputs),
                op_count=call.ops,
            )
        )
    values = {name: tracker.examples[name] for block in raw for name in block.outputs}
    return assemble(module, "modules", raw, inputs, values, out_names, output=output_spec)


def _bind(hook: Callable[..., None], fqn: str) -> Callable[..., None]:
    """``hook`` with the module FQN as its first argument."""
    return lambda *rest: hook(fqn, *rest)
