"""What the gradient hooks log, merged over the stages of a pipeline ([Note: gradient hooks]): pure merging of
records as every rank of the pipeline holds them after the gather."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.grad_logs import GradientLogs, gathered_logs, merge_stage_logs
from lightning_autopart.lightning.hooks import LogRecord
from lightning_autopart.lightning.log_channel import packed

HOOK = "on_before_optimizer_step"


def _logs() -> GradientLogs:
    return GradientLogs(None, None, 0, ["0", "1"], torch.device("cpu"), 0)


def _values(records: list[LogRecord]) -> dict[str, float]:
    return {r.name: float(r.value) for r in records}


def _stage_norms(model: nn.Module, stages: list[list[str]], norm_type: float) -> list[list[LogRecord]]:
    """What ``grad_norm`` logs on each stage: the stage's own parameters' gradients, the others None."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    out = []
    for names in stages:
        for n, p in model.named_parameters():
            p.grad = grads[n] if n in names else None
        out.append([LogRecord(k, v, {}) for k, v in grad_norm(model, norm_type).items()])
    for n, p in model.named_parameters():
        p.grad = grads[n]
    return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_grad_norm_over_the_stages_is_the_whole_models(norm_type: float) -> None:
    """Lightning's documented idiom: every parameter's norm reaches every rank, and the total is recomputed over
    all of them (a tied parameter, held by two stages, counted once), equal to one process's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
    model(torch.randn(5, 4)).square().sum().backward()
    whole = {k: float(v) for k, v in grad_norm(model, norm_type).items()}
    names = [n for n, _ in model.named_parameters()]
    gathered = _stage_norms(model, [names[:3], names[2:]], norm_type)  # "0.bias"... 2.weight on both: tied
    merged = merge_stage_logs(HOOK, gathered, ["0", "1"], {}, {})
    got = _values(merged)
    assert got.keys() == whole.keys()
    for k, v in whole.items():
        assert math.isclose(got[k], v, rel_tol=1e-6), k
    alone = _values(gathered[0])[f"grad_{norm_type}_norm_total"]
    assert alone < whole[f"grad_{norm_type}_norm_total"] or norm_type == math.inf  # what rank 0 logged before


def test_a_value_that_differs_between_stages_is_logged_per_stage_with_a_warning() -> None:
    agreed: dict[tuple[str, str], bool] = {}
    gathered = [
        [LogRecord("grad_max", torch.tensor(0.2), {"prog_bar": True}), LogRecord("lr", 0.1, {})],
        [LogRecord("grad_max", torch.tensor(0.5), {"prog_bar": True}), LogRecord("lr", 0.1, {})],
    ]
    with pytest.warns(RuntimeWarning, match=r"'grad_max'.*stage 0: 0.2, stage 1: 0.5.*grad_norm") as caught:
        merged = merge_stage_logs("on_after_backward", gathered, ["0", "1"], agreed, {}, warn=True)
    assert len(caught) == 1
    assert _values(merged) == pytest.approx({"grad_max/stage_0": 0.2, "grad_max/stage_1": 0.5, "lr": 0.1})
    assert merged[0].kwargs == {"prog_bar": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per name
        again = merge_stage_logs("on_after_backward", gathered, ["0", "1"], agreed, {}, warn=True)
    assert [r.name for r in again] == ["grad_max/stage_0", "grad_max/stage_1", "lr"]
    # a number that agreed until now is checked every call: from the step it differs, it goes per stage
    gathered[1][1] = LogRecord("lr", 0.2, {})
    with pytest.warns(RuntimeWarning, match="'lr'"):
        merged = merge_stage_logs("on_after_backward", gathered, ["0", "1"], agreed, {}, warn=True)
    assert {"lr/stage_0", "lr/stage_1"} <= set(_values(merged))


def test_tensors_that_stop_agreeing_log_nan_until_the_check_moves_them_per_stage() -> None:
    """Agreement is read once; afterwards a disagreement costs no read: the value is NaN, never one stage's,
    and the next check (a logging step) logs the name per stage."""
    logs = _logs()
    same = [[LogRecord("scale", torch.tensor(2.0), {})] for _ in range(2)]
    assert _values(logs.merge(HOOK, same)) == {"scale": 2.0}
    apart = [[LogRecord("scale", torch.tensor(2.0), {})], [LogRecord("scale", torch.tensor(4.0), {})]]
    (nan,) = logs.merge(HOOK, apart)
    assert nan.name == "scale" and math.isnan(float(nan.value))
    assert _values(logs.merge(HOOK, same)) == {"scale": 2.0}  # not checked yet
    with pytest.warns(RuntimeWarning, match="agreed at first, then differed"):
        merged = logs.merge(HOOK, same, check=True)
    assert _values(merged) == {"scale/stage_0": 2.0, "scale/stage_1": 2.0}


def test_a_name_one_stage_logs_keeps_its_value_and_options() -> None:
    record = LogRecord("grad_2.0_norm/head.weight", torch.tensor([3.0]), {"on_epoch": True})
    merged = merge_stage_logs(HOOK, [[], [record]], ["0_2", "1_3"], {}, {})
    assert merged == [record]


def test_metrics_in_gradient_hooks_are_refused_with_the_fix() -> None:
    note = LogRecord("acc", None, {}, "acc", ())
    with pytest.raises(ConfigError, match=r"metric.compute\(\)"):
        merge_stage_logs(HOOK, [[note], []], ["0", "1"], {}, {})


def test_one_stage_or_no_trainer_runs_the_hook_as_it_is() -> None:
    class Module:
        _trainer = None

        def __init__(self) -> None:
            self.logged: list[str] = []

        def log(self, name: str, value: object) -> None:
            self.logged.append(name)

    module = Module()
    for logs in (None, _logs()):
        with gathered_logs(logs, module, HOOK):
            module.log("x", 1.0)
    assert module.logged == ["x", "x"]
    assert not _logs().active(HOOK, True)  # no group: nothing to gather


def test_packing_keeps_int64_counts_exact_beside_floats() -> None:
    """Logged values travel as one float64 tensor: scalars of one dtype in one kernel, mixed dtypes converted one
    by one (never promoted through float32, which would round a count past 2**24)."""
    count, mean, column = torch.tensor(2**40 + 1), torch.tensor(0.5), torch.arange(3.0).reshape(3, 1)
    flat = packed([count, mean, column], torch.device("cpu"))
    assert flat.dtype == torch.float64 and flat.tolist() == [2**40 + 1, 0.5, 0.0, 1.0, 2.0]
    same = packed([torch.tensor(1.5), torch.tensor(-2.0)], torch.device("cpu"))
    assert same.tolist() == [1.5, -2.0]
