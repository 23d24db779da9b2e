"""Models bigger than one device: built on ``meta`` (``init_module(empty_init=True)``, ``configure_model``, or by
the user), each of 4 gloo ranks materialises only its stage, with the weights and the training of a plain run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import ROOT, run_job

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_meta_init_script.py")
HOWS = ("init_module", "configure_model", "meta")
WORLD = 4


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The plain run's report, and each way of building's reports by rank."""
    out = tmp_path_factory.mktemp("meta")
    plain = subprocess.run(
        [sys.executable, str(SCRIPT), "plain", str(out), "1"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    code, log = run_job([str(SCRIPT), ",".join(HOWS), str(out), str(WORLD)], WORLD, how="torchrun", timeout=600)
    assert code == 0, log[-6000:]
    load = lambda name: torch.load(out / f"{name}.pt", weights_only=False)  # noqa: E731
    return out, {"plain": load("plain0"), **{h: [load(f"{h}{r}") for r in range(WORLD)] for h in HOWS}}


@pytest.mark.parametrize("how", HOWS)
def test_each_rank_holds_only_its_stage(reports: tuple[Path, dict[str, Any]], how: str) -> None:
    _, got = reports
    whole = sum(t.nbytes for t in got["plain"]["final"].values())
    for rank, report in enumerate(got[how]):
        assert report["num_stages"] >= 3, "the 3 MB budget must force several stages"
        assert report["held_bytes"] == report["stage_param_bytes"] > 0, rank
        done = report["materialized"]
        assert done.kept_bytes == report["held_bytes"]
        # At most its stage plus one other module at a time, never the whole model.
        assert done.peak_bytes <= report["held_bytes"] + 256 * 257 * 4 < whole / 2, (rank, done, whole)


@pytest.mark.parametrize("how", HOWS)
def test_weights_and_training_equal_a_plain_run(reports: tuple[Path, dict[str, Any]], how: str) -> None:
    out, got = reports
    plain = got["plain"]
    seen: set[str] = set()
    for report in got[how]:
        for name, tensor in report["initial"].items():  # each rank's share of the initial weights
            torch.testing.assert_close(tensor, plain["initial"][name], rtol=0, atol=0, msg=name)
            seen.add(name)
        torch.testing.assert_close(report["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
    assert seen == set(plain["initial"]), "every parameter is held by some rank"
    final = torch.load(out / f"{how}.ckpt", weights_only=False)["state_dict"]
    for name, tensor in plain["final"].items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
