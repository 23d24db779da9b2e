"""How much does a measured CPU profile move from one call to the next, and does a longer window or a
reference clock steady it?

Usage: ``python bench/profile_spread.py [--calls 8] [--budgets 0.3,1.2] [--hidden 512] [--micro-batch 16]``.
One process, one thread: the bench MLP (``bench/strategy_vs_ddp.py``) is captured at the micro-batch and its
blocks are timed by ``measure_blocks`` (measure mode's own timing) ``--calls`` times in a row for each timing
window in ``--budgets`` (seconds; ``_HOST_BUDGET_S``, with up to 100 rounds a second), first with the other
core idle, then beside a process that keeps it busy with products and copies (as the other ranks do while rank
0 plans, [Note: planning under load]). Each call is bracketed by the pipeline probe's clock (``unit_us``, 0.05
s before and after). Prints every call's sum of forward and backward times, then per setting the spread
(max / min) and coefficient of variation of the sums and of the sums over the clock: if the clock tracked the
machine's drift, the second would be the steadier.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import strategy_vs_ddp as common
from stage_timing import BUSY

from lightning_autopart.capture import capture
from lightning_autopart.profile import measure
from lightning_autopart.profile.pipeline_probe import unit_us
from lightning_autopart.profile.precision import parse_precision

__all__: list[str] = []


def _spread(values: list[float]) -> str:
    cv = statistics.pstdev(values) / statistics.fmean(values)
    return f"max/min {max(values) / min(values):.2f}, cv {cv:.3f}"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--budgets", default="0.3,1.2", help="timing windows (s), comma-separated")
    parser.add_argument("--hidden", type=int, default=common.HIDDEN)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    common.HIDDEN = args.hidden
    model = common.MLP()
    captured = capture(model, ((torch.randn(args.micro_batch, args.hidden),), {}), max_blocks=64)
    precision = parse_precision(None, model)
    cpu = torch.device("cpu")
    summary = []
    for neighbour in ("idle", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY]) if neighbour == "busy" else None
        try:
            if busy is not None:
                time.sleep(3.0)  # past its import of torch: computing
            for budget in (float(b) for b in args.budgets.split(",")):
                measure._HOST_BUDGET_S, measure._MAX_HOST_ROUNDS = budget, max(5, int(100 * budget))
                sums, scaled = [], []
                for call in range(args.calls):
                    before = unit_us(0.05, 10)
                    costs = measure.measure_blocks(captured.blocks, cpu, precision, 0.0, 2, 5)
                    clock = (before + unit_us(0.05, 10)) / 2
                    total = sum(c.fwd_us + c.bwd_us for c in costs) / 1e3
                    sums.append(total)
                    scaled.append(total / clock * 1e3)
                    print(
                        f"other core {neighbour}, window {budget} s, call {call + 1}: blocks {total:.2f} ms, "
                        f"clock {clock:.0f} us, blocks / clock {total / clock * 1e3:.2f}",
                        flush=True,
                    )
                summary.append(
                    f"other core {neighbour}, window {budget} s: blocks {_spread(sums)}; "
                    f"blocks / clock {_spread(scaled)}"
                )
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
