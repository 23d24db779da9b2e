"""The plan table, the schedule simulation behind the timeline, and the pictures."""

from __future__ import annotations

import dataclasses
import io
import itertools
import sys
from pathlib import Path

import pytest
from rich.console import Console

from lightning_autopart.errors import ConfigError
from lightning_autopart.plan import Plan
from lightning_autopart.plan.report import format_count, format_ms, format_plan, format_ranks, print_plan
from lightning_autopart.plan.visualize import (
    ScheduleEvent,
    draw_memory,
    draw_timeline,
    schedule_order,
    simulate_schedule,
)
from tests.unit.test_plan_io import make_plan

PNG = b"\x89PNG\r\n\x1a\n"


def render(plan: Plan, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width, record=True)
    console.print(format_plan(plan))
    return console.export_text()


def interleaved_plan() -> Plan:
    """Four virtual stages on two pipeline ranks (two chunks each), two replicas."""
    base = make_plan(num_stages=4, replicas=2, layers=8, micro_batches=4)
    ranks = [(0, 1), (2, 3), (0, 1), (2, 3)]
    stages = tuple(dataclasses.replace(s, ranks=r) for s, r in zip(base.stages, ranks, strict=True))
    cluster = dataclasses.replace(base.cluster, devices_per_node=4)
    return dataclasses.replace(
        base, stages=stages, cluster=cluster, schedule="Interleaved1F1B", chunks_per_rank=2
    )


def test_table_shows_the_key_numbers() -> None:
    text = render(make_plan())
    for expected in (
        "Plan for Net (1,050,624 parameters, 4 blocks)",
        "layers.0 .. layers.1",
        "layers.2 .. layers.3",
        "525K",  # parameters per stage
        "2 × 0,1",
        "2 × 2,3",
        "1.50",  # stage 0 forward ms
        "3.50",  # stage 1 backward ms
        "0.98",  # all-reduce ms
        "7.2 MB",  # total memory per device
        "1F1B: 2 stages × 2 replicas on 4 ranks",
        "64 = 4 micro-batches × 8 samples × 2 replicas",
        "40.0 ms = compute 30.0 (75%) + bubble 7.00 (18%) + p2p 2.00 (5%) + all-reduce 1.00 (2%)",
        "1,600.0 samples/s",
        "estimate on cpu",
    ):
        assert expected in text, expected


def test_table_fits_120_columns_for_a_deep_plan() -> None:
    plan = make_plan(num_stages=8, replicas=8, layers=100, stride_ranks=True, batch_size=512, micro_batches=8)
    text = render(plan, width=200)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 120
    assert "8 × 0,8,…,56" in text


def test_interleaved_memory_is_summed_per_device() -> None:
    plan = interleaved_plan()
    plan.validate()
    text = render(plan)
    assert "stage s runs on the ranks of stage s mod 2" in text
    assert "0,2" in text and "1,3" in text
    assert "Interleaved1F1B, 2 chunks per rank" in text


def test_print_plan_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    print_plan(make_plan())
    out = capsys.readouterr().out
    assert "Plan for Net" in out
    assert "\x1b[" not in out  # no colour codes in CI logs


