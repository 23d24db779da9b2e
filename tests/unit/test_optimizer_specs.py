"""Optimizer specs: the grammar, the tables against torch.optim's own steps, and the user's optimizer measured.

The ground truth is a real step of a real optimizer over an MLP's parameters (sizes unequal, as in any model):
its state after three steps, and the peak of the storages its third step creates (``tests.census.PeakTracker``),
each per byte of parameters. The tables must give it for every spec a user can write; a measured spec
(``describe_optimizer``, [Note: measured optimizers]) must give it for optimizers no table lists.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError
from lightning_autopart.planner import plan_model
from lightning_autopart.profile.optimizer_probe import describe_optimizer
from lightning_autopart.profile.optimizers import (
    OptimizerSpec,
    optimizer_state_factor,
    optimizer_steps,
    optimizer_transient_factor,
    parse_optimizer,
)
from tests.census import PeakTracker

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
optim = torch.optim


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 384), nn.ReLU(), nn.Linear(384, 256), nn.Linear(256, 10))
    return list(model.parameters())


def _truth(make: Make) -> tuple[float, float]:
    """(state, transient) of ``make``'s optimizer over the MLP, per byte of parameters, stepped for real: what its
    construction and first step create and keep, and the peak of what its third step creates."""
    params = _params()
    total = sum(p.numel() * p.element_size() for p in params)
    for p in params:
        p.grad = torch.randn_like(p)
    with PeakTracker() as made:
        optimizer = make(params)
        optimizer.step()
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        gc.collect()
        with PeakTracker() as tracker:
            optimizer.step()
    return made.current / total, (tracker.peak - max(0, tracker.current)) / total


#: Specs a user writes, with the torch.optim optimizer each one names, run as a GPU runs it (foreach or fused).
TABLED: dict[str, Make] = {
    "sgd": lambda p: optim.SGD(p, lr=0.1, foreach=True),
    "sgd:decay": lambda p: optim.SGD(p, lr=0.1, weight_decay=1e-4, foreach=True),
    "sgd_momentum": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd_momentum:decay": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True),
    "sgd_momentum:fused": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adagrad": lambda p: optim.Adagrad(p, foreach=True),
    "rmsprop": lambda p: optim.RMSprop(p, foreach=True),
    "adam": lambda p: optim.Adam(p, foreach=True),
    "adam:decay": lambda p: optim.Adam(p, weight_decay=0.01, foreach=True),
    "adam:amsgrad": lambda p: optim.Adam(p, amsgrad=True, foreach=True),
    "adam:fused": lambda p: optim.Adam(p, fused=True),
    "adamw": lambda p: optim.AdamW(p, foreach=True),
    "adamw:fused,amsgrad": lambda p: optim.AdamW(p, amsgrad=True, fused=True),
}


@pytest.mark.parametrize("spec", list(TABLED))
def test_the_tables_give_what_torch_optim_keeps_and_allocates(spec: str) -> None:
    state, transient = _truth(TABLED[spec])
    assert optimizer_state_factor(spec) == pytest.approx(state, abs=1e-3)
    assert optimizer_transient_factor(spec) == pytest.approx(transient, abs=0.01)


class Lion(torch.optim.Optimizer):
    """An optimizer of the user's own, as papers publish them: one state, a sign update, a loop over tensors."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)


#: Optimizers measured on the GPU's implementation: (the optimizer as the user builds it, the same run as torch
#: runs it on a GPU, the kind its spec names).
MEASURED: dict[str, tuple[Make, Make, str]] = {
    "adamw fused, two groups": (
        lambda p: optim.AdamW([{"params": p[:2]}, {"params": p[2:], "weight_decay": 0.0}], fused=True),
        lambda p: optim.AdamW([{"params": p[:2]}, {"params": p[2:], "weight_decay": 0.0}], fused=True),
        "adamw",
    ),
    "adam amsgrad": (lambda p: optim.Adam(p, amsgrad=True), lambda p: optim.Adam(p, amsgrad=True, foreach=True), "adam"),
    "sgd decay, one group": (
        lambda p: optim.SGD([{"params": p[:2], "weight_decay": 1e-4}, {"params": p[2:]}], lr=0.1),
        lambda p: optim.SGD([{"params": p[:2], "weight_decay": 1e-4}, {"params": p[2:]}], lr=0.1, foreach=True),
        "sgd",
    ),
    "nadam": (lambda p: optim.NAdam(p), lambda p: optim.NAdam(p, foreach=True), "nadam"),
    "radam": (lambda p: optim.RAdam(p), lambda p: optim.RAdam(p, foreach=True), "radam"),
    "adadelta": (lambda p: optim.Adadelta(p), lambda p: optim.Adadelta(p, foreach=True), "adadelta"),
    "adamax": (lambda p: optim.Adamax(p), lambda p: optim.Adamax(p, foreach=True), "adamax"),
    "rmsprop centered": (
        lambda p: optim.RMSprop(p, centered=True, momentum=0.9),
        lambda p: optim.RMSprop(p, centered=True, momentum=0.9, foreach=True),
        "rmsprop",
    ),
    "lion (the user's own)": (lambda p: Lion(p), lambda p: Lion(p), "lion"),
}


