"""Each pipeline rank's step peak against its stage's predicted memory, on 2 gloo ranks of this machine.

Usage: ``python bench/pipeline_peak.py [--model mlp|llama|gpt2] [--cases 1F1B:4 1F1B:8 GPipe:4 Interleaved1F1B:4]
[--batch N] [--precision 32-true|bf16-mixed|...] [--spec cpu] [--parts]`` (about 20 s a case).

Models: a 2-stage MLP (8 x Linear(256, 1024) + GELU + Linear(1024, 256)) with SGD (no state, so activations
decide the peak), ``--batch`` 1,024 samples of 256 features a step; or a Hugging Face Llama or GPT-2 (4 layers,
width 128, 64 tokens, labels into the model) with AdamW (foreach, as a GPU runs it), 16 samples a step. Each
case runs ``AutoPartitionStrategy(num_stages=2, micro_batches=M, schedule=S, profile="estimate")`` under
Lightning's launcher (2 CPU processes). Measured: each rank's peak tensor bytes over training batches 2-4
(``tests.step_peak.StepPeak``: the stage's parameters, gradients and optimizer state, the batch and
torch.distributed.pipelining's receive buffers at the step's start, plus every storage the step creates).
Predicted: the plan's ``memory_bytes`` of the rank's stage, summed over its chunks under Interleaved1F1B
(``--parts``: its parts too). Prints one row per rank
and case ([Note: pipeline buffers] in partition/cost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The plan's parts of a stage's memory, as ``--parts`` prints them.
_PARTS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "transient_bytes", "io_bytes")


def _causal_lm(transformers: Any, name: str) -> Any:
    """A small Llama or GPT-2 (4 layers, width 128, 64 tokens, no dropout, no cache). Every head has its own
    keys and values: a GPU runs grouped float32 heads on the math path and the CPU fused, so the CPU would not
    check what the plan prices."""
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, use_cache=False,
        ))  # fmt: skip
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1000, n_positions=64, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False,
        ))  # fmt: skip
    raise SystemExit(f"unknown --model {name!r}; use mlp, llama or gpt2")


def _rank(
    model_name: str, schedule: str, micro: int, batch: int, out: Path, precision: str = "32-true", spec: str = ""
) -> None:
    """One case, run by Lightning's launcher on every rank: writes this rank's row as JSON into ``out``."""
    import dataclasses
    import warnings

    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    from lightning_autopart import AutoPartitionStrategy
    from tests.step_peak import StepPeak, stage_buffers

    warnings.filterwarnings("ignore")
    if spec:  # the spec a CPU job's estimate prices (the strategy's default is a GPU's: its kernels and lists)
        import lightning_autopart.lightning.first_batch as first_batch

        first_batch._ESTIMATE_SPEC = spec

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            blocks = [(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(8)]
            self.layers = nn.Sequential(*[m for block in blocks for m in block])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, b: list[torch.Tensor], i: int) -> torch.Tensor:
            return F.mse_loss(self(b[0]), b[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4, foreach=True)

    class CausalLM(L.LightningModule):
        """A Hugging Face causal LM trained as its users train it: the labels go in, ``.loss`` comes out."""

        def __init__(self, name: str) -> None:
            super().__init__()
            import transformers

            torch.manual_seed(0)
            self.model = _causal_lm(transformers, name)

        def training_step(self, b: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            return self.model(**b).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)

    if model_name == "mlp":
        module: L.LightningModule = MLP()
        data: Any = TensorDataset(torch.randn(batch * 6, 256), torch.randn(batch * 6, 256))
    else:
        module = CausalLM(model_name)
        ids = torch.randint(3, 1000, (batch * 6, 64))
        data = [{"input_ids": t, "labels": t} for t in ids]
    strategy = AutoPartitionStrategy(num_stages=2, micro_batches=micro, schedule=schedule, profile="estimate")
    probe = StepPeak(2, 5, extra=lambda trainer: stage_buffers(strategy._runner._schedules.values()))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe], precision=precision,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=batch))
    assert strategy.plan is not None
    held = [s for s in strategy.plan.stages if trainer.global_rank in s.ranks]  # interleaved: several chunks
    row: dict[str, Any] = {
        "rank": trainer.global_rank,
        "measured": max(probe.peaks),
        "predicted": sum(s.memory_bytes for s in held),
        "parts": {k: sum(dataclasses.asdict(s)[k] for s in held) for k in _PARTS},
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["1F1B:4", "1F1B:8", "GPipe:4", "Interleaved1F1B:4"])
    parser.add_argument("--batch", type=int, default=None, help="samples a step (mlp: 1024; others: 16)")
    parser.add_argument("--model", default="mlp", choices=("mlp", "llama", "gpt2"))
    parser.add_argument("--parts", action="store_true", help="print each prediction's parts (MB)")
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision (bf16-mixed: autocast)")
    parser.add_argument("--spec", default="", help="the device spec estimate mode prices (default: the strategy's "
                        "a100-40gb; cpu: the CPU's attention kernels and autocast lists, which the ranks run)")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: one case, under Lightning's launcher
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch = args.batch or (1024 if args.model == "mlp" else 16)
    if args.rank_of:
        schedule, micro = args.rank_of.split(":")
        _rank(args.model, schedule, int(micro), args.batch, Path(args.out), args.precision, args.spec)
        return []
    print("| schedule | micro-batches | rank | predicted MB | measured MB | predicted / measured |")
    print("|---|---:|---:|---:|---:|---:|")
    rows: list[dict[str, Any]] = []
    for case in args.cases:
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + len(rows)))
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, __file__, "--rank-of", case, "--batch", str(args.batch), "--out", out]
            command += ["--model", args.model, "--precision", args.precision, "--spec", args.spec]
            subprocess.run(command, env=env, capture_output=True, timeout=300, check=False)
            found = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        schedule, micro = case.split(":")
        if len(found) < 2:
            print(f"| {schedule} | {micro} | the job failed: rerun `python {__file__} --rank-of {case} --out DIR` |")
        for found_row in found:
            row = {"schedule": schedule, "micro": int(micro), **found_row}
            rows.append(row)
            ratio = row["predicted"] / row["measured"]
            print(
                f"| {schedule} | {micro} | {row['rank']} | {row['predicted'] / 1e6:.2f} | "
                f"{row['measured'] / 1e6:.2f} | {ratio:.3f} |",
                flush=True,
            )
            if args.parts:
                print("    " + ", ".join(f"{k.removesuffix('_bytes')} {v / 1e6:.2f}" for k, v in row["parts"].items()))
    return rows


if __name__ == "__main__":
    main()