def test_print_plan_under_mpirun_is_not_squeezed_into_its_pty(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpirun gives each rank an 80-column pseudo-terminal and copies it into its output: the plan is printed
    as to a file (120 columns, no colour codes), not wrapped at 80 with escape sequences in the log."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.delenv("TERM", raising=False)
    with os.fdopen(slave, "w", closefd=True) as tty, monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", tty)
        print_plan(make_plan())
    # Read only once the slave is closed, up to EIO: the kernel hands a pty's bytes to the master side in the
    # background, so a short read before that is not the end (a CI run read 1,904 of 3,119 bytes that way).
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    out = b"".join(chunks).decode()
    assert "Notes" in out, f"the plan came out cut short: {out[-200:]!r}"
    assert "\x1b[" not in out
    assert max(len(line) for line in out.splitlines()) > 80


def test_number_formats() -> None:
    assert [format_ranks(r) for r in ([3], [0, 1, 2, 3, 4, 5, 6, 7], [0, 4, 8, 12], [6, 0, 4, 2, 8])] == [
        "3",
        "0-7",
        "0,4,8,12",
        "0,2,…,8",
    ]
    assert format_ranks([0, 1, 5, 9, 11]) == "0,1,5,…,11"
    assert [format_ms(us) for us in (0, 5, 1234, 27_516, 437_809, 1_234_567)] == [
        "0",
        "<0.01",
        "1.23",
        "27.5",
        "437.8",
        "1,235",
    ]
    assert [format_count(n) for n in (512, 262_656, 1_049_600, 2_500_500_000)] == [
        "512",
        "263K",
        "1.05M",
        "2.5B",
    ]


def _check_dependencies(events: list[ScheduleEvent], stages: int, p2p: float = 0.0) -> None:
    """Every forward follows the previous stage's forward, every backward the next stage's backward."""
    at = {(e.kind, e.stage, e.microbatch): e for e in events}
    for e in events:
        if e.kind == "F" and e.stage > 0:
            assert e.start_us >= at["F", e.stage - 1, e.microbatch].end_us + p2p / 2 - 1e-9
        if e.kind == "B":
            assert e.start_us >= at["F", e.stage, e.microbatch].end_us - 1e-9
            if e.stage < stages - 1:
                assert e.start_us >= at["B", e.stage + 1, e.microbatch].end_us + p2p / 2 - 1e-9


def _per_stage(events: list[ScheduleEvent], stage: int) -> list[str]:
    return [f"{e.kind}{e.microbatch}" for e in sorted(events, key=lambda e: e.start_us) if e.stage == stage]


def test_gpipe_runs_all_forwards_then_all_backwards() -> None:
    events = simulate_schedule([1.0] * 4, [2.0] * 4, 6, "GPipe")
    assert len(events) == 2 * 4 * 6
    for s in range(4):
        assert _per_stage(events, s) == [f"F{k}" for k in range(6)] + [f"B{k}" for k in range(6)]
    _check_dependencies(events, 4)
    assert max(e.end_us for e in events) == pytest.approx((6 + 4 - 1) * 3.0)


def test_one_f_one_b_warms_up_then_alternates() -> None:
    events = simulate_schedule([1.0] * 4, [2.0] * 4, 6, "1F1B")
    assert _per_stage(events, 0) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert _per_stage(events, 3) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    _check_dependencies(events, 4)
    assert max(e.end_us for e in events) == pytest.approx((6 + 4 - 1) * 3.0)
    # Activations in flight on stage s never exceed num_stages - s (the point of 1F1B).
    for s in range(4):
        live = peak = 0
        for item in _per_stage(events, s):
            live += 1 if item[0] == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - s


def test_bubble_appears_as_gaps_and_p2p_delays() -> None:
    slow_last = simulate_schedule([1.0, 1.0, 4.0], [2.0, 2.0, 8.0], 4, "1F1B", p2p_us=[0.5, 0.5, 0.5])
    _check_dependencies(slow_last, 3, p2p=0.5)
    first = sorted((e for e in slow_last if e.stage == 0), key=lambda e: e.start_us)
    gaps = [b.start_us - a.end_us for a, b in itertools.pairwise(first)]
    assert max(gaps) > 5.0  # stage 0 waits on the slow last stage


def test_interleaved_halves_the_bubble() -> None:
    plain = simulate_schedule([2.0] * 4, [4.0] * 4, 8, "1F1B")
    inter = simulate_schedule([1.0] * 8, [2.0] * 8, 8, "Interleaved1F1B", chunks_per_rank=2)
    assert len(inter) == 2 * 8 * 8
    _check_dependencies(inter, 8)
    busy = 8 * 6.0
    assert max(e.end_us for e in inter) - busy == pytest.approx((max(e.end_us for e in plain) - busy) / 2)


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("micro_batches", [1, 3, 4, 7, 8])
def test_interleaved_never_deadlocks(chunks: int, micro_batches: int) -> None:
    for ranks in (1, 2, 3, 4):
        events = simulate_schedule(
            [1.0] * (ranks * chunks),
            [1.5] * (ranks * chunks),
            micro_batches,
            "Interleaved1F1B",
            chunks_per_rank=chunks,
        )
        assert len(events) == 2 * ranks * chunks * micro_batches
        _check_dependencies(events, ranks * chunks)


def test_schedule_order_errors() -> None:
    with pytest.raises(ConfigError, match="unknown schedule 'ZB'"):
        schedule_order("ZB", 2, 4)
    with pytest.raises(ConfigError, match="use Interleaved1F1B"):
        schedule_order("1F1B", 2, 4, chunks_per_rank=2)
    with pytest.raises(ConfigError, match="one forward and one backward time per stage"):
        simulate_schedule([1.0, 1.0], [1.0], 2)


def test_pictures_are_written(tmp_path: Path) -> None:
    draw_timeline(make_plan(), tmp_path / "timeline.png")
    draw_timeline(interleaved_plan(), tmp_path / "interleaved.png", memory=False)
    draw_memory(dataclasses.replace(make_plan(), schedule="GPipe"), tmp_path / "memory.png")
    for name in ("timeline.png", "interleaved.png", "memory.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)
    with pytest.raises(ConfigError, match="cannot write picture"):
        draw_memory(make_plan(), tmp_path / "missing" / "memory.png")


def test_missing_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match=r"needs matplotlib.*lightning_autopart\[plot\]"):
        draw_timeline(make_plan(), tmp_path / "timeline.png")
