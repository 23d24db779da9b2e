"""A model built on the meta device with a few tensors elsewhere is captured and profiled as wholly on meta.

[Note: tensors the meta device missed] ``with torch.device("meta")`` (and Lightning's
``init_module(empty_init=True)``) sets the device of the factory functions (``torch.empty``, ``torch.zeros``,
the parameters ``nn.Linear`` makes), not of the legacy type constructors: ``torch.Tensor(n)``,
``torch.FloatTensor(n, m)`` and ``torch.LongTensor(...)`` always make a CPU tensor. Hugging Face's XLNet
(``nn.Parameter(torch.FloatTensor(d_model, n_head, d_head))``: its attention's ``q``, ``k``, ``v``, ``o``,
``r``, biases and ``seg_embed``, and ``mask_emb``) and ImageGPT (its layer norm's
``nn.Parameter(torch.Tensor(hidden_size))``) built on meta so hold real CPU parameters beside meta ones, and
planning them from meta failed where the forward mixed the two ("Tensor on device meta is not on the expected
device cpu!"). Built under ``torch.device("cuda")`` those parameters land on the CPU as well, and the forward
fails alike; but a GPU run moves the whole model to its device first (``model.to(device)``, Lightning's
``model_to_device``), where they join the rest. So a model with a parameter or buffer on meta is captured and
profiled as if all of them were: for the duration, each other parameter and buffer is swapped in place (the
same Python object, which the model, the captured programs and optimizers hold) for an empty meta tensor of
its shape and dtype, and swapped back afterwards, its values untouched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.utils import swap_tensors

__all__ = ["strays_on_meta", "swap_in_place"]


@contextmanager
def strays_on_meta(module: nn.Module) -> Iterator[int]:
    """Inside, ``module``'s parameters and buffers off the meta device are on it, where any other one is
    (see [Note: tensors the meta device missed]); yields how many were moved (0: none, or none on meta)."""
    tensors = list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())
    if not any(t.is_meta for t in tensors):
        yield 0
        return
    held: list[tuple[Tensor, Tensor]] = []
    try:
        for t in tensors:
            if t.is_meta:
                continue
            stand_in = torch.empty_like(t, device="meta")
            if isinstance(t, nn.Parameter):
                stand_in = nn.Parameter(stand_in, requires_grad=t.requires_grad)
            try:
                swap_in_place(t, stand_in)
            except (RuntimeError, AssertionError):
                continue  # held by an autograd graph, or of another kind than its stand-in: left where it is
            held.append((t, stand_in))
        yield len(held)
    finally:
        for t, stand_in in reversed(held):
            swap_in_place(t, stand_in)  # the stand-in now holds t's own storage: swapped back


def swap_in_place(t: Tensor, new: Tensor) -> None:
    """Swap the contents of ``t`` and ``new`` (``torch.utils.swap_tensors``): every holder of ``t`` sees what
    ``new`` held, and ``new`` what ``t`` held."""
    if not weakref.getweakrefs(t):
        swap_tensors(t, new)
        return
    # The only weak references are the fake-tensor memos of the capture's torch.export runs, which nothing
    # reads again (a new export makes a new fake mode): swap as swap_tensors does, without its weakref guard.
    assert type(new) is type(t), (type(new), type(t))
    t.__dict__, new.__dict__ = new.__dict__, t.__dict__
    torch._C._swap_tensor_impl(t, new)