@pytest.mark.parametrize("case", list(MEASURED))
def test_a_measured_spec_gives_what_the_optimizer_keeps_and_allocates(case: str) -> None:
    make, as_on_gpu, kind = MEASURED[case]
    spec = describe_optimizer(make(_params()), gpu=True)
    state, transient = _truth(as_on_gpu)
    assert spec.kind == kind and spec.state is not None and spec.transient is not None
    assert spec.state == pytest.approx(state, abs=1e-3)
    if spec.implementation != "loop":  # a loop's temporaries are a few tensors' at a time: sizes decide
        assert spec.transient == pytest.approx(transient, abs=0.01)
    assert parse_optimizer(str(spec)) == spec


def test_the_implementation_is_the_one_torch_picks_on_the_device() -> None:
    p = _params()
    assert describe_optimizer(optim.Adam(p), gpu=True).implementation == "foreach"
    assert describe_optimizer(optim.Adam(p), gpu=False).implementation == "loop"
    assert describe_optimizer(optim.Adam(p, foreach=False), gpu=True).implementation == "loop"
    assert describe_optimizer(optim.Adam(p, foreach=True), gpu=False).implementation == "foreach"
    assert describe_optimizer(optim.Adam(p, fused=True), gpu=False).implementation == "fused"
    assert describe_optimizer(Lion(p), gpu=True).implementation == "loop"


def test_an_optimizer_without_a_stand_in_is_priced_by_its_name() -> None:
    class NeedsModel(optim.SGD):
        def __init__(self, params: Any, model: nn.Module, lr: float = 0.1) -> None:
            super().__init__(params, lr=lr, momentum=0.9)

    p = _params()
    assert describe_optimizer(optim.LBFGS(p), gpu=True) == OptimizerSpec("adam", "loop")  # its step needs a closure
    assert describe_optimizer(NeedsModel(p, nn.Linear(1, 1)), gpu=True) == OptimizerSpec("adam", "foreach")


def test_the_user_s_parameters_and_random_state_are_left_alone() -> None:
    p = _params()
    before = [q.detach().clone() for q in p]
    optimizer = optim.AdamW(p)
    rng = torch.get_rng_state()
    describe_optimizer(optimizer, gpu=True)
    assert torch.equal(torch.get_rng_state(), rng) and not optimizer.state
    assert all(torch.equal(q, b) and q.grad is None for q, b in zip(p, before, strict=True))


def test_the_grammar() -> None:
    assert parse_optimizer("AdamW") == OptimizerSpec("adamw")
    assert parse_optimizer("sgd+momentum:decay") == OptimizerSpec("sgd_momentum", decay=True)
    spec = parse_optimizer("lion:loop,state=1,transient=0.25")
    assert spec == OptimizerSpec("lion", "loop", state=1.0, transient=0.25) and str(spec) == "lion:loop,state=1,transient=0.25"
    assert optimizer_steps("lion:state=1") == optimizer_steps("adam")  # stepped as Adam
    assert optimizer_steps("adamw:fused") == (1, 7, "fused")
    with pytest.raises(ConfigError, match=r"unknown optimizer 'lion'.*'lion:state="):
        parse_optimizer("lion")
    with pytest.raises(ConfigError, match="unknown option 'fast'"):
        parse_optimizer("adam:fast")
    with pytest.raises(ConfigError, match="state='x' must be a number"):
        parse_optimizer("adam:state=x")


def test_a_fused_step_leaves_its_temporary_and_most_of_its_passes_out_of_the_plan() -> None:
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    grads = sum(p.numel() * 4 for p in model.parameters())
    cluster = Cluster.from_spec("h100", devices=1)
    plans = {
        name: plan_model(model, torch.randn(8, 256), cluster, 8, spec="h100", optimizer=name, num_stages=1)
        for name in ("adamw", "adamw:fused")
    }
    foreach, fused = (plans[k].prediction for k in ("adamw", "adamw:fused"))
    # params, gradients and two states: 4 x grads; foreach AdamW's step adds a gradient-sized temporary on top,
    # a fused step nothing, so its peak is backward's (the activations and the gradients made so far); the batch
    # lives through both
    batch = 8 * 256 * 4
    assert foreach.peak_memory_bytes == 5 * grads + batch
    assert 4 * grads + batch <= fused.peak_memory_bytes < foreach.peak_memory_bytes
    assert fused.optimizer_us < 0.5 * foreach.optimizer_us
    assert plans["adamw:fused"].optimizer == "adamw:fused"
