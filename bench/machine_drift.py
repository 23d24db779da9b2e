"""How far can any prediction made on this machine be trusted: how much does the same work's speed move between
two windows of time, as a plan's profile and the training that follows it are?

Usage: ``python bench/machine_drift.py [--seconds 60] [--neighbour busy|idle] [--lags 3,10]``.
One thread runs one micro-batch of the bench MLP (``bench/strategy_vs_ddp.py``: forward and backward, batch 16)
over and over for ``--seconds``, timing each 0.1 s slice, while the other core is idle or computes the same work
(``busy``, as the other rank of a 2-stage pipeline does). It prints, for windows of 0.3, 1, 3 and 10 s, the
spread of the windows' mean times, and for two 1 s windows ``lag`` seconds apart (a profile, then the training
measured after planning) the range of their ratio and the share of pairs that differ by more than 15 %. Nothing
of autopart runs: this is the floor under the measured / predicted ratio of any CPU cost model here.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import strategy_vs_ddp as common

__all__: list[str] = []

#: The neighbour's work: the same micro-batch, forever (killed at the end).
_SAME_WORK = (
    "import sys, torch\nsys.path.insert(0, {path!r})\nimport strategy_vs_ddp as c\ntorch.set_num_threads(1)\n"
    "m = c.MLP()\nx = torch.randn(16, c.HIDDEN)\nwhile True:\n    m(x).sum().backward()"
)
#: Length of one timed slice (s).
_SLICE = 0.1


def _slices(seconds: float) -> list[float]:
    """Mean microseconds of one micro-batch in each 0.1 s slice of ``seconds``."""
    model = common.MLP()
    x = torch.randn(16, common.HIDDEN)
    for _ in range(5):
        model(x).sum().backward()
    means: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        began, runs = time.perf_counter(), 0
        while time.perf_counter() - began < _SLICE:
            model(x).sum().backward()
            runs += 1
        means.append((time.perf_counter() - began) / runs * 1e6)
    return means


def _windows(slices: list[float], span: int) -> list[float]:
    return [statistics.fmean(slices[i : i + span]) for i in range(0, len(slices) - span + 1, span)]


def main(argv: list[str] | None = None) -> dict[str, dict[float, tuple[float, ...]]]:
    """Run, print the two tables and return them: per window (s) its max / min and cv; per lag (s) the least and
    greatest ratio of its pairs and the share of pairs outside +-15 %."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--neighbour", choices=("busy", "idle"), default="busy")
    parser.add_argument("--lags", default="3,10", help="seconds between the two 1 s windows, comma-separated")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    here = str(Path(__file__).resolve().parent)
    neighbour = None
    if args.neighbour == "busy":
        neighbour = subprocess.Popen([sys.executable, "-c", _SAME_WORK.format(path=here)])
        time.sleep(3.0)  # past its imports: computing
    try:
        slices = _slices(args.seconds)
    finally:
        if neighbour is not None:
            neighbour.kill()
    found: dict[str, dict[float, tuple[float, ...]]] = {"windows": {}, "pairs": {}}
    print(f"{len(slices)} slices of {_SLICE} s, other core {args.neighbour}, mean {statistics.fmean(slices):.0f} us")
    print("\n| window | windows | max / min | cv |\n|---|---:|---:|---:|")
    for seconds in (0.3, 1.0, 3.0, 10.0):
        means = _windows(slices, round(seconds / _SLICE))
        if len(means) >= 2:
            cv = statistics.pstdev(means) / statistics.fmean(means)
            found["windows"][seconds] = (max(means) / min(means), cv)
            print(f"| {seconds:g} s | {len(means)} | {max(means) / min(means):.2f} | {cv:.3f} |")
    second = round(1.0 / _SLICE)
    print("\n| two 1 s windows apart by | pairs | later / earlier | outside +-15 % |\n|---|---:|---|---:|")
    for lag in (float(v) for v in args.lags.split(",")):
        step = round(lag / _SLICE)
        pairs = [
            statistics.fmean(slices[i + step : i + step + second]) / statistics.fmean(slices[i : i + second])
            for i in range(0, len(slices) - step - second + 1, second)
        ]
        if pairs:
            outside = sum(not 0.85 <= r <= 1.15 for r in pairs) / len(pairs)
            found["pairs"][lag] = (min(pairs), max(pairs), outside)
            print(f"| {lag:g} s | {len(pairs)} | {min(pairs):.2f}-{max(pairs):.2f} | {outside:.0%} |")
    return found


if __name__ == "__main__":
    main()
