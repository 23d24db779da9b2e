"""Host and device time of a measured profile, with and without the context the strategy profiles in.

Usage: ``python bench/profile_contexts.py [--case llama-tiny-b8-adamw-bf16mixed] [--rounds 2]`` (a CUDA
device); a smoke test without one: ``python bench/profile_contexts.py --tiny`` (the CPU, where host and device
are one).

The strategy profiles inside the precision plugin's context, autocast for "-mixed", so each block's backward
runs under it too, where training calls backward after autocast has closed. This profiles one
``bench/fidelity.py`` case in measure mode ``rounds`` times with no context around it and ``rounds`` times
inside autocast, alternating, and prints the device's and the host's forward and backward sums at the case's
batch: the difference between the contexts against the spread between rounds of one context.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__: list[str] = []


def _sums(prof: Any, batch: int) -> dict[str, float]:
    from lightning_autopart.profile.records import cost_at

    at = [cost_at(b, batch, prof.batch_size) for b in prof.blocks]
    return {
        "device fwd": sum(c.fwd_us for c in at) / 1e3,
        "device bwd": sum(c.bwd_us for c in at) / 1e3,
        "host fwd": sum(b.host_fwd_us for b in prof.blocks) / 1e3,
        "host bwd": sum(b.host_bwd_us for b in prof.blocks) / 1e3,
    }


def main() -> None:
    import fidelity

    from lightning_autopart.profile import resolve_spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama-tiny-b8-adamw-bf16mixed")
    parser.add_argument("--tiny", action="store_true", help="the case's tiny model, on the CPU")
    parser.add_argument("--rounds", type=int, default=2, help="profiles per context")
    args = parser.parse_args()
    kind = "cpu" if args.tiny else "cuda"
    if kind == "cuda":
        fidelity.warm_up_cuda()
    case = fidelity.cases(args.tiny)[args.case]
    data = fidelity._Batches(case.data(case.batch * fidelity.POOL), case.batch, 2)
    spec = resolve_spec("cpu") if args.tiny else resolve_spec(None, torch.device("cuda"))
    for round_ in range(args.rounds):
        for label, autocast in (("no context", False), ("autocast", True)):
            outer = torch.autocast(kind, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with outer, contextlib.redirect_stdout(sys.stderr):
                prof = fidelity._profile(case, data.pool[0], "measure", spec, False)
            sums = ", ".join(f"{k} {v:.2f}" for k, v in _sums(prof, case.batch).items())
            print(f"{case.name}, round {round_ + 1}, {label}: ms {sums}", flush=True)
            fidelity.free_device(kind == "cuda")


if __name__ == "__main__":
    main()
