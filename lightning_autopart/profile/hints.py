"""The fix to add to the message of a block that failed to profile: what went wrong, where, and what to change.

A profiling failure names its block and the original error; alone, that leaves the user to guess why a model
that trains under plain Lightning cannot be profiled. The common cases have a known fix:

- ``estimate`` runs every block on meta tensors, which hold no values: a forward that reads a value on the host
  (``.item()``, ``.tolist()``, ``if t > 0``, ``nonzero``) fails there, though it trains ("measure" runs it for
  real). The hint names the module and the source line of that read (from the graph node's stack trace, or the
  traceback's last frame in user code) and the two fixes: profile by measurement, or keep the value a tensor.
- ``measure`` runs a copy of the block on the device: running out of memory there means profiling by estimate.
- an operation that refuses tensors on two devices: a tensor the forward made without a device is on the CPU,
  and a GPU run fails alike; the fix is to make it on its operands' device.
- anything else: check the model trains on that batch without autopart; the traceback shows where it failed.
"""

from __future__ import annotations

import os
import re
import traceback
import warnings
from typing import Any

import torch

from lightning_autopart.capture.glue import MIXED_DEVICES, mixes_devices
from lightning_autopart.capture.graph import Block

__all__ = ["failure_hint", "warn_opaque"]

#: aten ops whose result depends on tensor values read on the host (none runs on meta tensors).
_HOST_READS = frozenset(
    {
        "item",
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "is_nonzero",
        "equal",
        "allclose",
        "repeat_interleave",
    }
)

#: Directories whose frames are never the user's code.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, os.path.dirname(__file__))
)

#: One frame of a formatted stack trace: file, line, function, and the source line under it.
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def failure_hint(block: Block, mode: str, error: BaseException) -> str:
    """A sentence (starting with "; ") to append to the message of ``block`` failing to profile in ``mode``
    with ``error``: the cause as far as it can be told, and the fix."""
    text = str(error)
    if mixes_devices(error):
        return f"; {MIXED_DEVICES}"
    if mode == "estimate" and (
        "meta" in text.lower() or "data-dependent" in text or isinstance(error, NotImplementedError)
    ):
        module, source = _culprit(block, error)
        where = f"module {module}" if module else f"block {block.name!r}"
        at = f" at {source}" if source else ""
        return (
            f"; the estimate runs each block on meta tensors, which hold no values, and {where} reads a tensor's "
            f"value on the host (.item(), .tolist(), float(t), `if t > 0`, nonzero){at}: profile by measurement "
            "instead (AutoPartitionStrategy(profile='measure'), `autopart plan --profile measure`), or keep that "
            "value a tensor (e.g. `x / x.abs().amax()` rather than `x / x.abs().max().item()`)"
        )
    if "out of memory" in text.lower():
        return (
            "; the block does not fit in the device's free memory to be timed: profile by estimate instead "
            "(AutoPartitionStrategy(profile='estimate'), `autopart plan --profile estimate`), which allocates "
            "nothing, or free memory on the device"
        )
    return (
        f"; the block's forward or backward raised on a copy of the model ({mode} mode): check that the model "
        "trains on this batch without autopart; the traceback shows where it failed"
    )


def _culprit(block: Block, error: BaseException) -> tuple[str | None, str | None]:
    """The module (``'net.1' (Norm)``) and source line (``model.py:12 in forward: `...```) of the operation
    that failed, as far as they can be found; None for what cannot."""
    graph = getattr(block.program, "graph", None)
    if isinstance(graph, torch.fx.Graph):
        nodes = {n.name: n for n in graph.nodes}
        node = nodes.get(_failing_node(error) or "")
        if node is None:  # the failing line was not found: the first host read is the likely one
            node = next((n for n in graph.nodes if n.op == "call_function" and _op(n.target) in _HOST_READS), None)
        if node is not None:
            return _module_of(node.meta.get("nn_module_stack")), _last_frame(str(node.meta.get("stack_trace", "")))
    return None, _user_frame(error)


def _op(target: Any) -> str:
    """The aten name of a graph node's target ("item" for ``aten.item.default``)."""
    parts = str(target).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def _failing_node(error: BaseException) -> str | None:
    """The node that a generated fx forward was running when ``error`` was raised: the name its line assigns."""
    for frame in reversed(_frames(error)):
        if frame.filename.startswith("<eval_with_key>"):
            found = re.match(r"\s*(\w+)\s*=", frame.line or "")
            return found.group(1) if found else None
    return None


def _module_of(stack: Any) -> str | None:
    """The innermost module of a node's ``nn_module_stack``, as ``'net.1' (Norm)``."""
    if not isinstance(stack, dict) or not stack:
        return None
    entry = list(stack.values())[-1]
    if not (isinstance(entry, tuple) and len(entry) == 2):
        return None
    fqn, cls = entry
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return f"{fqn!r} ({name})" if fqn else name


def _last_frame(stack_trace: str) -> str | None:
    """The last frame of a formatted stack trace, as ``file:line in function: `source```."""
    frames = _FRAME.findall(stack_trace)
    if not frames:
        return None
    path, line, function, source = frames[-1]
    return f"{_short(path)}:{line} in {function}: `{source.strip()}`"


def _user_frame(error: BaseException) -> str | None:
    """The last frame of ``error``'s traceback (and its causes') in neither torch nor lightning_autopart."""
    for frame in reversed(_frames(error)):
        path = os.path.abspath(frame.filename)
        if not frame.filename.startswith("<") and not path.startswith(_LIBRARY_DIRS):
            return f"{_short(path)}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"
    return None


def _frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``error``'s traceback, innermost last, after those of the errors it came from."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    frames: list[traceback.FrameSummary] = []
    for item in reversed(chain):
        frames.extend(traceback.extract_tb(item.__traceback__))
    return frames


def _short(path: str) -> str:
    """``path`` relative to the current directory when it lies inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def warn_opaque(ops: list[str]) -> None:
    """Say which custom ops estimate mode priced with no FLOP formula (their math is invisible to the counter):
    their time is only the bytes they move, so a plan may price them low; measure mode times them."""
    named = ", ".join(ops[:5]) + (f" and {len(ops) - 5} more" if len(ops) > 5 else "")
    warnings.warn(
        f"estimate mode priced {named} (custom ops with no FLOP formula, whose math autopart cannot see) "
        "by the bytes they move alone, so the plan's times may be low; plan with profile='measure' on "
        "the target device to time them",
        UserWarning,
        stacklevel=3,
    )
