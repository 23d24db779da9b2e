"""bench/machine_drift.py on a short run: both tables come out, with ratios a drift can give."""

from __future__ import annotations

import pytest

from bench import machine_drift


@pytest.mark.timeout(60)
def test_a_short_run_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    found = machine_drift.main(["--seconds", "2.5", "--neighbour", "idle", "--lags", "0.5"])
    out = capsys.readouterr().out
    assert "| window | windows | max / min | cv |" in out and "| 0.3 s |" in out and "| 1 s |" in out
    assert "| 0.5 s |" in out and "outside +-15 %" in out
    spread, cv = found["windows"][0.3]
    assert spread >= 1.0 and cv >= 0.0
    low, high, outside = found["pairs"][0.5]
    assert 0.0 < low <= high and 0.0 <= outside <= 1.0
