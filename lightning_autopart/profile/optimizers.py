"""What an optimizer costs a step: its state, the temporaries of its step, and the passes over memory it makes.

[Note: optimizer specs] The planner knows an optimizer by a short spec, ``kind[:option,...]``, written in plan
files and taken by ``autopart plan --optimizer``:

- ``kind``: ``sgd``, ``sgd_momentum``, ``adagrad``, ``rmsprop``, ``adam`` or ``adamw`` (their state and step are
  tabled below), or any other name when the options give ``state=`` (then it is stepped as Adam is);
- the implementation: ``foreach`` (torch's default on a GPU: a few multi-tensor kernels, each making whole
  temporaries), ``fused`` (one kernel, no temporaries; ``torch.optim.AdamW(..., fused=True)``) or ``loop`` (one
  parameter at a time: torch's default on the CPU and ``foreach=False``); none given: ``foreach``;
- ``amsgrad`` (Adam's third state), ``decay`` (weight decay added to the gradients: a gradient-sized temporary in
  the foreach step of every kind but AdamW, which decays the parameters in place);
- ``state=x`` and ``transient=y``: the state and the step's temporaries in bytes per parameter byte, measured
  (the strategy measures the user's own optimizer, :func:`~lightning_autopart.profile.optimizer_probe
  .describe_optimizer`); they override the tables.

The tables are torch.optim's own, measured on torch 2.13 and 2.11 by ``tests/unit/test_optimizer_specs.py``:
foreach Adam keeps the square root of its second moment (one parameter-sized temporary), foreach Adagrad two,
RMSprop one; a fused step allocates nothing. The loop implementation is priced as foreach: it keeps one or two
parameters' temporaries at a time, at most as much.

This module imports nothing from torch (the planner and the CLI use it).
"""

from __future__ import annotations

from typing import NamedTuple

from lightning_autopart.errors import ConfigError

__all__ = [
    "KINDS",
    "OptimizerSpec",
    "optimizer_state_factor",
    "optimizer_steps",
    "optimizer_transient_factor",
    "parse_optimizer",
]

#: Optimizer state kept per parameter, in multiples of the parameter's own bytes.
_STATE: dict[str, float] = {
    "sgd": 0.0,
    "sgd_momentum": 1.0,
    "adagrad": 1.0,
    "rmsprop": 1.0,
    "adam": 2.0,
    "adamw": 2.0,
}

#: The kinds the tables know.
KINDS = tuple(_STATE)

#: Temporaries of the foreach step, per byte of parameters: without weight decay, and with it.
_TRANSIENT: dict[str, tuple[float, float]] = {
    "sgd": (0.0, 1.0),
    "sgd_momentum": (0.0, 1.0),
    "adagrad": (2.0, 2.0),
    "rmsprop": (1.0, 1.0),
    "adam": (1.0, 1.0),
    "adamw": (1.0, 1.0),
}

#: Per kind: (kernels per parameter group, parameter-sized memory passes) of the foreach step, and the passes of
#: the fused one (see [Note: optimizer step] in step.py).
_STEPS: dict[str, tuple[int, int, int]] = {
    "sgd": (1, 3, 3),
    "sgd_momentum": (3, 8, 5),
    "adagrad": (4, 9, 5),
    "rmsprop": (4, 10, 5),
    "adam": (8, 19, 7),
    "adamw": (9, 21, 7),
}

_ALIASES = {"sgd_m": "sgd_momentum", "momentum": "sgd_momentum", "sgdm": "sgd_momentum"}
_IMPLEMENTATIONS = ("foreach", "fused", "loop")
_FLAGS = ("amsgrad", "decay")


class OptimizerSpec(NamedTuple):
    """A parsed optimizer spec (see [Note: optimizer specs])."""

    kind: str
    implementation: str = "foreach"
    amsgrad: bool = False
    decay: bool = False
    #: Measured state per parameter byte; None: from the table.
    state: float | None = None
    #: Measured step temporaries per parameter byte; None: from the table.
    transient: float | None = None

    def __str__(self) -> str:
        options = [] if self.implementation == "foreach" else [self.implementation]
        options += [flag for flag in _FLAGS if getattr(self, flag)]
        options += [f"{name}={value:g}" for name in ("state", "transient") if (value := getattr(self, name)) is not None]
        return self.kind + (":" + ",".join(options) if options else "")


def parse_optimizer(optimizer: str) -> OptimizerSpec:
    """The spec ``optimizer`` ("adamw", "adamw:fused", "adam:amsgrad", "lion:state=1,transient=1") parsed.

    Raises:
        ConfigError: an unknown kind without ``state=``, an unknown option, or a bad number.
    """
    head, _, tail = optimizer.strip().partition(":")
    kind = head.lower().replace("-", "_").replace("+", "_")
    kind = _ALIASES.get(kind, kind)
    fields: dict[str, object] = {}
    for option in filter(None, (o.strip() for o in tail.split(","))):
        name, eq, value = option.partition("=")
        if eq and name in ("state", "transient"):
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            if not number >= 0:
                raise ConfigError(f"optimizer {optimizer!r}: {name}={value!r} must be a number >= 0")
            fields[name] = number
        elif not eq and option in _IMPLEMENTATIONS:
            fields["implementation"] = option
        elif not eq and option in _FLAGS:
            fields[option] = True
        else:
            raise ConfigError(
                f"optimizer {optimizer!r}: unknown option {option!r}; use {', '.join(_IMPLEMENTATIONS + _FLAGS)}, "
                "state=<bytes per parameter byte> or transient=<bytes per parameter byte>"
            )
    if kind not in _STATE and "state" not in fields:
        known = ", ".join(sorted(_STATE))
        raise ConfigError(
            f"unknown optimizer {optimizer!r}; use one of: {known}, or give its state as "
            f"'{kind}:state=<bytes per parameter byte>,transient=<bytes per parameter byte>'"
        )
    return OptimizerSpec(kind, **fields)  # type: ignore[arg-type]


def optimizer_state_factor(optimizer: str) -> float:
    """Bytes of optimizer state per byte of parameter for an optimizer spec ("sgd", "adam:amsgrad", ...)."""
    spec = parse_optimizer(optimizer)
    if spec.state is not None:
        return spec.state
    return _STATE[spec.kind] + (1.0 if spec.amsgrad and spec.kind in ("adam", "adamw") else 0.0)


def optimizer_transient_factor(optimizer: str) -> float:
    """Bytes the optimizer step allocates for its duration, per byte of trainable parameters (foreach Adam keeps
    one parameter-sized temporary, the square root of its second moment; a fused step none)."""
    spec = parse_optimizer(optimizer)
    if spec.transient is not None:
        return spec.transient
    if spec.implementation == "fused":
        return 0.0
    plain, decayed = _TRANSIENT.get(spec.kind, _TRANSIENT["adam"])
    return decayed if spec.decay and spec.kind != "adamw" else plain


def optimizer_steps(optimizer: str) -> tuple[int, int, str]:
    """(kernels per parameter group, parameter-sized memory passes, implementation) of an optimizer's step; a
    kind without a table is stepped as Adam."""
    spec = parse_optimizer(optimizer)
    kernels, passes, fused = _STEPS.get(spec.kind, _STEPS["adam"])
    if spec.implementation == "fused":
        return 1, fused, "fused"
    return kernels, passes, spec.implementation
