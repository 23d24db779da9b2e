"""The user's own optimizer, measured: its state and its step's temporaries per parameter byte, as a spec.

[Note: measured optimizers] The tables of :mod:`.optimizers` know torch.optim's six common optimizers by name,
and a name says nothing of ``amsgrad`` (a third state), ``fused=True`` (no temporaries), weight decay folded
into the gradients (one more temporary in SGD's foreach step) or the state of an optimizer they do not list
(NAdam, Adadelta, Rprop, a Lion of the user's own). So the strategy measures the optimizer it was given: a
stand-in of the same class, with the same hyperparameters per group, over small CPU tensors of the parameters'
dtype whose sizes follow the groups' shares of the parameters, steps twice. Its state after the steps and the
peak of the storages its second step creates (:class:`~.transient.AllocationMeter`), each over the stand-ins'
bytes, become ``state=`` and ``transient=`` of the spec. The implementation is the one torch picks on the
training device: foreach on a GPU unless ``fused`` or ``foreach=False`` is set, a loop on the CPU; the stand-in
runs it (a fused kernel the CPU lacks: its state is measured foreach, its step allocates nothing). An optimizer
whose stand-in cannot be built or stepped (a constructor with other arguments, CUDA-only kernels, a closure
LBFGS needs) is priced by its name's table, unknown names as Adam.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_autopart.profile.optimizers import KINDS, OptimizerSpec
from lightning_autopart.profile.transient import AllocationMeter

__all__ = ["describe_optimizer"]

#: Elements of all stand-in parameters together (split over the groups by their share).
_ELEMENTS = 1 << 15
#: Stand-in tensors per group: a loop keeps a few tensors' temporaries at a time, a share of the group's bytes.
_TENSORS = 8


def describe_optimizer(optimizer: torch.optim.Optimizer, gpu: bool) -> OptimizerSpec:
    """The spec of ``optimizer`` as it steps on a GPU (``gpu``) or the CPU, measured where a stand-in runs
    ([Note: measured optimizers])."""
    groups = optimizer.param_groups
    kind = type(optimizer).__name__.lower()
    if kind == "sgd" and any(g.get("momentum", 0) for g in groups):
        kind = "sgd_momentum"
    implementation = _implementation(groups, gpu)
    amsgrad = any(bool(g.get("amsgrad", False)) for g in groups)
    decay = any(bool(g.get("weight_decay", 0)) for g in groups)
    try:
        state, transient = _measure(optimizer, implementation)
    except Exception:  # any failure of a stand-in falls back to the tables
        return OptimizerSpec(kind if kind in KINDS else "adam", implementation, amsgrad, decay)
    return OptimizerSpec(kind, implementation, amsgrad, decay, round(state, 3), round(transient, 3))


def _implementation(groups: list[dict[str, Any]], gpu: bool) -> str:
    """"fused", "foreach" or "loop": what torch runs for these groups on the training device (an optimizer
    without a ``foreach`` option is taken to loop over its tensors in Python)."""
    if any(g.get("fused") for g in groups):
        return "fused"
    if not all("foreach" in g for g in groups):
        return "loop"
    chosen = {g["foreach"] for g in groups}
    if chosen == {False}:
        return "loop"
    return "foreach" if gpu or True in chosen else "loop"

def _measure(optimizer: torch.optim.Optimizer, implementation: str) -> tuple[float, float]:
    """(state, transient) bytes per parameter byte of a stand-in of ``optimizer`` run as ``implementation``."""
    groups = optimizer.param_groups
    trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
    dtypes = [p.dtype for ps in trainable for p in ps if p.is_floating_point()]
    dtype = dtypes[0] if dtypes else torch.float32
    counts = [sum(p.numel() for p in ps) for ps in trainable]
    total = sum(counts) or 1
    gen = torch.Generator().manual_seed(0)
    stand_ins, settings = [], []
    for group, count in zip(groups, counts, strict=True):
        size = max(2, _ELEMENTS * count // total // _TENSORS)
        params = [torch.nn.Parameter(torch.randn(size, generator=gen).to(dtype)) for _ in range(_TENSORS)]
        stand_ins += params
        options = {k: v for k, v in group.items() if k != "params"}
        for flag, value in (("foreach", implementation == "foreach"), ("fused", implementation == "fused")):
            if flag in options:
                options[flag] = value or (None if flag == "fused" else False)
        if "capturable" in options:
            options["capturable"] = False
        settings.append({**options, "params": params})
    param_bytes = sum(p.numel() * p.element_size() for p in stand_ins)
    fused = implementation == "fused"
    with torch.random.fork_rng(devices=[]):
        try:
            state, transient = _step_twice(type(optimizer), settings, stand_ins, gen)
        except Exception:
            if not fused:
                raise
            for options in settings:  # the CPU lacks this fused kernel: state from foreach, no temporaries
                options.update({k: v for k, v in (("fused", None), ("foreach", True)) if k in options})
            state, transient = _step_twice(type(optimizer), settings, stand_ins, gen)
            transient = 0
    return state / param_bytes, (0 if fused else transient) / param_bytes


def _step_twice(
    cls: type[torch.optim.Optimizer], settings: list[dict[str, Any]], params: list[torch.nn.Parameter], gen: Any
) -> tuple[int, int]:
    """Bytes of the stand-in's state after two steps, and of the temporaries of its second step."""
    for p in params:
        p.grad = None
    stand_in = cls(settings)  # type: ignore[call-arg]  # torch.optim's classes take their groups alone
    meter = AllocationMeter()
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        if step:
            with meter, torch.no_grad():
                stand_in.step()
        else:
            stand_in.step()
    state = sum(
        t.numel() * t.element_size()
        for entry in stand_in.state.values()
        for t in entry.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    )
    return state, max(0, meter.peak - max(0, meter.current))

