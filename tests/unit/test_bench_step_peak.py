"""bench/step_peak.py on one architecture: its row, inside issue 9's 10%, and the worst case printed."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import step_peak


@pytest.mark.timeout(120)
def test_an_architecture_gives_its_row(capsys: pytest.CaptureFixture[str]) -> None:
    rows = step_peak.main(["--archs", "qwen3", "--widen", "2", "--precisions", "bf16-true"])
    out = capsys.readouterr().out
    assert [r["arch"] for r in rows] == ["qwen3"] and "| qwen3 | bf16-true |" in out
    assert all(0.9 <= r["ratio"] <= 1.1 for r in rows) and "worst: " in out
