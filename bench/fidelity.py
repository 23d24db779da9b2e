"""Fidelity of the cost model: predicted step time and peak memory against plain Lightning on one device.

Usage: ``python bench/fidelity.py [--steps 20] [--warmup 5] [--cases ...] [--modes estimate measure]
[--json out.json]``; a smoke test without a GPU: ``python bench/fidelity.py --tiny --accelerator cpu``;
estimate mode's predictions alone, on any machine: ``python bench/fidelity.py --predict-only h100``.

Each case is a model x batch x precision x optimizer. **Measured**: plain Lightning (``strategy="auto"``,
``devices=1``, the case's precision, no logger, no checkpoints) trains the example's own model and
``training_step``, with its optimizer replaced by the case's (SGD lr 0.01, Adam / AdamW lr 1e-4), for
``warmup + steps + 1`` steps on a few pre-generated batches kept on the CPU (data generation costs nothing).
The callback of ``gpu_vs_plain.py`` records every step start after the warm-up (CUDA events; ``perf_counter``
on the CPU) and, on a GPU, resets the peak-memory statistics after the warm-up and reads
``torch.cuda.max_memory_allocated()`` at the end (raw, over the steady steps). Step time: the median interval.
On the CPU memory is not measured.

**Predicted**, per profile mode ("estimate": the roofline of the local device's spec, on a meta copy of the
model; "measure": timed on the local device): the model and loss are found as ``AutoPartitionStrategy`` finds
them (``find_forward`` on ``training_step``, ``step_loss``), profiled by ``profile_model(..., up_to=batch,
dtype=precision)`` and planned by ``partition(..., num_stages=1, micro_batches=1, checkpointing=False)`` (plain
training recomputes nothing) on a one-device cluster of the local spec with the device's memory; a plan that
does not fit still gives its prediction. Ratios are predicted / measured; the worst is the farthest from 1
(``max(r, 1/r)``). Goals: estimate within 20% (time) and 10% (peak), measure within 10% (both).
``--modes measure-serial`` adds measure mode timed as before the spin kernels of [Note: host and device]
(``cuda_clock.SPIN = False``: events only, host time not apart), to compare the two on one machine;
``--modes measure-chained`` adds measure mode with blocks chained between synchronizes and each backward's
autograd hand-off taken off (``cuda_clock.CHAIN = True``, [Note: chained runs]).

``--autopart`` also trains each case with ``AutoPartitionStrategy(num_stages=1, micro_batches=1)`` (measure
mode) and prints its step against its own plan's prediction and against plain Lightning's step: where a step
is host-bound, the captured graph autopart runs and the eager model plain Lightning runs differ in host time.

``--own-data`` measures as issue 9 did: each step makes its batch from the case's data set (a ``DataLoader`` with
the batch size, shuffled, no workers, as the examples' ``train_dataloader``) with the progress bar on, which
reads the logged loss back every step; the prediction then prices the loader's time per batch, timed from the
same data set ([Note: loader time], [Note: loader in the step]). ``--own-data quiet`` turns the progress bar
off: nothing reads a value back, the host makes the next batch while the device computes, and the
prediction's loop reads back what the step's own code reads ([Note: reads back]).

The driver prints a markdown table (device, torch and Lightning versions in its header) and the worst cases;
``--json`` also writes every step time and every prediction's parts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_vs_plain import POOL, _Batches, _device_name, warm_up_cuda  # noqa: E402
from plain_runs import FidelityCase, free_device, measure_autopart, measure_run, trace_ops  # noqa: E402

from examples.data import SyntheticImages, SyntheticRegression, SyntheticTokens  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from examples.resnet import ResNet  # noqa: E402
from examples.tutorial import Net  # noqa: E402

__all__ = [
    "GOALS",
    "ChannelsLastResNet",
    "FidelityCase",
    "LlamaModule",
    "cases",
    "main",
    "measure_run",
    "predict",
]

#: Largest tolerated deviation of predicted / measured, per (mode, metric).
GOALS: dict[tuple[str, str], float] = {
    ("estimate", "time"): 0.20,
    ("estimate", "peak"): 0.10,
    ("measure", "time"): 0.10,
    ("measure", "peak"): 0.10,
    ("measure-serial", "time"): 0.10,
    ("measure-serial", "peak"): 0.10,
    ("measure-chained", "time"): 0.10,
    ("measure-chained", "peak"): 0.10,
}
MODES = ("estimate", "measure")
#: Every mode ``--modes`` takes (see the module docstring).
CHOICES = (*MODES, "measure-serial", "measure-chained")


class LlamaModule(L.LightningModule):
    """A Hugging Face ``LlamaForCausalLM`` from a config (random weights), trained on its own next-token loss."""

    def __init__(
        self, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, seq: int, kv_heads: int = 0
    ) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or heads,
            max_position_embeddings=seq,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


class ChannelsLastResNet(ResNet):
    """:class:`ResNet` trained channels-last, as convnets are on tensor cores: weights converted once, images
    at the top of the forward (cuDNN then runs no NCHW/NHWC transposes: [Note: channels-last on meta])."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.to(memory_format=torch.channels_last)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.contiguous(memory_format=torch.channels_last))


