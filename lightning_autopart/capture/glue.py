"""What a module-hooks capture cannot cut around (glue), and the messages its failures give."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["MIXED_DEVICES", "Glue", "first_line", "forward_message", "glue_message", "mixes_devices"]

#: What a forward that mixes devices is told (a clause, appended after "; "): the likely cause and the fix. Not a
#: meta limitation: on a GPU the same forward fails alike (a CPU tensor beside CUDA ones), and where a model's own
#: parameter or buffer is the CPU tensor (a legacy constructor under ``torch.device("meta")``) capture already
#: moves it (see [Note: tensors the meta device missed] in strays.py).
MIXED_DEVICES = (
    "the forward mixes tensors on two devices: a tensor it makes without a device (torch.arange(n), "
    "torch.zeros(...), torch.tensor([...])) is on the CPU whatever device the model is on, and a GPU run fails "
    "the same way; make it on the device of the tensors it meets (device=x.device, or .to(x.device))"
)


class Glue(Exception):
    """A value a block (or the model output) needs is computed outside any block, in ``owner``'s forward."""

    def __init__(
        self,
        owner: str,
        what: str,
        fix: str = "Move that computation into a submodule",
        exportable: bool = True,
    ) -> None:
        super().__init__(what)
        #: FQN of the module whose forward computes the value ("" for the root).
        self.owner = owner
        #: What is computed where, with "{owner}" standing for the owner's class name.
        self.what = what
        #: What the user can change.
        self.fix = fix
        #: Whether torch.export could capture it instead (not what it would freeze or leave out).
        self.exportable = exportable


def first_line(error: BaseException) -> str:
    """The first line of an error's message, at most 300 characters."""
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def glue_message(module: nn.Module, glue: Glue, export_error: str | None) -> str:
    """The message for glue in the root's forward, which no choice of blocks removes."""
    cls = type(module).__name__
    what = glue.what.format(owner=cls)
    if not glue.exportable:  # torch.export would freeze or leave out the same thing: no alternative to offer
        failed = f", and torch.export failed with: {export_error}" if export_error else ""
        return f"cannot capture {cls}: {what}{failed}. {glue.fix}"
    if export_error is None:
        return f"cannot capture {cls} with module hooks: {what}. {glue.fix}, or capture with method='export'"
    return (
        f"cannot capture {cls}: {what}, and torch.export failed with: {export_error}. {glue.fix}, "
        f"or remove data-dependent control flow from {cls}.forward so torch.export can trace it"
    )


def forward_message(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: BaseException,
    export_error: str | None,
) -> str:
    """The message for a forward that raised on the example inputs."""
    cls = type(module).__name__
    text = f"cannot capture {cls}: {cls}.forward(example_inputs) raised {type(error).__name__}: {first_line(error)}"
    tensors = [
        t for t in (*pytree.tree_leaves((args, kwargs)), *module.parameters()) if isinstance(t, torch.Tensor)
    ]
    if mixes_devices(error):
        text += f"; {MIXED_DEVICES}"
    elif any(t.is_meta for t in tensors):
        text += (
            ". On the meta device forward cannot run data-dependent code (such as `if x.sum() > 0`): capture "
            "with real (non-meta) example inputs (`autopart plan --profile measure`; under the strategy, build the "
            "model outside init_module(empty_init=True) and configure_model), or keep such values tensors"
        )
    else:
        text += ". Check that example_inputs match what forward expects (a Tensor, a tuple of positional "
        text += "arguments, a dict of keyword arguments, or (args, kwargs))"
    if export_error is not None and first_line(error) not in export_error:
        text += f" (torch.export failed with: {export_error})"
    return text


def mixes_devices(error: BaseException) -> bool:
    """Whether ``error`` is an operation refusing tensors on different devices (meta's words, or a real
    device's)."""
    text = str(error)
    return "is not on the expected device" in text or "Expected all tensors to be on the same device" in text
