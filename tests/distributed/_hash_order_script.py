"""Ranks whose forward runs in another order: each process has its own string hash seed, as when
PYTHONHASHSEED is unset, and the models loop over a set of strings (see [Note: rank-independent values]).

Usage: ``python tests/distributed/_hash_order_script.py OUT CHILD_SEED`` under Lightning's launcher (2 devices):
rank 0 runs with the launch's PYTHONHASHSEED and gives rank 1 ``CHILD_SEED``. It trains :class:`Tables` (the
order changes nothing but the graph's node names) and writes ``OUT/rank{r}.pt``, then :class:`Heads` on two
replicas (``OUT/heads{r}.pt``), then fits :class:`Branches` (the order changes the blocks), which every rank
must refuse: ``OUT/rank{r}.txt`` holds the error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

__all__ = ["KINDS", "STEPS", "Branches", "Heads", "Tables", "fit"]

#: Kinds of tables (as Gemma 3's layer types); the order of ``set(KINDS)`` follows the hash seed.
KINDS = ("sliding", "full", "chunked", "local", "wide", "dilated")
STEPS, BATCH = 3, 8


class Tables(nn.Module):
    """Like Gemma 3: one table per kind, computed in a loop over a set, each layer reading its kind's; the tables
    have one shape, so a pipeline that swapped two would train a different model without an error."""

    def __init__(self, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        for i, kind in enumerate(KINDS):
            self.register_buffer(f"{kind}_freq", torch.linspace(0.1, 2.0, width) * (i + 1))
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        tables = {}
        for kind in set(KINDS):
            tables[kind] = torch.cos(getattr(self, f"{kind}_freq"))
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h) * tables[KINDS[i]])
        return self.head(h)


class Heads(nn.Module):
    """Heads of one shape run in set order, summed in a fixed one: the same function on every rank, but each
    stage's parameters and backward come in another order (replicas must still reduce alike)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.heads = nn.ModuleDict({kind: nn.Linear(width, 1) for kind in KINDS})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        outs = {kind: self.heads[kind](h) for kind in set(KINDS)}
        return sum((outs[kind] * (i + 1) / len(KINDS) for i, kind in enumerate(KINDS)), torch.zeros(()))


class Branches(nn.Module):
    """Branches applied one after another in set order: another function on each rank, so other blocks."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.branches = nn.ModuleDict({kind: nn.Linear(width, width) for kind in KINDS[:4]})
        self.embed = nn.Linear(8, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for kind in set(KINDS[:4]):
            h = torch.tanh(self.branches[kind](h))
        return self.head(h)


class _Lit(L.LightningModule):
    def __init__(self, model: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = model()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = (self.model(batch[0]) - batch[1]).square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    model: type[nn.Module], strategy: Any, devices: int, replicas: int = 1
) -> tuple[nn.Module, list[float]]:
    """Fit ``model`` for :data:`STEPS` steps of :data:`BATCH` samples per replica; the module and the logged
    losses. The reference (``strategy="auto"``, one process) takes the replicas' batches as one, in the order
    Lightning's ``DistributedSampler(shuffle=True, seed=0)`` deals them."""
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    g, n = torch.Generator().manual_seed(1), STEPS * BATCH * replicas
    data: Dataset[Any] = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    batch = BATCH
    if strategy == "auto":
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
        shards = [perm[r::replicas] for r in range(replicas)]
        order = [i for k in range(STEPS) for shard in shards for i in shard[k * BATCH : (k + 1) * BATCH]]
        data, batch = Subset(data, order), BATCH * replicas
    lit = _Lit(model)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()],
    )  # fmt: skip
    trainer.fit(lit, DataLoader(data, batch_size=batch))
    return lit.model, losses


def main() -> None:
    from lightning_autopart.errors import ConfigError
    from lightning_autopart.lightning.strategy import AutoPartitionStrategy
    from lightning_autopart.runtime import buckets

    out, child_seed = Path(sys.argv[1]), sys.argv[2]
    if "LOCAL_RANK" not in os.environ:  # rank 0, before Lightning's launcher starts rank 1 with this environment
        os.environ["PYTHONHASHSEED"] = child_seed
    torch.set_num_threads(1)
    strategy = AutoPartitionStrategy(num_stages=2, micro_batches=4, schedule="Interleaved1F1B", profile="estimate")
    model, losses = fit(Tables, strategy, 2)
    rank = strategy.global_rank
    local = {id(p) for p in strategy._params}
    params = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in local}
    torch.save({"losses": losses, "params": params, "order": list(set(KINDS))}, out / f"rank{rank}.pt")
    # Two replicas, each head's gradient in a bucket of its own, readied in each rank's backward order.
    buckets.FIRST_BUCKET_BYTES = buckets.BUCKET_BYTES = 17 * 4
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate")
    model, losses = fit(Heads, strategy, 2, replicas=2)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"losses": losses, "params": params}, out / f"heads{rank}.pt")
    try:
        fit(Branches, AutoPartitionStrategy(num_stages=2, micro_batches=2, profile="estimate"), 2)
        (out / f"rank{rank}.txt").write_text("no error")
    except ConfigError as error:
        (out / f"rank{rank}.txt").write_text(str(error))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
