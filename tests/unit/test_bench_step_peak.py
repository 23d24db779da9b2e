"""bench/step_peak.py on one architecture of the test tier and one of bench/hf_sweep.py (a mixture of experts,
which routes by value): its row, inside issue 9's 10%, and the worst case printed."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import step_peak


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_an_architecture_gives_its_row(arch: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = step_peak.main(["--archs", arch, "--widen", "2", "--precisions", "bf16-true"])
    out = capsys.readouterr().out
    assert [r["arch"] for r in rows] == [arch] and f"| {arch} | bf16-true |" in out
    assert all(0.9 <= r["ratio"] <= 1.1 for r in rows) and "worst: " in out
