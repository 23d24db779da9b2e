"""Checkpoints of a pipelined model, keyed by the original names, so any plan (or one process) reads any other's.

Each rank holds only its stages' tensors (the others' live on the ``meta`` device, see :func:`free_elsewhere`).
A *sharded* checkpoint is a ``torch.distributed.checkpoint`` directory laid out as Lightning's own sharded
checkpoints: ``{"model": state, "optimizer_0": ..., ...}`` written by every rank, and ``meta.pt`` holding the
rest (loops, schedulers, callbacks), so ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` and
``autopart consolidate`` turn it into one file. Optimizer state is keyed by parameter name, with each group
listing every parameter of the model (across stages) in the user's order: a plan with other stages reads the
entries of its own parameters, and a plain optimizer over the whole model loads the consolidated file
(``Optimizer.load_state_dict`` pairs saved and current parameters by position).

Saves are atomic: everything is written under a hidden sibling name and renamed into place at the end.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_autopart.errors import CheckpointError

__all__ = [
    "METADATA_FILE",
    "consolidate",
    "free_elsewhere",
    "held_state",
    "load_optimizer_by_name",
    "load_sharded",
    "optimizer_by_name",
    "remove_path",
    "replace_atomically",
    "save_sharded",
]

#: The file of a sharded checkpoint holding everything but model and optimizer tensors (Lightning's name).
METADATA_FILE = "meta.pt"


def free_elsewhere(module: nn.Module, drop: set[int]) -> None:
    """Replace every parameter and buffer of ``module`` whose id is in ``drop`` (other ranks' stages hold them)
    by a ``meta`` tensor.

    Shapes stay (a model summary still counts the whole model) and no memory is held; a parameter shared by
    several modules stays one (meta) parameter. Held tensors are untouched.
    """
    freed: dict[int, Any] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None or id(t) not in drop or t.device.type == "meta":
                    continue
                if id(t) not in freed:
                    empty = torch.empty_like(t, device="meta")
                    freed[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                table[name] = freed[id(t)]


def held_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``state`` this rank holds: everything but ``meta`` tensors."""
    return {k: v for k, v in state.items() if not (isinstance(v, Tensor) and v.device.type == "meta")}


def optimizer_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], groups: Sequence[Sequence[str]]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name (``names``: id -> name), each group listing the names
    of ``groups`` (every parameter it was configured with, across all stages)."""
    saved = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {names[id(params[i])]: v for i, v in saved["state"].items()}
    if len(groups) != len(saved["param_groups"]):
        raise CheckpointError(
            f"the optimizer has {len(saved['param_groups'])} parameter groups, {len(groups)} were recorded at "
            "setup; do not add parameter groups after configure_optimizers"
        )
    param_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(full)}
        for g, full in zip(saved["param_groups"], groups, strict=True)
    ]
    return {"state": state, "param_groups": param_groups}


def load_optimizer_by_name(
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    names: Mapping[int, str],
    groups: Sequence[Sequence[str]],
) -> None:
    """Load ``saved`` into ``optimizer`` (over this rank's parameters): the entries of its parameters only.

    ``saved`` is keyed by parameter name (autopart) or by position over the whole model (a plain Lightning
    checkpoint); either way its groups list every parameter, in the order of ``groups``.
    """
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one {len(groups)}; "
            "resume with the configure_optimizers the checkpoint was written with"
        )
    key_name: dict[Any, str] = {}
    for index, (group, full) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(group["params"]) != len(full):
            raise CheckpointError(
                f"parameter group {index} of the checkpoint's optimizer has {len(group['params'])} parameters, "
                f"this model's has {len(full)}; the checkpoint is for another model or configure_optimizers"
            )
        key_name.update(zip(group["params"], full, strict=True))
    by_name = {key_name[k]: v for k, v in saved["state"].items() if k in key_name}
    current = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {i: by_name[names[id(p)]] for i, p in enumerate(params) if names[id(p)] in by_name}
    param_groups = [
        {**{k: v for k, v in s.items() if k != "params"}, "params": c["params"]}
        for s, c in zip(saved_groups, current["param_groups"], strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def replace_atomically(path: Path, write: Callable[[Path], None], rank: int = 0) -> None:
    """Run ``write(partial)`` then move ``partial`` to ``path`` (on rank 0): a kill midway leaves the previous
    ``path`` intact and nothing partial under its name. ``write`` may be collective: every rank calls this."""
    partial = path.with_name(f".{path.name}.partial")
    distributed = dist.is_available() and dist.is_initialized()
    if rank == 0:
        remove_path(partial)
        path.parent.mkdir(parents=True, exist_ok=True)
    if distributed:
        dist.barrier()
    write(partial)
    if distributed:
        dist.barrier()
    if rank == 0:
        old = path.with_name(f".{path.name}.old")
        remove_path(old)
        if path.exists():
            os.replace(path, old)
        os.replace(partial, path)
        remove_path(old)
    if distributed:
        dist.barrier()


def save_sharded(checkpoint: dict[str, Any], path: Path, rank: int) -> None:
    """Write a Lightning checkpoint dict as a sharded checkpoint directory at ``path`` (every rank calls it).

    ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]`` hold this rank's entries (see
    :func:`held_state`, :func:`optimizer_by_name`); the rest must be equal on every rank (rank 0 writes it).
    """
    import torch.distributed.checkpoint as dcp

    rest = dict(checkpoint)
    tensors: dict[str, Any] = {"model": rest.pop("state_dict")}
    for i, state in enumerate(rest.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state

    def write(partial: Path) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        dcp.save(tensors, checkpoint_id=partial, no_dist=not distributed)
        if rank == 0:
            torch.save(rest, partial / METADATA_FILE)

    replace_atomically(path, write, rank)


def load_sharded(
    path: Path, model_keys: Iterable[str] | None = None, param_names: Iterable[str] | None = None
) -> dict[str, Any]:
    """The Lightning checkpoint dict of a sharded checkpoint, with only the tensors this rank needs: the model
    entries ``model_keys`` and the optimizer entries of ``param_names`` (None: all). Reads without any
    collective."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(
            f"{path} is a directory without {METADATA_FILE}: not a sharded checkpoint; give a directory written "
            "by AutoPartitionStrategy(checkpoint='sharded') or Lightning's sharded strategies"
        )
    wanted_model = None if model_keys is None else set(model_keys)
    wanted_params = None if param_names is None else set(param_names)
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    keys = {flat for flat, where in (metadata.planner_data or {}).items() if _wanted(where, wanted_model, wanted_params)}
    loaded: dict[str, Any] = {}
    if keys:
        # The planner rebuilds the nested entries from the metadata into ``loaded`` (as Lightning's own
        # consolidation does); only ``keys`` are read.
        _load_state_dict(loaded, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    checkpoint: dict[str, Any] = torch.load(path / METADATA_FILE, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = loaded.get("model", {})
    optimizers = sorted((k for k in loaded if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    for name in optimizers:
        loaded[name].setdefault("state", {})
    if optimizers:
        checkpoint["optimizer_states"] = [loaded[k] for k in optimizers]
    return checkpoint


def consolidate(path: Path, output: Path, overwrite: bool = False) -> dict[str, Any]:
    """Turn the sharded checkpoint at ``path`` into one file ``output`` that ``torch.load`` and
    ``LightningModule.load_from_checkpoint`` read on one process; returns the checkpoint dict.

    An existing ``output`` is refused, or replaced atomically with ``overwrite`` (``autopart consolidate --force``).
    """
    if not path.is_dir():
        what = "is a file, not a sharded checkpoint directory (it is one file already)" if path.exists() else (
            "does not exist"
        )
        raise CheckpointError(f"checkpoint {path} {what}; give the directory a sharded checkpoint was saved to")
    if output.is_dir() or output.resolve() == path.resolve():
        raise CheckpointError(f"output {output} is a directory; give a file path, e.g. {path.name}.consolidated")
    if output.exists() and not overwrite:
        raise CheckpointError(f"output {output} exists; choose another path, or replace it (--force)")
    checkpoint = load_sharded(path)
    replace_atomically(output, lambda partial: torch.save(checkpoint, partial))
    return checkpoint


def _wanted(where: tuple[Any, ...], model: set[str] | None, params: set[str] | None) -> bool:
    """Whether the entry at path ``where`` is a wanted model entry, an optimizer group, or a wanted optimizer
    state (None: every entry of that kind)."""
    head = str(where[0])
    if head == "model":
        return model is None or where[1] in model
    if not head.startswith("optimizer_"):
        return False
    return where[1] != "state" or params is None or where[2] in params


def remove_path(path: Path) -> None:
    """Remove a checkpoint: a file or a sharded directory."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
