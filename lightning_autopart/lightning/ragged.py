"""Ragged batches: a batch smaller than the plan's (the last one of an epoch with ``drop_last=False``).

[Note: ragged batches] Pipelined shapes are fixed when the stages are captured, so a batch of ``size``
samples, fewer than the plan's ``local`` per replica, is padded up to ``local`` by repeating its own samples
(:func:`pad_batch`: ids, masks and labels stay valid, nothing becomes NaN) and sent through the pipeline as a
full one. Micro-batch ``i`` (``m`` samples) then holds ``r_i`` real samples (:func:`real_rows`), the rest
padding. On the last stage the user's step runs only on the real samples of the original batch, with the
model's output cut to them (:func:`trim_output`), and the runner divides every micro-batch's loss by the
micro-batch count ``n``, so the step weights micro-batch ``i``'s loss by ``r_i * n / size``: the total is the
mean over the batch's ``size`` real samples, as one process computes it. A micro-batch without real samples
runs no step and logs nothing; its loss is a zero that still reaches every output (:func:`zero_loss`), so
every parameter gets its (zero) gradient for each micro-batch, as the gradient buckets and pipelining's
backward expect. Logged values are weighted by the real samples of their micro-batch (``merge_logs``), and
Lightning weights the step in epoch means by the trainer's batch, the real one, as in one process.

Padding is exact only for a model that treats samples independently. A batch-norm layer normalising by the
batch's own statistics (training mode, or no running statistics) would see the padded copies: such a model is
refused a ragged batch with the fix (:func:`coupled_modules`, :func:`coupled_message`). An output with no
batch dimension (a loss computed inside the model) mixes a micro-batch's samples too: it is refused only for a
micro-batch that is part real, part padding (a micro-batch of real samples only is exact).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from lightning_autopart.capture.graph import TensorInfo
from lightning_autopart.errors import ConfigError

__all__ = [
    "batchless_outputs",
    "check_even_batches",
    "coupled_message",
    "coupled_modules",
    "pad_batch",
    "real_rows",
    "trim_output",
    "zero_loss",
]


def pad_batch(batch: Any, size: int, local: int) -> Any:
    """``batch`` with every tensor whose dim 0 is ``size`` grown to ``local`` rows by repeating its samples
    in order (rows ``0..size-1``, then ``0..`` again); other values unchanged."""
    index: dict[torch.device, Tensor] = {}

    def pad(x: Any) -> Any:
        if not (isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == size):
            return x
        if x.device not in index:
            index[x.device] = torch.arange(local, device=x.device) % size
        return x.index_select(0, index[x.device])

    return tree_map(pad, batch)


def real_rows(lo: int, hi: int, size: int) -> int:
    """How many of a micro-batch's rows ``lo:hi`` of the padded batch are real samples (of ``size``)."""
    return max(0, min(hi, size) - lo)


def trim_output(output: Any, micro: int, rows: int) -> Any:
    """The model's output for a micro-batch of ``micro`` samples cut to its first ``rows`` (its real ones):
    every tensor whose dim 0 is ``micro`` sliced, the structure kept (tuple, dict, ``ModelOutput``...).

    Raises ConfigError when a floating-point output has no batch dimension (a loss computed inside the
    model): the padded samples are mixed into it and cannot be cut out.
    """
    batchless = [
        f"output {keystr(path)}" if path else "output"
        for path, leaf in tree_flatten_with_path(output)[0]
        if isinstance(leaf, Tensor)
        and leaf.is_floating_point()
        and (leaf.dim() == 0 or leaf.shape[0] != micro)
    ]
    if batchless:
        raise ConfigError(
            f"a ragged batch left a micro-batch with {rows} real samples of {micro}, padded to the planned "
            f"shape, but the model's {', '.join(batchless)} has no batch dimension (a loss computed inside "
            "the model), so the padded samples would change it: compute the loss in the step from per-sample "
            f"outputs, use drop_last=True, or make the last batch per replica a multiple of {micro} samples"
        )
    return tree_map(
        lambda t: t[:rows] if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == micro else t, output
    )


