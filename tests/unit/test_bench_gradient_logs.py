"""bench/gradient_logs.py on a short run: two gloo ranks gather and merge, and the table comes out."""

from __future__ import annotations

import pytest

from bench import gradient_logs


@pytest.mark.timeout(120)
def test_a_short_run_prints_the_cost_per_call(capsys: pytest.CaptureFixture[str]) -> None:
    times = gradient_logs.main(["--calls", "5", "--params", "3,20"])
    out = capsys.readouterr().out
    assert "| norms logged per stage | records merged | ms per hook call |" in out
    assert "| 3 | 8 |" in out and "| 20 | 42 |" in out
    assert set(times) == {3, 20} and all(0.0 < t < 5.0 for t in times.values())
