"""bench/fidelity.py end to end on the CPU: one tiny case trained, profiled in both modes, planned and tabulated."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import fidelity

CASE = "net5000x24-b512-sgd-32"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_case_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fidelity.json"
    argv = ["--tiny", "--accelerator", "cpu", "--cases", CASE, "--steps", "3", "--warmup", "1"]
    rows = fidelity.main([*argv, "--modes", *fidelity.CHOICES, "--json", str(out), "--autopart"])
    table = capsys.readouterr().out

    assert [r["case"] for r in rows] == [CASE]
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 2 and "estimate time ratio" in lines[0] and "measure peak ratio" in lines[0]
    assert lines[1].startswith(f"| {CASE} |")
    assert "worst case: estimate time" in table and "measure time" in table and "torch" in table
    row = rows[0]
    assert len(row["measured"]["steps_s"]) == 3 and row["measured"]["step_ms"] > 0
    assert row["measured"]["peak_bytes"] is None  # not measured on the CPU
    for mode in fidelity.MODES:
        p = row[mode]
        assert math.isfinite(p["time_ratio"]) and p["time_ratio"] > 0
        assert p["step_ms"] > 0 and p["peak_bytes"] > 0 and p["fits"]
        assert p["loss_error"] is None
    assert row["estimate"]["on_meta"] and not row["measure"]["on_meta"]
    assert row["measure-serial"]["step_ms"] > 0 and "measure-serial time ratio" in lines[0]
    assert row["measure-chained"]["step_ms"] > 0 and "measure-chained time ratio" in lines[0]
    auto = row["autopart"]  # autopart's own one-stage step, against its plan and against plain Lightning
    assert len(auto["steps_s"]) == 3 and auto["predicted_ms"] > 0 and auto["predicted_peak_bytes"] > 0
    assert math.isfinite(auto["time_ratio"]) and math.isfinite(auto["vs_plain"])
    saved = json.loads(out.read_text())
    assert saved["rows"][0]["case"] == CASE and "header" in saved


def test_worst_case_is_farthest_from_one() -> None:
    def row(name: str, time: float, peak: float) -> dict[str, Any]:
        pred = {"step_ms": time, "peak_bytes": int(peak * 1e9), "fits": True, "time_ratio": time,
                "peak_ratio": peak}  # fmt: skip
        return {"case": name, "measured": {"step_ms": 1.0, "peak_bytes": int(1e9)}, "estimate": pred,
                "measure": pred}  # fmt: skip

    unmeasured = row("c", 1.0, 1.0)
    unmeasured["estimate"]["peak_ratio"] = math.nan  # (shared with "measure")
    text = fidelity.table([row("a", 1.15, 0.5), row("b", 0.8, 1.05), unmeasured])
    worst = text.split("worst case: ")[1]
    assert "estimate time 0.80x (b; goal +-20%: NOT met)" in worst  # 1/0.8 = 1.25 beats 1.15
    assert "estimate peak 0.50x (a;" in worst and "measure time 0.80x (b; goal +-10%: NOT met)" in worst
    assert "| c | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | - | 1.00 | 1.00 | 1.00 | - |" in text


def test_predict_only_needs_no_device_and_trains_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    rows = fidelity.main(["--tiny", "--cases", CASE, "--predict-only", "h100"])
    table = capsys.readouterr().out
    assert "spec h100-80gb" in table and f"| {CASE} |" in table
    (row,) = rows
    assert "measured" not in row and row["estimate"]["step_ms"] > 0 and row["estimate"]["on_meta"]


def test_own_data_makes_batches_in_the_step_and_prices_them(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tiny", "--accelerator", "cpu", "--cases", CASE, "--steps", "2", "--warmup", "1"]
    (row,) = fidelity.main([*argv, "--modes", "estimate", "--own-data"])
    assert "batches made in the step, progress bar on" in capsys.readouterr().out
    assert row["estimate"]["loader"].endswith("reads back every step")  # the step logs for the progress bar
    assert row["estimate"]["phases_ms"]["data"] > 0 and row["estimate"]["prediction"]["data_us"] > 0
    assert len(row["measured"]["steps_s"]) == 2


def test_own_data_quiet_turns_the_progress_bar_off_and_prices_a_loop_that_reads_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--tiny", "--accelerator", "cpu", "--cases", CASE, "--steps", "2", "--warmup", "1"]
    (row,) = fidelity.main([*argv, "--modes", "estimate", "--own-data", "quiet"])
    assert "batches made in the step, progress bar off" in capsys.readouterr().out
    assert row["estimate"]["loader"].endswith("reads back never")  # the case's step logs for the bar alone
