"""The strategy's checkpoint hooks for one rank's stages: entries keyed by original names, sharded or one file.

See :mod:`lightning_autopart.runtime.checkpoint` for the format. ``"sharded"`` (the default) writes a
``torch.distributed.checkpoint`` directory from every rank; ``"full"`` gathers everything on rank 0 and writes
one file that plain Lightning loads. Both load under any plan, and plain Lightning checkpoints load too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch import Tensor, nn

from lightning_autopart.errors import CheckpointError, ConfigError
from lightning_autopart.runtime.checkpoint import (
    METADATA_FILE,
    held_state,
    load_optimizer_by_name,
    load_sharded,
    optimizer_by_name,
    remove_path,
    replace_atomically,
    save_sharded,
)

__all__ = ["CHECKPOINT_MODES", "CheckpointHooks", "StageCheckpoints"]

#: What ``AutoPartitionStrategy(checkpoint=...)`` accepts.
CHECKPOINT_MODES = ("sharded", "full")


class StageCheckpoints:
    """Saves and loads ``module``'s checkpoints on this rank, whose stages hold the non-meta tensors.

    ``record`` must see the optimizers before they are cut down to this rank's parameters: their groups, by
    parameter name, are what every checkpoint lists, so any plan (or a plain optimizer) reads them.
    """

    def __init__(self, mode: str, rank: int, world_size: int, writes_model: bool = True) -> None:
        if mode not in CHECKPOINT_MODES:
            raise ConfigError(f"unknown checkpoint mode {mode!r}; use one of: {', '.join(CHECKPOINT_MODES)}")
        self.mode = mode
        self.rank = rank
        self.world_size = world_size
        #: Whether this rank's model entries go into a full checkpoint (the first replica of its stages).
        self.writes_model = writes_model
        self.names: dict[int, str] = {}
        self.groups: list[list[list[str]]] = []

    def record(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Remember every parameter's name and each optimizer's groups as configured (the whole model)."""
        self.names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
        self.groups = [[[self.names[id(p)] for p in g["params"]] for g in o.param_groups] for o in optimizers]

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        """The model entries of a checkpoint: this rank's (sharded) or everyone's on rank 0 (full)."""
        held = held_state(module.state_dict())
        if self.mode == "sharded" or not self._distributed():
            return held
        mine = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in held.items()}
        return self._gather_union(mine if self.writes_model else {})

    def optimizer_state(self, optimizer: torch.optim.Optimizer, index: int) -> dict[str, Any]:
        """Optimizer ``index``'s entries keyed by parameter name: this rank's, or everyone's on rank 0 (full)."""
        state = optimizer_by_name(optimizer, self.names, self.groups[index])
        if self.mode == "sharded" or not self._distributed():
            return state
        entries = {k: _to_cpu(v) for k, v in state["state"].items()} if self.writes_model else {}
        return {"state": self._gather_union(entries), "param_groups": state["param_groups"]}

    def save(self, checkpoint: dict[str, Any], path: Path, write_file: Any) -> None:
        """Write ``checkpoint`` at ``path`` atomically; every rank calls it. ``write_file(dict, path)`` writes a
        single file (the strategy's CheckpointIO).

        Whatever is at ``path`` is replaced (a file, or a sharded checkpoint directory), except a directory that
        is not a checkpoint: it is refused, as Lightning's own strategies do, not deleted."""
        if path.is_dir() and not (path / METADATA_FILE).is_file() and any(path.iterdir()):
            raise CheckpointError(
                f"cannot save a checkpoint at {path}: it is a directory that is not a checkpoint (no "
                f"{METADATA_FILE}), and saving would replace it with everything in it; choose another path"
            )
        if self.mode == "sharded":
            save_sharded(checkpoint, path, self.rank)
            return

        def write(partial: Path) -> None:
            if self.rank == 0:
                write_file(checkpoint, partial)

        replace_atomically(path, write, self.rank)

    def load(self, path: Path, module: nn.Module, read_file: Any) -> dict[str, Any]:
        """The checkpoint at ``path`` (a sharded directory: this rank's entries only; a file: all of it)."""
        if path.is_dir():
            keys = held_state(module.state_dict()).keys()
            local = [n for n, p in module.named_parameters() if p.device.type != "meta"]
            return load_sharded(path, keys, local)
        checkpoint: dict[str, Any] = read_file(path)
        return checkpoint

    def load_model(self, module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> None:
        """Copy the entries this rank holds from ``state`` (keyed as ``module.state_dict()``)."""
        current = module.state_dict(keep_vars=True)
        held = held_state(current)
        missing = sorted(k for k in held if k not in state)
        if strict and missing:
            raise CheckpointError(
                f"the checkpoint has no entry for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                "it is for another model (or pass strict=False to load what matches)"
            )
        unexpected = sorted(k for k in state if k not in current)
        if strict and unexpected:
            raise CheckpointError(
                f"the checkpoint has entries this model lacks: {', '.join(unexpected[:5])}; it is for another "
                "model (or pass strict=False)"
            )
        with torch.no_grad():
            for key, tensor in held.items():
                if key not in state or not isinstance(tensor, Tensor):
                    continue
                value = state[key]
                if tuple(value.shape) != tuple(tensor.shape):
                    raise CheckpointError(
                        f"{key} has shape {tuple(value.shape)} in the checkpoint, {tuple(tensor.shape)} in the "
                        "model; the checkpoint is for another model configuration"
                    )
                tensor.copy_(value)

    def load_optimizers(self, optimizers: Iterable[torch.optim.Optimizer], states: list[dict[str, Any]]) -> None:
        """Load each optimizer's entries for this rank's parameters, by name."""
        optimizers = list(optimizers)
        if len(states) != len(optimizers):
            raise CheckpointError(
                f"the checkpoint has {len(states)} optimizer states, configure_optimizers returns "
                f"{len(optimizers)}; resume with the configure_optimizers it was written with"
            )
        for index, (optimizer, saved) in enumerate(zip(optimizers, states, strict=True)):
            load_optimizer_by_name(optimizer, saved, self.names, self.groups[index])

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    def _gather_union(self, entries: dict[str, Any]) -> dict[str, Any]:
        parts: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(entries, parts, dst=0)
        merged: dict[str, Any] = {}
        for part in parts or ():
            merged.update(part)
        return merged


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


class CheckpointHooks:
    """The Strategy's checkpoint methods, over a :class:`StageCheckpoints` set up in ``setup``."""

    _checkpoints: StageCheckpoints | None
    checkpoint_io: Any
    optimizers: list[Any]
    is_global_zero: bool
    _lm: Any

    if TYPE_CHECKING:

        @property
        def root_device(self) -> torch.device: ...

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load after partitioning: each rank reads only its own stages' entries."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's entries by name: this rank's stages (sharded) or the whole model on rank 0 (full)."""
        if self._checkpoints is None:
            return self._lm.state_dict()
        return self._checkpoints.model_state(self._lm)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self._checkpoints is None:
            state: dict[str, Any] = optimizer.state_dict()
            return state
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        return self._checkpoints.optimizer_state(optimizer, index)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write atomically: a sharded directory from every rank, or one file from rank 0 (``checkpoint``)."""
        if storage_options is not None:
            raise ConfigError("AutoPartitionStrategy.save_checkpoint takes no storage_options; drop them")
        assert self._checkpoints is not None, "save_checkpoint before setup"
        self._checkpoints.save(checkpoint, Path(filepath), self.checkpoint_io.save_checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self._checkpoints is not None, "load_checkpoint before setup"
        return self._checkpoints.load(
            Path(checkpoint_path),
            self._lm,
            # Lightning 2.5's checkpoint IO takes no ``weights_only`` (2.6 added it, and passes it only when set).
            lambda path: self.checkpoint_io.load_checkpoint(
                path, **({} if weights_only is None else {"weights_only": weights_only})
            ),
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self._checkpoints is not None
        self._checkpoints.load_model(self._lm, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self._checkpoints is not None
        self._checkpoints.load_optimizers(self.optimizers, list(checkpoint["optimizer_states"]))
        _optimizers_to_device(self.optimizers, self.root_device)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(Path(filepath))
