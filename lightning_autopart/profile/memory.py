"""Static memory of each block: parameters, gradients, optimizer state and buffers, tied ones at first use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.profile.records import TiedParam

__all__: list[str] = []


@dataclass(frozen=True, slots=True)
class BlockMemory:
    """State owned by one block (tied tensors belong to the first block that uses them)."""

    param_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    #: Gradient bytes and tensors the optimizer steps: the trainable parameters the loss reaches (one that only
    #: blocks with no live output use gets no gradient, and the optimizer skips it and keeps no state for it).
    stepped_bytes: int = 0
    #: Bytes of the trainable parameters no live block uses (their gradients are never made).
    unreached_grad_bytes: int = 0
    stepped_tensors: int = 0


@dataclass(frozen=True, slots=True)
class _State:
    name: str
    shape: tuple[int, ...]
    nbytes: int
    trainable: bool


def _state_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    size = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
    return t.numel() * size


def account_memory(
    captured: CapturedModel, param_dtype: torch.dtype | None, optimizer_factor: float
) -> tuple[list[BlockMemory], tuple[TiedParam, ...]]:
    """Per-block parameter/gradient/optimizer/buffer bytes and the list of tied parameters.

    A tensor is identified by object identity, so two FQNs of one tied tensor count once; a parameter the
    module does not expose under a block's FQN falls back to ``captured.param_shapes``.
    """
    params = dict(captured.module.named_parameters(remove_duplicate=False))
    buffers = dict(captured.module.named_buffers(remove_duplicate=False))
    fallback_size = (param_dtype or torch.float32).itemsize

    def resolve(name: str, table: Mapping[str, torch.Tensor], is_param: bool) -> tuple[object, _State]:
        t = table.get(name)
        if t is not None:
            trainable = bool(t.requires_grad) if is_param else False
            return id(t), _State(name, tuple(t.shape), _state_bytes(t, param_dtype), trainable)
        shape = tuple(captured.param_shapes.get(name, ()))
        return ("fqn", name), _State(name, shape, _numel(shape) * fallback_size, is_param)

    users: dict[object, list[int]] = {}
    states: dict[object, _State] = {}
    order: list[list[object]] = [[] for _ in captured.blocks]  # parameter keys in first-seen order
    buffer_order: list[list[object]] = [[] for _ in captured.blocks]

    def note(pos: int, key: object, state: _State, keys: list[object]) -> None:
        states.setdefault(key, state)
        if pos not in users.setdefault(key, []):
            users[key].append(pos)
        if key not in keys:
            keys.append(key)

    for pos, block in enumerate(captured.blocks):
        for name in block.params:
            note(pos, *resolve(name, params, True), order[pos])
        for name in block.buffers:
            note(pos, *resolve(name, buffers, False), buffer_order[pos])
    for name, used_by in captured.tied.items():  # the capture's own record of sharing, if any is missing
        for pos in used_by:
            if 0 <= pos < len(order):
                note(pos, *resolve(name, params, True), order[pos])

    owner = {key: min(blocks) for key, blocks in users.items() if blocks}
    # a block whose every output is dead (Block.dead_outputs), or that has none, passes no gradient to its
    # parameters: no optimizer state, and a gradient buffer only in replicas' buckets ([Note: unreached
    # gradients] in partition/fresh.py)
    dead = {pos for pos, b in enumerate(captured.blocks) if len(b.dead_outputs) == len(b.outputs)}
    memory = []
    for pos in range(len(captured.blocks)):
        keys = [k for k in order[pos] if owner[k] == pos]
        owned = [states[k] for k in keys]
        param_bytes = sum(s.nbytes for s in owned)
        trainable = sum(s.nbytes for s in owned if s.trainable)
        stepped = [states[k] for k in keys if states[k].trainable and not dead.issuperset(users[k])]
        numels = [_numel(s.shape) for s in owned]
        memory.append(
            BlockMemory(
                param_shapes=tuple((s.name, s.shape) for s in owned),
                param_count=sum(numels),
                param_bytes=param_bytes,
                grad_bytes=trainable,
                optimizer_bytes=int(sum(s.nbytes for s in stepped) * optimizer_factor),
                buffer_bytes=sum(states[k].nbytes for k in buffer_order[pos] if owner[k] == pos),
                stepped_bytes=sum(s.nbytes for s in stepped),
                stepped_tensors=len(stepped),
                unreached_grad_bytes=trainable - sum(s.nbytes for s in stepped),
            )
        )
    param_keys = {k for keys in order for k in keys}
    tied = tuple(
        TiedParam(states[k].name, states[k].nbytes, tuple(sorted(users[k])))
        for k in sorted(param_keys, key=lambda k: (owner[k], states[k].name))
        if len(users[k]) > 1
    )
    return memory, tied


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
