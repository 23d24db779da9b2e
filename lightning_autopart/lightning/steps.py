"""A LightningModule's training, validation and test steps run through this rank's share of the pipeline.

The first stage runs the user's step only up to its first model call, to take the model's inputs; the last
stage runs the whole step once per micro-batch, on that micro-batch's slice of the batch, with the model's
forward returning the pipeline's output (rebuilt in the model's own output structure), so the user's loss
code, ``self.log`` calls and metrics run unchanged there. The last stage's loss and logs then reach every rank
of the pipeline (see [Note: log channel]) and are logged there again. Nothing here reads a device value back
to the host: losses and logged tensors stay tensors until Lightning itself reads them. A smaller batch (the
last of an epoch) is padded to the planned shape, its micro-batches weighted by their real samples (see
[Note: ragged batches] in :mod:`lightning_autopart.lightning.ragged`).

[Note: a step's other outputs] A ``training_step`` may return a dict with more than its loss (predictions, a
count), which Lightning hands to ``on_train_batch_end`` hooks. They were dropped (the hooks saw only the loss,
silently). Each micro-batch's are now merged as an evaluation step's are: tensors with a batch dimension
concatenated, numbers averaged, or summed, or their largest or smallest kept where the planner's runs of the
step found them so (``output_combines``, as for logged values). They reach every rank of the pipeline with
the logged values, through the log channel ([Note: log channel]): records marked :data:`OUTPUT`, not logged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_autopart.capture.modes import branch_mode, mixed_modes
from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.finite import LossCheck
from lightning_autopart.lightning.hooks import (
    REDUCE,
    LogRecord,
    batch_range,
    batch_size_of,
    capture_logs,
    find_forward,
    flat_inputs,
    merge_logs,
    replaced_forward,
    sample_range,
    slice_batch,
)
from lightning_autopart.lightning.input_checks import check_input_shapes
from lightning_autopart.lightning.log_channel import LogChannel
from lightning_autopart.lightning.ragged import (
    coupled_message,
    coupled_modules,
    pad_batch,
    real_rows,
    trim_output,
    zero_loss,
)
from lightning_autopart.runtime.runner import PipelineRunner

__all__ = ["OUTPUT", "PipelinedSteps"]

#: The option that marks a record as an entry ``training_step`` returned beside its loss: it travels with the
#: logged values, and is not logged ([Note: a step's other outputs]).
OUTPUT = "autopart_output"


class PipelinedSteps:
    """Runs ``module``'s steps over ``runner``, the submodule ``root_name`` ("" for the module) being pipelined.

    ``module`` is a LightningModule (any object with the step methods and ``log``); nothing here imports
    Lightning. ``constant_inputs`` are the non-tensor arguments the model was captured with (see
    ``CapturedModel.constant_inputs``): a step calling the model with other values is refused, as is one whose
    tensors differ past the batch dimension from ``input_shapes``, those the model was captured with.
    """

    def __init__(
        self,
        module: Any,
        root_name: str,
        runner: PipelineRunner,
        channel: LogChannel,
        device: torch.device,
        constant_inputs: tuple[tuple[int, Any], ...] = (),
        input_shapes: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        self.module = module
        self.root_name = root_name
        self.runner = runner
        self.channel = channel
        self.device = device
        self.constant_inputs = constant_inputs
        self.input_shapes = input_shapes  # the captured model inputs' shapes (None: not checked)
        #: Applied to each micro-batch's loss before its backward (a gradient scaler's ``scale``), or None.
        self.scale: Callable[[Tensor], Tensor] | None = None
        #: The model's floating outputs without a batch dimension (see ``ragged.batchless_outputs``).
        self.batchless: list[str] = []
        #: Modules whose forward runs other operations in evaluation mode, where the stages cannot follow it
        #: (``CapturedModel.eval_branches`` unless ``CapturedModel.evaluates``): evaluation steps are refused.
        self.eval_branches: tuple[str, ...] = ()
        #: The modules, by name, whose mode picks the stages' program where they follow both modes.
        self.branch_modules: list[tuple[str, nn.Module]] = []
        #: Finds a NaN or infinite training loss without a host sync per step (see [Note: non-finite loss]).
        plan = runner.plan
        self.losses = LossCheck(plan.num_stages - 1, channel.src, plan.world_size, runner.placement.rank)
        #: How logged values that are not means combine over micro-batches, by name ([Note: logged values over
        #: micro-batches] in profile/step_checks.py).
        self.combine: dict[str, str] = dict(plan.notes.get("log_combines") or {})
        #: How the numbers ``training_step`` returns beside its loss combine ([Note: a step's other outputs]).
        self.output_combine: dict[str, str] = dict(plan.notes.get("output_combines") or {})

    def root(self) -> nn.Module:
        """The pipelined module."""
        root: nn.Module = self.module.get_submodule(self.root_name) if self.root_name else self.module
        return root

    def train(self, batch: Any, batch_idx: int, accumulate: int, sync: bool) -> Tensor | dict[str, Any]:
        """One training step; gradients add to ``.grad`` (all-reduced if ``sync``); returns the batch's loss,
        or, where ``training_step`` returns a dict, the loss and its other entries merged over the micro-batches
        ([Note: a step's other outputs]).

        A batch smaller than the plan's is padded, its micro-batches weighted by their real samples (see
        [Note: ragged batches])."""
        self.check_mode("training_step")
        size = self.check_batch(batch)
        self.channel.expect("training_step")
        records: list[LogRecord] = []
        samples: list[int] = []  # the real samples of the micro-batch that made each record
        others: list[dict[str, Any]] = []  # what each micro-batch's step returned beside its loss
        weights: list[int] = []
        module = self.module
        local, count = self.runner.local_batch_size, self.runner.plan.micro_batches
        summed = self.runner.plan.notes.get("loss_reduction") == "sum"

        def loss_fn(output: Any, index: Tensor) -> Tensor:
            lo, hi = sample_range(index)
            rows = real_rows(lo, hi, size)
            if rows == 0:
                return zero_loss(output)
            if rows < hi - lo:
                output = trim_output(output, hi - lo, rows)
            before = len(records)
            with replaced_forward(self.root(), output), capture_logs(module, records):
                out = module.training_step(slice_batch(batch, lo, lo + rows, size), batch_idx)
            samples.extend([rows] * (len(records) - before))
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if isinstance(out, Mapping):
                others.append({k: _detached(v) for k, v in out.items() if k != "loss"})
                weights.append(rows)
            if not isinstance(loss, Tensor):
                raise ConfigError(
                    "training_step must return the loss (a tensor, or a dict with 'loss') under autopart"
                )
            if summed:  # a sum over samples: the micro-batches' sums add up ([Note: a loss that grows])
                loss = loss * count
            elif size < local:  # the runner divides by the micro-batches: weight by real samples
                loss = loss * (rows * count / size)
            return loss / accumulate

        padded = self.padded(batch, size)
        inputs = self.inputs(lambda: module.training_step(padded, batch_idx))
        target = batch_range(local) if self.runner.is_last else None
        self.runner.loss_fn = loss_fn
        try:
            loss = self.runner.step(inputs, target, sync=sync, scale=self.scale)
        finally:
            self.runner.loss_fn = None  # the closure holds the batch: it must not outlive the step
        merged = merge_outputs(others, weights, self.output_combine) if others else {}
        records = merge_logs(records, samples, self.combine)
        records += [LogRecord(k, v, {OUTPUT: True}) for k, v in merged.items()]  # sent along, not logged
        value, logs = self.replay("training_step", None if loss is None else loss * accumulate, records)
        self.losses.observe(value, getattr(module, "_trainer", None), batch_idx, scaled=self.scale is not None)
        outputs = {r.name: r.value for r in logs if r.kwargs.get(OUTPUT)}
        return {"loss": value, **outputs} if outputs else value

    def evaluate(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline; the user's ``hook`` runs on the last stage once per micro-batch, on its slice of
        the batch, its logs merged as in training and replayed on every rank. Returns the step's outputs merged
        (see :func:`merge_outputs`). A smaller batch is padded, and the step runs on its real samples only."""
        step = getattr(self.module, hook)
        self.check_mode(hook)
        batch = args[0] if args else kwargs["batch"]
        size = self.check_batch(batch)
        self.channel.expect(hook)
        records: list[LogRecord] = []
        samples: list[int] = []
        outputs: list[Any] = []
        weights: list[int] = []

        def each(output: Any, index: Tensor) -> None:
            lo, hi = sample_range(index)
            rows = real_rows(lo, hi, size)
            if rows == 0:
                return
            if rows < hi - lo:
                output = trim_output(output, hi - lo, rows)
            part = slice_batch(batch, lo, lo + rows, size)
            sliced = (part, *args[1:]) if args else args
            options = {**kwargs, "batch": part} if not args else kwargs
            before = len(records)
            with replaced_forward(self.root(), output), capture_logs(self.module, records):
                outputs.append(step(*sliced, **options))
            samples.extend([rows] * (len(records) - before))
            weights.append(rows)

        padded = self.padded(batch, size)
        full_args = (padded, *args[1:]) if args else args
        full_kwargs = {**kwargs, "batch": padded} if not args else kwargs
        inputs = self.inputs(lambda: step(*full_args, **full_kwargs))
        target = batch_range(self.runner.local_batch_size) if self.runner.is_last else None
        self.runner.eval_step(inputs, target, each)
        self.replay(hook, None, merge_logs(records, samples, self.combine))
        return merge_outputs(outputs, weights) if self.runner.is_last else None

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``predict_step`` through the forward-only pipeline; its merged outputs reach every rank of the
        pipeline (sent once per batch: predicting is not a hot loop), on this rank's device."""
        outputs = self.evaluate("predict_step", *args, **kwargs)
        ranks = self.runner.placement.pp_ranks
        if len(ranks) == 1:
            return outputs
        last = ranks[(self.runner.plan.num_stages - 1) % len(ranks)]
        box = [tree_map(_to_cpu, outputs) if self.runner.is_last else None]
        dist.broadcast_object_list(box, src=last, group=self.runner.pp_group)
        return outputs if self.runner.is_last else tree_map(lambda t: _to_device(t, self.device), box[0])

    def check_mode(self, hook: str) -> None:
        """Refuse an evaluation step of a model whose forward branches on ``self.training`` in Python: the
        stages follow training mode (see [Note: Python branches on the mode] in capture/modes.py), and any
        step while the modules that pick the stages' program are in mixed modes. Every rank raises alike,
        before any message is sent."""
        if self.branch_modules and branch_mode(self.branch_modules) is None:
            raise ConfigError(f"cannot run {hook} through the pipeline: {mixed_modes(self.branch_modules)}")
        if not self.eval_branches or self.root().training:
            return
        shown = ", ".join(repr(b) for b in self.eval_branches[:3])
        more = f" and {len(self.eval_branches) - 3} more" if len(self.eval_branches) > 3 else ""
        raise ConfigError(
            f"cannot run {hook} through the pipeline: in evaluation mode the forward of {shown}{more} runs "
            "other operations than in training (a Python branch on self.training, such as a drop-path), "
            "and the captured stages follow training mode, so its outputs would be wrong. Fix: make both "
            "modes run the same operations (a drop-path rate of 0, e.g. drop_path_rate=0.0 in a Hugging "
            "Face config, or write the branch with an operation that takes the mode, F.dropout(x, p, "
            "self.training)), or "
            "evaluate without autopart (Trainer(limit_val_batches=0) here, and a plain Trainer on the "
            "checkpoint, saved with AutoPartitionStrategy(checkpoint='full'))"
        )

    def check_batch(self, batch: Any) -> int:
        """The batch's size: at most the plan's per-replica batch (pipelined shapes are fixed); a smaller one
        is padded (see [Note: ragged batches]), unless the model normalises over the batch."""
        size = batch_size_of(batch)
        local, plan = self.runner.local_batch_size, self.runner.plan
        if size > local:
            raise ConfigError(
                f"a batch of {size} samples reached the pipeline, but the plan needs {local} per replica "
                f"(global batch {plan.batch_size} over {plan.replicas} replicas): pipelined shapes are "
                f"fixed, so give every loader batch_size={local} (a smaller last batch is padded)"
            )
        if size < local:
            coupled = coupled_modules(self.root())
            if coupled:
                raise ConfigError(
                    f"a batch of {size} samples reached the pipeline, planned for {local} per replica; "
                    + coupled_message(coupled, "use drop_last=True, or batches of the planned size")
                )
        return size

    def padded(self, batch: Any, size: int) -> Any:
        """On the first stage, ``batch`` padded to the plan's per-replica batch (itself when full); elsewhere
        ``batch`` (only the first stage feeds the model)."""
        local = self.runner.local_batch_size
        return pad_batch(batch, size, local) if size < local and self.runner.is_first else batch

    def inputs(self, step: Callable[[], Any]) -> tuple[Any, ...] | None:
        """On the first stage, the tensors the user's step gives the model (the step is stopped there)."""
        if not self.runner.is_first:
            return None
        call = find_forward(self.module, step, only=self.root_name)
        leaves, tensors = flat_inputs(self.root(), call)
        for position, captured in self.constant_inputs:
            given = leaves[position] if position < len(leaves) else None
            if type(given) is not type(captured) or given != captured:
                raise ConfigError(
                    f"the step calls {self.root_name or 'the model'} with {given!r} where it was captured with "
                    f"{captured!r} (argument {position} of the flattened call); autopart bakes arguments that are "
                    "not tensors into the pipeline, so pass the same value in every step"
                )
        if self.input_shapes is not None:
            check_input_shapes(tensors, self.input_shapes, self.root_name or type(self.module).__name__)
        return tensors

    def replay(
        self, kind: str, loss: Tensor | None, records: list[LogRecord]
    ) -> tuple[Tensor, list[LogRecord]]:
        """Send the last stage's loss and logs along the pipeline; log them again on every rank."""
        value, logs = self.channel.share(kind, loss, records, self.module)
        for record in logs:
            if not record.kwargs.get(OUTPUT):
                self.module.log(record.name, record.value, **record.kwargs)
        return value, logs


def merge_outputs(outputs: list[Any], samples: list[int] | None = None, combine: dict[str, str] | None = None) -> Any:
    """A step's per-micro-batch returns as one: tensors with a batch dimension concatenated, scalar tensors
    averaged (weighted by ``samples``, each micro-batch's real samples, where they differ) or, for a dict's keys
    in ``combine``, summed or their largest or smallest kept, anything else taken from the last micro-batch."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[-1][1]
    if any(s != spec for _, s in flat):
        return outputs[-1]
    hows = _leaf_combines(outputs[-1], combine or {})
    weights = None
    if samples is not None and len(set(samples)) > 1:
        weights = [c / sum(samples) for c in samples]
    merged = []
    for how, parts in zip(hows, zip(*(leaves for leaves, _ in flat), strict=True), strict=True):
        first = parts[0]
        if how is not None:
            merged.append(_combined(parts, how))
        elif isinstance(first, Tensor) and first.dim() > 0:
            merged.append(torch.cat(parts))
        elif isinstance(first, Tensor) and first.is_floating_point():
            if weights is None:
                merged.append(torch.stack(parts).mean())
            else:
                merged.append(torch.stack([p * w for p, w in zip(parts, weights, strict=True)]).sum())
        else:
            merged.append(parts[-1])
    return tree_unflatten(merged, spec)


def _leaf_combines(output: Any, combine: dict[str, str]) -> list[str | None]:
    """For each leaf of ``output`` (in ``tree_flatten``'s order), how it combines: its top-level key's entry
    in ``combine``, or None (concatenated or averaged)."""
    if not isinstance(output, Mapping):
        return [None] * len(tree_flatten(output)[0])
    return [combine.get(k) for k, v in output.items() for _ in tree_flatten(v)[0]]


def _combined(parts: tuple[Any, ...], how: str) -> Any:
    """Numbers or tensors summed over the micro-batches, or their largest or smallest elementwise (``how``: a key
    of ``REDUCE``)."""
    reduced = REDUCE[how](torch.stack([torch.as_tensor(p) for p in parts]))
    return reduced if isinstance(parts[0], Tensor) else reduced.item()


def _detached(value: Any) -> Any:
    """``value`` with its tensors detached: a step's other outputs hold no graph (as Lightning's do not)."""
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, Tensor) else value