def _random_tokens(vocab: int, seq: int) -> Callable[[int], Dataset[Any]]:
    return lambda n: TensorDataset(
        torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
    )


def cases(tiny: bool = False) -> dict[str, FidelityCase]:
    """The cases by name; ``tiny`` shrinks every one (small dimensions, batch 4) for a CPU smoke test."""
    gpt = {"vocab_size": 50257, "seq_len": 1024, "d_model": 768, "n_layers": 12, "n_heads": 12}
    llama = {"vocab": 32000, "hidden": 1024, "intermediate": 2816, "layers": 8, "heads": 16, "seq": 1024}
    resnet = {"depth": 50, "width_factor": 4, "num_classes": 1000, "image_size": 224}
    net, batches = (5000, 24), {"gpt": 8, "resnet": 32, "net": 512, "llama": 8}
    if tiny:
        gpt = {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layers": 2, "n_heads": 4}
        llama = {"vocab": 256, "hidden": 64, "intermediate": 172, "layers": 2, "heads": 4, "seq": 32}
        resnet = {"depth": 26, "width_factor": 1, "num_classes": 10, "image_size": 64}
        net, batches = (256, 4), dict.fromkeys(batches, 4)

    def gpt_case(name: str, precision: str) -> FidelityCase:
        return FidelityCase(
            name,
            lambda: GPT(**gpt),
            lambda n: SyntheticTokens(n, gpt["seq_len"], gpt["vocab_size"], seed=0),
            batches["gpt"],
            "adam",
            precision,
        )

    def resnet_case(name: str, model: type[ResNet], precision: str) -> FidelityCase:
        return FidelityCase(
            name,
            lambda: model(**resnet),
            lambda n: SyntheticImages(n, size=resnet["image_size"], classes=resnet["num_classes"], seed=0),
            batches["resnet"],
            "sgd",
            precision,
        )

    return {
        "gpt-small-b8-adam-32": gpt_case("gpt-small-b8-adam-32", "32-true"),
        "resnet50x4-b32-sgd-32": resnet_case("resnet50x4-b32-sgd-32", ResNet, "32-true"),
        "resnet50x4-b32-sgd-bf16mixed-cl": resnet_case(
            "resnet50x4-b32-sgd-bf16mixed-cl", ChannelsLastResNet, "bf16-mixed"
        ),
        "net5000x24-b512-sgd-32": FidelityCase(
            "net5000x24-b512-sgd-32",
            lambda: Net(*net),
            lambda n: SyntheticRegression(n, net[0], seed=0),
            batches["net"],
            "sgd",
            "32-true",
        ),
        "gpt-small-b8-adam-bf16mixed": gpt_case("gpt-small-b8-adam-bf16mixed", "bf16-mixed"),
        "llama-tiny-b8-adamw-bf16mixed": FidelityCase(
            "llama-tiny-b8-adamw-bf16mixed",
            lambda: LlamaModule(**llama),
            _random_tokens(llama["vocab"], llama["seq"]),
            batches["llama"],
            "adamw",
            "bf16-mixed",
        ),
        # grouped key/value heads, as Llama 3, Mistral and Qwen2 have them ([Note: grouped heads])
        "llama-gqa-b8-adamw-bf16mixed": FidelityCase(
            "llama-gqa-b8-adamw-bf16mixed",
            lambda: LlamaModule(**llama, kv_heads=llama["heads"] // 4),
            _random_tokens(llama["vocab"], llama["seq"]),
            batches["llama"],
            "adamw",
            "bf16-mixed",
        ),
    }


def _profile(case: FidelityCase, batch: Any, mode: str, spec: Any, on_meta: bool) -> tuple[Any, Any]:
    """The case's profile and its loss (whose ``reads`` say what the step reads back)."""
    from lightning_autopart.lightning.hooks import batch_size_of, find_forward
    from lightning_autopart.lightning.step_loss import step_loss
    from lightning_autopart.planner import meta_inputs, profile_model

    torch.manual_seed(0)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        lm = case.model()
    if on_meta:
        batch = meta_inputs(batch)
    call = find_forward(lm, lambda: lm.training_step(batch, 0))
    root = lm.get_submodule(call.name) if call.name else lm
    size = batch_size_of(batch)
    loss = step_loss(lm, call.name, batch, size)
    prof = profile_model(
        root,
        (call.args, call.kwargs),
        profile=mode,
        spec=spec,
        optimizer=case.optimizer,
        up_to=size,
        loss=loss,
        dtype=case.precision,
    )
    return prof, loss


def predict(
    case: FidelityCase,
    batch: Any,
    mode: str,
    spec: Any,
    device_memory: int,
    loader: Any = None,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """The one-stage, one-micro-batch plan's predicted step (ms) and peak bytes, profiled in ``mode``, with
    ``loader``'s time per batch (a :class:`LoaderCost`) in the step where given, under a loop with or without
    the progress bar and no logger ([Note: reads back]).

    "estimate" profiles a meta copy of the model, or a CPU one when the step or the loss fails on meta."""
    from lightning_autopart.cluster import Cluster
    from lightning_autopart.errors import PlanError
    from lightning_autopart.partition import partition
    from lightning_autopart.profile.loader import with_loader
    from lightning_autopart.profile.readback import LoopFacts, with_readback
    from lightning_autopart.profile.records import cost_at

    on_meta, meta_error = mode == "estimate", None
    try:
        prof, loss = _profile(case, batch, mode, spec, on_meta)
        if on_meta and "loss_error" in prof.meta:
            raise RuntimeError(prof.meta["loss_error"])
    except Exception as error:
        if not on_meta:
            raise
        on_meta, meta_error = False, f"{type(error).__name__}: {error}"
        prof, loss = _profile(case, batch, mode, spec, on_meta)
    prof = with_loader(prof, with_readback(loader, loss, LoopFacts(progress_every=int(progress_bar), log_every=0)))
    cluster = Cluster.from_spec(spec, devices=1, device_memory=device_memory)
    fits = True
    try:
        plan = partition(prof, cluster, case.batch, num_stages=1, micro_batches=1, checkpointing=False)
    except PlanError as error:
        if error.closest is None:
            raise
        plan, fits = error.closest, False
    p = plan.prediction
    at = [cost_at(b, case.batch, prof.batch_size) for b in prof.blocks]
    return {
        "step_ms": p.step_us / 1e3,
        "phases_ms": {
            "forward": sum(c.fwd_us for c in at) / 1e3,
            "backward": sum(c.bwd_us for c in at) / 1e3,
            "optimizer": sum(b.optimizer_us for b in prof.blocks) / 1e3,
            "data": p.data_us / 1e3,
        },
        # the host's time at the profiled batch (measure mode on CUDA; else 0), beside the device's phases
        "host_ms": {
            "forward": sum(b.host_fwd_us for b in prof.blocks) / 1e3,
            "backward": sum(b.host_bwd_us for b in prof.blocks) / 1e3,
        },
        "blocks": [
            (b.name, round(c.fwd_us, 1), round(c.bwd_us, 1), round(b.host_fwd_us, 1), round(b.host_bwd_us, 1))
            for b, c in zip(prof.blocks, at, strict=True)
        ],
        "peak_bytes": p.peak_memory_bytes,
        "fits": fits,
        "on_meta": on_meta,
        "meta_error": meta_error,
        "loss_error": prof.meta.get("loss_error"),
        "num_blocks": prof.num_blocks,
        "prediction": asdict(p),
        "loader": plan.notes.get("loader"),
    }


def _ratio(pred: float | None, meas: float | None) -> float:
    return pred / meas if pred is not None and meas else math.nan


def _worst(rows: list[dict[str, Any]], mode: str, metric: str) -> tuple[float, str] | None:
    scored = [(r[mode][f"{metric}_ratio"], r["case"]) for r in rows if mode in r]
    scored = [(x, c) for x, c in scored if math.isfinite(x) and x > 0]
    return max(scored, key=lambda s: max(s[0], 1 / s[0])) if scored else None


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _fmt(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "-"


def table(rows: list[dict[str, Any]], modes: tuple[str, ...] = MODES) -> str:
    """The markdown table of ``rows`` and the line of worst cases against the goals."""
    head = "| case | measured ms | measured GB |"
    rule = "|---|---:|---:|"
    for mode in modes:
        head += f" {mode} ms | {mode} GB | {mode} time ratio | {mode} peak ratio |"
        rule += "---:|---:|---:|---:|"
    lines = [head, rule]
    for r in rows:
        cells = [r["case"], f"{r['measured']['step_ms']:.2f}", _gb(r["measured"]["peak_bytes"])]
        for mode in modes:
            p = r[mode]
            fit = "" if p["fits"] else " (no fit)"
            cells += [f"{p['step_ms']:.2f}", _gb(p["peak_bytes"]) + fit, _fmt(p["time_ratio"]),
                      _fmt(p["peak_ratio"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    parts = []
    for mode in modes:
        for metric in ("time", "peak"):
            goal = GOALS[(mode, metric)]
            worst = _worst(rows, mode, metric)
            if worst is None:
                parts.append(f"{mode} {metric} - (goal +-{goal:.0%})")
                continue
            ratio, name = worst
            met = "met" if max(ratio, 1 / ratio) <= 1 + goal else "NOT met"
            parts.append(f"{mode} {metric} {ratio:.2f}x ({name}; goal +-{goal:.0%}: {met})")
    return "\n".join(lines) + "\n\nworst case: " + ", ".join(parts)


@contextlib.contextmanager
def _spin(on: bool, chain: bool = False) -> Iterator[None]:
    """Measure mode with or without the spin kernels of [Note: host and device], its runs chained or not
    ([Note: chained runs])."""
    from lightning_autopart.profile import cuda_clock

    before = cuda_clock.SPIN, cuda_clock.CHAIN
    cuda_clock.SPIN, cuda_clock.CHAIN = on, chain
    try:
        yield
    finally:
        cuda_clock.SPIN, cuda_clock.CHAIN = before


def _device_memory(cuda: bool) -> int:
    if cuda:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def predict_only(chosen: dict[str, FidelityCase], names: list[str], spec_name: str) -> list[dict[str, Any]]:
    """Estimate mode's predicted step and peak for each case on ``spec_name``, with no device and no training:
    to compare two versions of the cost model against a table of measurements taken before."""
    from lightning_autopart.profile import resolve_spec

    spec, rows = resolve_spec(spec_name), []
    print(f"estimate mode on spec {spec.name}; torch {torch.__version__}\n\n| case | predicted ms | predicted GB |")
    print("|---|---:|---:|")
    for key in names:
        case = chosen[key]
        batch = next(iter(DataLoader(case.data(case.batch), batch_size=case.batch)))
        with contextlib.redirect_stdout(sys.stderr):
            p = predict(case, batch, "estimate", spec, spec.memory_bytes)
        rows.append({"case": case.name, "estimate": p})
        print(f"| {case.name} | {p['step_ms']:.2f} | {_gb(p['peak_bytes'])}{'' if p['fits'] else ' (no fit)'} |")
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = list(cases())
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--tiny", action="store_true", help="small models, few steps (a CPU smoke test)")
    parser.add_argument("--cases", nargs="+", choices=names, default=names)
    parser.add_argument("--modes", nargs="+", choices=CHOICES, default=list(MODES), help="profile modes")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20, --tiny 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, --tiny 2)")
    parser.add_argument("--json", type=Path, default=None, help="also write every step time and prediction")
    parser.add_argument("--ops", action="store_true", help="also trace device time per op (in the json)")
    parser.add_argument("--autopart", action="store_true", help="also time autopart's one-stage step")
    parser.add_argument("--own-data", nargs="?", const="bar", choices=["bar", "quiet"], default=None,
                        help="make each batch from the case's data set in the step (a DataLoader, batch_size, "
                        "shuffle, no workers) with the progress bar on, as issue 9 measured, and price it; "
                        "'quiet': with the progress bar off")
    parser.add_argument("--predict-only", metavar="SPEC", default=None,
                        help="no training: print estimate mode's predictions on device spec SPEC (any machine)")
    args = parser.parse_args(argv)
    if args.predict_only:
        return predict_only(cases(args.tiny), args.cases, args.predict_only)
    steps = args.steps if args.steps is not None else (5 if args.tiny else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --accelerator cpu (with --tiny for a quick run)")
    if steps < 1 or warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    warnings.filterwarnings("ignore", module=r"lightning\.")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_autopart"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from lightning_autopart.profile import resolve_spec
    from lightning_autopart.profile.loader import time_loader

    cuda = args.accelerator == "gpu"
    if cuda:
        warm_up_cuda()
    spec = resolve_spec(None, torch.device("cuda")) if cuda else resolve_spec("cpu")
    memory, modes = _device_memory(cuda), tuple(m for m in CHOICES if m in args.modes)
    chosen = cases(args.tiny)
    rows: list[dict[str, Any]] = []
    for key in args.cases:
        case = chosen[key]
        data = _Batches(case.data(case.batch * POOL), case.batch, warmup + steps + 1)
        own, cost = None, None
        if args.own_data:  # as the examples' train_dataloader: batches made in the step
            own = DataLoader(case.data(case.batch * (warmup + steps + 2)), case.batch, shuffle=True, drop_last=True)
            cost = time_loader(own, case.batch)
        bar = args.own_data != "quiet"
        measured = measure_run(
            case, own or data, accelerator=args.accelerator, warmup=warmup, steps=steps, progress_bar=bool(own) and bar
        )
        row: dict[str, Any] = {"case": case.name, "batch": case.batch, "optimizer": case.optimizer,
                               "precision": case.precision, "measured": measured}  # fmt: skip
        for mode in modes:
            serial, chain = mode == "measure-serial", mode == "measure-chained"
            with contextlib.redirect_stdout(sys.stderr), _spin(not serial, chain):
                p = predict(case, data.pool[0], "measure" if serial or chain else mode, spec, memory, cost, bar)
            free_device(cuda)
            p["time_ratio"] = _ratio(p["step_ms"], measured["step_ms"])
            p["peak_ratio"] = _ratio(p["peak_bytes"], measured["peak_bytes"])
            row[mode] = p
            phases = ", ".join(f"{k} {v:.2f}" for k, v in p["phases_ms"].items())
            host = ", ".join(f"{k} {v:.2f}" for k, v in p["host_ms"].items())
            print(f"{case.name} {mode}: time x{_fmt(p['time_ratio'])}, peak x{_fmt(p['peak_ratio'])}; "
                  f"ms: {phases}; host {host}; measured {measured.get('phases_ms')}", file=sys.stderr)  # fmt: skip
        if args.autopart:
            a = measure_autopart(case, data, accelerator=args.accelerator, warmup=warmup, steps=steps)
            a["time_ratio"] = _ratio(a["predicted_ms"], a["step_ms"])
            a["vs_plain"], row["autopart"] = a["step_ms"] / measured["step_ms"], a
            print(f"{case.name} autopart: {a['step_ms']:.2f} ms, predicted x{_fmt(a['time_ratio'])}, "
                  f"plain x{_fmt(a['vs_plain'])}", file=sys.stderr)  # fmt: skip
        if args.ops:
            row["ops"] = trace_ops(case, data, accelerator=args.accelerator, warmup=warmup, steps=3)
        rows.append(row)
        if args.json:  # after every case, so that a run stopped part-way keeps what it measured
            args.json.write_text(json.dumps({"rows": rows}, indent=1))
    header = (
        f"{_device_name(args.accelerator)}; torch {torch.__version__}, lightning {L.__version__}; spec {spec.name}; "
        f"{steps} timed steps after {warmup} warm-up; float32 matmul precision "
        f"{torch.get_float32_matmul_precision()}{_own_data(args.own_data)}"
    )
    print(f"{header}\n\n{table(rows, modes)}")
    if args.json:
        args.json.write_text(json.dumps({"header": header, "goals": {f"{m} {k}": g for (m, k), g in GOALS.items()},
                                         "rows": rows}, indent=1))  # fmt: skip
    return rows


def _own_data(kind: str | None) -> str:
    """The table header's words for ``--own-data``."""
    if kind is None:
        return ""
    return "; batches made in the step, progress bar " + ("off" if kind == "quiet" else "on")


if __name__ == "__main__":
    main()
