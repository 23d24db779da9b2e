"""Lightning's model summary of a split model: every parameter counted, and FLOPs from a run on meta tensors.

[Note: model summary] Lightning's ``ModelSummary`` callback (on by default) counts the LightningModule's
parameters and, with an ``example_input_array``, runs the model on it to count FLOPs and record layer shapes. On
a rank of a pipeline the other stages' tensors are ``meta`` tensors (shapes kept, see
:func:`~lightning_autopart.runtime.checkpoint.free_elsewhere`), so the count is the whole model's, but the
model cannot run: the strategy hides the example (the summary then prints "Total FLOPs: 0", a wrong number).
:func:`summarize_whole_model` gives the callbacks a summary that runs the whole model's forward on ``meta``
copies of the example and of every parameter and buffer (``torch.func.functional_call``: the model itself is
untouched), which counts the FLOPs one process would, at no compute and no memory. A forward that cannot run on
meta tensors (it reads a value with ``.item()``) leaves the FLOPs uncounted, and says so.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelSummary as SummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["WholeModelSummary", "summarize_whole_model"]


class WholeModelSummary(ModelSummary):
    """Lightning's summary of ``model``, its example run on ``meta`` copies (see [Note: model summary])."""

    def __init__(self, model: Any, max_depth: int, example: Any) -> None:
        self._example = example
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> Any:
        with self._example_shown():  # Lightning runs the example only when the module has one
            return super().summarize()

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        with self._example_shown():  # and shows the layers' input and output sizes only then
            return super()._get_summary_data()

    @contextlib.contextmanager
    def _example_shown(self) -> Iterator[None]:
        """The module's ``example_input_array`` is the example while Lightning looks (the strategy hides it)."""
        model = self._model
        hidden = model.example_input_array
        model.example_input_array = self._example
        try:
            yield
        finally:
            model.example_input_array = hidden

    def _forward_example_input(self) -> None:
        model = self._model
        meta = functools.partial(tree_map, lambda t: t.to("meta") if isinstance(t, Tensor) else t)
        inputs = meta(self._example)
        state = {n: t.to("meta") for n, t in (*model.named_parameters(), *model.named_buffers())}
        modes = {m: m.training for m in model.modules()}
        trainer = model._trainer
        context = trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()
        # Lightning counts FLOPs from 2.6 on; before, its summary has no counter and shows sizes only.
        counter = getattr(self, "_flop_counter", None)
        model.eval()
        try:
            with torch.no_grad(), context, counter if counter is not None else contextlib.nullcontext():
                if isinstance(inputs, (list, tuple)):
                    torch.func.functional_call(model, state, tuple(inputs))
                elif isinstance(inputs, dict):
                    torch.func.functional_call(model, state, (), inputs)
                else:
                    torch.func.functional_call(model, state, (inputs,))
        except Exception as error:  # user code that needs real values: the counts stay as far as they got
            if counter is not None:
                counter.flop_counts.clear()
            rank_zero_info(
                f"autopart: the model summary counts no FLOPs and no layer sizes: {type(model).__name__}'s forward does not run on "
                f"meta tensors ({type(error).__name__}: {str(error)[:120]})"
            )
        finally:
            for module, training in modes.items():
                module.training = training


def summarize_whole_model(trainer: Any, example: Any) -> None:
    """Make the Trainer's model summary callbacks (``ModelSummary``, ``RichModelSummary``) summarise the whole
    split model with :class:`WholeModelSummary` on ``example`` (the module's hidden ``example_input_array``;
    None: no run, as Lightning does without one)."""
    for callback in trainer.callbacks:
        if isinstance(callback, SummaryCallback):
            # An instance attribute over the callback's own method: this Trainer's summaries only.
            callback._summary = functools.partial(_whole_summary, callback, example)  # type: ignore[method-assign]


def _whole_summary(callback: SummaryCallback, example: Any, trainer: Any, pl_module: Any) -> ModelSummary:
    return WholeModelSummary(pl_module, callback._max_depth, example)
