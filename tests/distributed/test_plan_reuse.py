"""``save_plan`` then ``load_plan`` on 2 gloo processes: the load captures once per rank, profiles and plans nothing,
says what it skipped, and trains the same losses; a plan for another model is refused on every rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import TIMED_OUT, run_job

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_plan_reuse_script.py")
WORLD = 2


def _launch(out: Path, mode: str, *extra: str, timeout: float = 120.0) -> tuple[int, str]:
    code, text = run_job([str(SCRIPT), str(out), str(WORLD), mode, *extra], WORLD, "lightning", timeout)
    if code == TIMED_OUT:
        pytest.fail(f"{mode} run timed out after {timeout} s:\n{text[-4000:]}")
    return code, text


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the plan.json of a planned run and that run's results (save_rank{r}.pt)."""
    out = tmp_path_factory.mktemp("plan_reuse")
    code, log = _launch(out, "save")
    assert code == 0, f"save run failed ({code}):\n{log[-5000:]}"
    return out


def test_a_saved_plan_skips_profiling_and_planning_and_trains_the_same(saved: Path) -> None:
    tmp_path = saved
    saved_results = [torch.load(tmp_path / f"save_rank{r}.pt") for r in range(WORLD)]
    plan = json.loads((tmp_path / "plan.json").read_text())
    made = plan["notes"]["planning_s"]
    assert made > 0, "the saved plan records how long planning took"
    # Rank 0 and rank 1 ran the pipeline probe ([Note: pipeline probe]): the plan priced its actions with it.
    probe = plan["notes"]["pipeline_probe"]
    assert probe["slot_us"] > 0 and probe["message_bytes"] > 0 and probe["overhead_us"] >= 0
    assert plan["cluster"]["action_us"] == pytest.approx(probe["action_us"], abs=0.06)
    assert saved_results[0]["calls"]["profile_model"] == 1 and saved_results[0]["calls"]["partition"] >= 1

    code, log = _launch(tmp_path, "load")
    assert code == 0, f"load run failed ({code}):\n{log[-5000:]}"
    loaded = [torch.load(tmp_path / f"load_rank{r}.pt") for r in range(WORLD)]
    for rank, result in enumerate(loaded):
        # One capture per rank (at the micro-batch size, the one the stages are built from), nothing else.
        assert result["calls"] == {"capture": 1}, f"rank {rank} called {result['calls']}"
        assert json.loads(result["plan"]) == plan
        assert result["losses"] == pytest.approx(saved_results[rank]["losses"], rel=1e-6, abs=1e-7)
    line = re.search(
        r"autopart: loaded plan (\S+) \(2 stages x 1 replica, \w+\); skipped capture, profiling and planning "
        r"\(([\d.]+) s when it was made; loading and checking took ([\d.]+) s\)",
        log,
    )
    assert line is not None, f"no load line in the log:\n{log[-3000:]}"
    assert line[1] == str(tmp_path / "plan.json") and float(line[2]) == pytest.approx(made, abs=0.051)
    assert log.count("autopart: loaded plan") == 1, "only rank 0 logs"


def test_a_plan_for_another_model_is_refused_on_every_rank(saved: Path) -> None:
    code, log = _launch(saved, "load", "residual")
    assert code != 0
    message = f"load_plan {saved / 'plan.json'}: the plan has 4 blocks, this model has 5"
    # Found on rank 0's capture and sent to rank 1: both stop with it, neither waits for the other.
    assert log.count(message) >= WORLD, log[-5000:]
    assert "the plan is for another model; re-plan for this model" in log and "drop load_plan" in log
