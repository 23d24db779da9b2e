"""bench/step_peak.py on two architectures: a row each, inside issue 9's 10%, and the worst case printed."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import step_peak


@pytest.mark.timeout(120)
def test_two_architectures_give_their_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rows = step_peak.main(["--archs", "qwen3", "convnext", "--widen", "2", "--precisions", "bf16-true"])
    out = capsys.readouterr().out
    assert [r["arch"] for r in rows] == ["qwen3", "convnext"] and "| qwen3 | bf16-true |" in out
    assert all(0.9 <= r["ratio"] <= 1.1 for r in rows) and "worst: " in out