def zero_loss(output: Any) -> Tensor:
    """A loss of 0 for a micro-batch with no real samples whose backward still reaches every output tensor
    that needs a gradient (with zeros), so every parameter accumulates a gradient as for any micro-batch."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]
    leaves = [t for t in tensors if t.requires_grad]
    if not leaves:
        return torch.zeros((), device=tensors[0].device if tensors else None)
    # One element of each: 0 * (a finite value) even where a whole output's sum would overflow in float16.
    return torch.stack([t.reshape(-1)[:1].sum().float() for t in leaves]).sum() * 0.0


def batchless_outputs(outputs: Sequence[TensorInfo], micro: int) -> list[str]:
    """Names of the model's floating outputs, as captured at ``micro`` samples, that have no batch dimension (a
    loss computed inside the model): a micro-batch part real, part padding cannot be cut out of them."""
    return [
        t.name for t in outputs if t.dtype.startswith(("float", "bfloat")) and (not t.shape or t.shape[0] != micro)
    ]


def coupled_modules(module: nn.Module, evaluation: bool = False) -> list[str]:
    """Names of the batch-norm layers of ``module`` that normalise by the batch's own statistics, which
    padding would change: those in training mode, and those without running statistics (in any mode).

    ``evaluation`` judges the layers as an evaluation loop runs them (in eval mode), whatever their mode now.
    """
    names = []
    for name, m in module.named_modules():
        if not isinstance(m, _BatchNorm):
            continue
        batch_stats = m.running_mean is None and m.running_var is None
        if batch_stats or (m.training and not evaluation):
            names.append(name or type(m).__name__)
    return names


def coupled_message(names: list[str], fix: str) -> str:
    """The end of a refusal of a ragged batch for a model with ``names`` (see :func:`coupled_modules`)."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"autopart pads a smaller batch to the planned shape, but {shown} of the pipelined model "
        "normalise(s) over the batch (BatchNorm on the batch's own statistics), so the padded samples would "
        f"change the result: {fix}"
    )


def check_even_batches(trainer: Any, hook: str, replicas: int) -> None:
    """Refuse, before any work, loaders whose last batch per replica would be smaller than the others when
    the pipelined model normalises over the batch in that loop (BatchNorm training, or without running
    statistics): a smaller batch is padded to the planned shape (see [Note: ragged batches]), which would
    change its statistics, and the ragged batch would otherwise fail only at the end of an epoch. Other
    loaders may be ragged."""
    val = trainer.fit_loop.epoch_loop.val_loop
    sources = {
        "training_step": [("train", trainer.fit_loop), ("val", val)],
        "validation_step": [("val", trainer.validate_loop)],
        "test_step": [("test", trainer.test_loop)],
        "predict_step": [("predict", trainer.predict_loop)],
    }[hook]
    steps = getattr(getattr(trainer, "strategy", None), "_steps", None)  # the partition made in setup
    module = steps.root() if steps is not None else getattr(trainer, "lightning_module", None)
    if module is None:
        return
    batchless: list[str] = list(getattr(steps, "batchless", []))
    micro = steps.runner.plan.micro_batch_size if steps is not None else 0
    for name, loop in sources:
        coupled = coupled_modules(module, evaluation=name != "train")
        if not (coupled or batchless) or not loop._data_source.is_defined():
            continue
        loaders = loop._data_source.dataloader()
        if isinstance(loaders, Mapping):
            loaders = list(loaders.values())
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            _check_even(name, loader, replicas, coupled, batchless, micro)


def _check_even(
    name: str, loader: Any, replicas: int, coupled: list[str], batchless: list[str], micro: int
) -> None:
    batch, dataset = getattr(loader, "batch_size", None), getattr(loader, "dataset", None)
    if not batch or getattr(loader, "drop_last", True) or not isinstance(dataset, Sized):
        return
    per_replica = -(-len(dataset) // replicas)  # Lightning's DistributedSampler pads to equal shards
    last = per_replica % batch
    if not last or not (coupled or (batchless and micro and last % micro)):
        return
    fix = f"pass drop_last=True, or make the dataset length a multiple of {batch * replicas}"
    why = (
        coupled_message(coupled, fix)
        if coupled
        else f"autopart pads it to the planned shape, but the model's outputs {', '.join(batchless)} have no "
        f"batch dimension (a loss computed inside the model), so a micro-batch of {last % micro} real samples "
        f"and {micro - last % micro} padded ones would change them: compute the loss in the step from "
        f"per-sample outputs (logits), or {fix}"
    )
    raise ConfigError(
        f"the {name} loader's last batch per replica holds {last} samples, not {batch} "
        f"({len(dataset)} samples over {replicas} replica(s), batch_size={batch}); " + why
    )
