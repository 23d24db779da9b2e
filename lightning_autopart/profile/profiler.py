"""The ``profile`` entry point: a captured model in, one flat :class:`ModelProfile` record per block out."""

from __future__ import annotations

import dataclasses
import itertools
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.capture.strays import strays_on_meta
from lightning_autopart.devices import DeviceSpec, device_spec, tf32_convolutions, tf32_matmuls
from lightning_autopart.errors import ConfigError, ProfileError
from lightning_autopart.profile.autocast_cuts import with_autocast_dtypes
from lightning_autopart.profile.calibrate import calibrate_cpu
from lightning_autopart.profile.cuda_spec import local_cuda_spec
from lightning_autopart.profile.estimate import estimate_block, estimate_curve
from lightning_autopart.profile.hints import failure_hint, warn_opaque
from lightning_autopart.profile.measure import BlockFailed, measure_blocks
from lightning_autopart.profile.memory import BlockMemory, account_memory
from lightning_autopart.profile.opcount import Roofline
from lightning_autopart.profile.optimizers import optimizer_state_factor
from lightning_autopart.profile.precision import Precision, parse_precision, scaled_nbytes
from lightning_autopart.profile.records import BlockProfile, ModelProfile, with_curve
from lightning_autopart.profile.runner import BlockCost
from lightning_autopart.profile.saves import with_shared_saves
from lightning_autopart.profile.step import accumulate_us, optimizer_step_us

__all__ = ["profile", "resolve_spec"]

_MODES = ("measure", "estimate")


def resolve_spec(spec: str | DeviceSpec | None, device: torch.device | None = None) -> DeviceSpec:
    """A spec object from a name ("cpu" means :func:`calibrate_cpu`), or the one matching ``device`` if None.

    Raises:
        ConfigError: the name is not a known spec.
    """
    if isinstance(spec, DeviceSpec):
        return spec
    if spec is None:
        if device is not None and device.type == "cuda":  # [Note: derived device specs] in cuda_spec.py
            return local_cuda_spec(torch.cuda.get_device_properties(device))
        return calibrate_cpu()
    if spec.strip().lower() == "cpu":
        return calibrate_cpu()
    return device_spec(spec)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"cannot parse device {device!r}: {err}") from err
    if dev.type == "meta":
        raise ConfigError(
            "measure mode needs a real device, not 'meta'; use mode='estimate' to profile on meta"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _block_indices(blocks: Sequence[int] | None, num_blocks: int) -> list[int]:
    if blocks is None:
        return list(range(num_blocks))
    bad = [b for b in blocks if not isinstance(b, int) or not 0 <= b < num_blocks]
    if bad:
        raise ConfigError(f"blocks {bad} out of range; the captured model has blocks 0..{num_blocks - 1}")
    return sorted(set(blocks))


def profile(
    captured: CapturedModel,
    mode: str = "measure",
    *,
    device: str | torch.device | None = None,
    spec: str | DeviceSpec | None = None,
    optimizer: str = "sgd",
    dtype: str | None = None,
    warmup: int = 2,
    repeats: int = 5,
    blocks: Sequence[int] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    twin: CapturedModel | None = None,
    sizes: Sequence[int] = (),
) -> ModelProfile:
    """Profile every block (or the ``blocks`` subset) of a captured model, on copies; the model is untouched.

    Args:
        captured: The model as blocks, from :func:`lightning_autopart.capture.capture`.
        mode: "measure" times each block on ``device``; "estimate" runs it on meta tensors and prices every
            aten op with a roofline of ``spec`` (no real compute or memory).

    Keyword Args:
        device: Where "measure" runs (default: the current CUDA device, else "cpu").
        spec: Device spec for "estimate" ("a100-40gb", ...; "cpu" probes this machine). Default: the spec
            matching ``device`` (by CUDA device name; "cpu" without CUDA). In "measure" it only supplies
            the per-kernel launch cost of the fixed-time model.
        optimizer: Optimizer whose state ``optimizer_bytes`` counts ("sgd", "sgd_momentum", "adam", ...).
        dtype: Parameter/compute dtype ("bfloat16", "float16", Lightning's "bf16-mixed", ...); default: the
            parameters' own dtype.
        warmup: Untimed forward+backward runs before timing ("measure").
        repeats: Timed runs; times are their median ("measure").
        blocks: Block indices to profile. The result is partial: ``blocks`` holds only those records and
            ``meta["profiled_blocks"]`` their indices; :func:`merge_profiles` joins the parts of all ranks.
        progress: Called as ``progress(done, total, block_name)`` after each block.
        twin: "estimate" only: the same model captured at another batch size. Every block then gets a cost
            curve with a point at each of ``sizes`` (see :func:`estimate_curve`), and the profile's batch
            size and per-block figures are those of the largest size.
        sizes: The batch sizes of the curves (with ``twin``).

    Returns:
        The profile at ``captured.batch_size``. ``meta`` holds ``num_blocks``, ``profiled_blocks``,
        ``input_shapes``/``input_dtypes``, ``compute_dtype``, the settings (``warmup``, ``repeats``,
        ``timer``, ``launch_us``, or the spec's figures) and ``per_block``: for each record, its ``index``,
        ``fwd_kernels``/``bwd_kernels``, ``bwd_flops``, and ``saved_input_bytes``/``saved_output_bytes``,
        the parts of ``activation_bytes`` that are the block's own inputs/outputs (two neighbouring blocks
        in one stage may both save the tensor that crosses between them; a planner can count it once).

    Raises:
        ConfigError: unknown mode, spec, optimizer, dtype or device, or block indices out of range.
        ProfileError: a block failed to run; the message names the block and the original error.
    """
    if mode not in _MODES:
        raise ConfigError(f"unknown profile mode {mode!r}; use 'measure' or 'estimate'")
    if twin is not None and (mode != "estimate" or not sizes):
        raise ConfigError("a twin capture gives cost curves in estimate mode only, and needs sizes")
    if warmup < 0 or repeats < 1:
        raise ConfigError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    factor = optimizer_state_factor(optimizer)
    precision = parse_precision(dtype, captured.module)
    indices = _block_indices(blocks, captured.num_blocks)
    memory, tied = account_memory(captured, precision.param, factor)
    meta: dict[str, Any] = {
        "num_blocks": captured.num_blocks,
        "profiled_blocks": indices,
        "input_shapes": [list(t.shape) for t in captured.inputs],
        "input_dtypes": [t.dtype for t in captured.inputs],
        "compute_dtype": precision.compute_name,
        "torch": torch.__version__,
        "tf32_matmuls": tf32_matmuls(),  # float32 products on TF32 tensor cores (estimates assume what torch does)
        "tf32_convolutions": tf32_convolutions(),
    }
    rng_devices: list[torch.device] = []
    if mode == "measure":
        dev = _resolve_device(device)
        rng_devices = [dev] if dev.type == "cuda" else []
        chosen = resolve_spec(spec, dev)
        device_name = str(dev)
        gpu = dev.type == "cuda"
        kernels = "cuda" if gpu else "cpu"  # whose autocast lists the cuts follow: the device measured
        meta.update(
            warmup=warmup, repeats=repeats, timer="cuda_event" if dev.type == "cuda" else "perf_counter"
        )
        meta.update(launch_spec=chosen.name, launch_us=chosen.launch_us)
    else:
        on_meta = device is not None and str(device).startswith("meta")
        chosen = resolve_spec(spec, None if spec is not None or on_meta else _resolve_device(device))
        gpu = chosen.name != "cpu"
        roofline = Roofline.of(chosen, precision.compute_name, waves=True)
        kernels = roofline.kernels  # the device priced
        device_name = chosen.name
        meta.update(
            spec=chosen.name,
            peak_flops=chosen.peak_flops(precision.compute_name),
            flops_efficiency=chosen.flops_efficiency,
            memory_bw=chosen.memory_bw,
            bw_efficiency=chosen.bw_efficiency,
            launch_us=chosen.launch_us,
        )

    # a model built on meta with a few tensors elsewhere runs as wholly on meta ([Note: tensors the meta device
    # missed] in capture/strays.py): its blocks, and the autocast dtypes of its cuts
    with strays_on_meta(captured.module):
        cut_dtype = precision.compute  # the dtype cuts are held in (None: each one's own)
        if precision.mixed and precision.compute is not None:  # see [Note: cut dtypes under autocast]
            captured, meta["cut_dtypes"] = with_autocast_dtypes(captured, precision.compute, kernels)
            # the loss runs on the output in these dtypes, under the same autocast ([Note: the loss] in loss.py)
            meta.update(autocast=kernels, output_dtypes=[i.dtype for i in captured.cuts[-1]])
            twin = twin if twin is None else with_autocast_dtypes(twin, precision.compute, kernels)[0]
            cut_dtype = None
        records: list[BlockProfile] = []
        per_block: list[dict[str, Any]] = []
        with torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(0)
            measured: dict[int, BlockCost] = {}
            measured_names: dict[int, tuple[frozenset[str], frozenset[str]]] = {}
            for done, index in enumerate(indices, start=1):
                block = captured.blocks[index]
                if mode == "measure" and index not in measured:
                    window = _window(indices[done - 1 :], memory, dev)
                    measured.update(_measure(captured, window, dev, precision, chosen.launch_us, warmup, repeats))
                try:
                    cost = measured[index] if mode == "measure" else estimate_block(block, precision, roofline)
                except Exception as err:
                    hint = failure_hint(block, mode, err)
                    _forget_frames(err)
                    raise ProfileError(
                        f"profiling block {index} ({block.name!r}) in {mode} mode failed: "
                        f"{type(err).__name__}: {err}{hint}"
                    ) from err
                cut_bytes = sum(scaled_nbytes(t, cut_dtype) for t in captured.cuts[index])
                own = memory[index]
                step_us = optimizer_step_us(optimizer, own.stepped_bytes, own.stepped_tensors, chosen, gpu)
                add_us = accumulate_us(own.stepped_bytes, own.stepped_tensors, chosen)
                record = _record(block.name, block.modules, own, cost, cut_bytes, (step_us, add_us))
                if twin is not None:
                    record = _with_curve(record, captured, twin, index, precision, roofline, sizes, cut_dtype)
                records.append(record)
                measured_names[index] = cost.saved_names
                per_block.append(
                    {
                        "index": index,
                        "fwd_kernels": cost.fwd_kernels,
                        "bwd_kernels": cost.bwd_kernels,
                        "bwd_flops": cost.bwd_flops,
                        "saved_input_bytes": cost.saved_input_bytes,
                        "saved_output_bytes": cost.saved_output_bytes,
                        **({"opaque_ops": sorted(cost.opaque_ops)} if cost.opaque_ops else {}),
                    }
                )
                if progress is not None:
                    progress(done, len(indices), block.name)
    meta["per_block"] = per_block
    opaque = sorted({op for entry in per_block for op in entry.get("opaque_ops", ())})
    if opaque:
        meta["opaque_ops"] = opaque
        if mode == "estimate":
            warn_opaque(opaque)
    records = with_shared_saves(records, indices, captured, measured_names, cut_dtype)
    if twin is not None:
        meta["curve_sizes"] = sorted(set(sizes))

    return ModelProfile(
        model=type(captured.module).__name__,
        blocks=tuple(records),
        batch_size=max(sizes) if twin is not None else captured.batch_size,
        input_bytes=sum(scaled_nbytes(t, precision.param) for t in captured.inputs),
        tied=tied,
        mode=mode,
        device=device_name,
        optimizer=optimizer,
        dtype=precision.param_name,
        capture=captured.method,
        meta=meta,
    )


#: Most blocks timed together in stage order, and their share of free device memory (see [Note: blocks in order]).
WINDOW_BLOCKS, WINDOW_MEMORY_SHARE = 8, 0.25


def _window(indices: Sequence[int], memory: Sequence[BlockMemory], device: torch.device) -> list[int]:
    """The next blocks to time together: consecutive, at most WINDOW_BLOCKS, their state within budget."""
    if device.type == "cuda":
        budget = WINDOW_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]
    else:
        budget = 2.0 * (1 << 30)
    window = [indices[0]]
    used = _state_bytes(memory[indices[0]])
    for prev, index in itertools.pairwise(indices):
        used += _state_bytes(memory[index])
        if index != prev + 1 or len(window) == WINDOW_BLOCKS or used > budget:
            break
        window.append(index)
    return window


def _state_bytes(m: BlockMemory) -> int:
    return m.param_bytes + m.grad_bytes + m.buffer_bytes


def _measure(
    captured: CapturedModel,
    window: list[int],
    device: torch.device,
    precision: Precision,
    launch_us: float,
    warmup: int,
    repeats: int,
) -> dict[int, BlockCost]:
    blocks = [captured.blocks[i] for i in window]
    try:
        costs = measure_blocks(blocks, device, precision, launch_us, warmup, repeats)
    except BlockFailed as failed:
        index = window[failed.position]
        err = failed.error
        hint = failure_hint(blocks[failed.position], "measure", err)
        _forget_frames(failed)
        raise ProfileError(
            f"profiling block {index} ({blocks[failed.position].name!r}) in measure mode failed: "
            f"{type(err).__name__}: {err}{hint}"
        ) from err
    return dict(zip(window, costs, strict=True))


def _forget_frames(error: BaseException) -> None:
    """Clear the local variables of the finished frames in the tracebacks of ``error`` and of its causes.

    A failed block's traceback holds every frame from the profiler down to the failing op, and with them
    the profiler's copies, inputs, outputs and autograd graphs: an error a caller keeps (the strategy sends
    a planning failure to every rank before raising it) would keep them allocated. The printed traceback
    is unchanged (it needs code and line numbers, not locals); frames still running are skipped.
    See [Note: no copy outlives the profiler] in sandbox.py.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def _record(
    name: str,
    modules: tuple[str, ...],
    memory: BlockMemory,
    cost: BlockCost,
    cut_bytes: int,
    step_us: tuple[float, float],
) -> BlockProfile:
    """One block's record; ``step_us``: its optimizer step's time and its gradients' accumulation's."""
    return BlockProfile(
        name=name,
        modules=tuple(modules),
        param_shapes=memory.param_shapes,
        param_count=memory.param_count,
        param_bytes=memory.param_bytes,
        grad_bytes=memory.grad_bytes,
        unreached_grad_bytes=memory.unreached_grad_bytes,
        optimizer_bytes=memory.optimizer_bytes,
        buffer_bytes=memory.buffer_bytes,
        fwd_us=float(cost.fwd_us),
        bwd_us=float(cost.bwd_us),
        fwd_fixed_us=float(cost.fwd_fixed_us),
        bwd_fixed_us=float(cost.bwd_fixed_us),
        activation_bytes=int(cost.activation_bytes),
        cut_bytes=int(cut_bytes),
        fwd_flops=float(cost.fwd_flops),
        transient_bytes=int(cost.transient_bytes),
        cast_bytes=int(cost.cast_bytes),
        fresh_extra_bytes=int(cost.fresh_extra_bytes),
        dropped_bytes=int(cost.dropped_bytes),
        forward_only=cost.forward_only,
        optimizer_us=float(step_us[0]),
        accumulate_us=float(step_us[1]),
        host_fwd_us=float(cost.host_us[0]),
        host_bwd_us=float(cost.host_us[1]),
    )


def _with_curve(
    record: BlockProfile,
    captured: CapturedModel,
    twin: CapturedModel,
    index: int,
    precision: Precision,
    roofline: Roofline,
    sizes: Sequence[int],
    cut_dtype: torch.dtype | None,
) -> BlockProfile:
    """``record`` with the cost curve of its block from two captures, its figures those of the largest size."""
    cuts = tuple(sum(scaled_nbytes(t, cut_dtype) for t in m.cuts[index]) for m in (captured, twin))
    curve = estimate_curve(
        captured.blocks[index],
        twin.blocks[index],
        precision,
        roofline,
        sizes,
        samples=(captured.batch_size, twin.batch_size),
        cut_bytes=(cuts[0], cuts[1]),
    )
    # the dead part's saves, measured at the capture's batch, in proportion at the curve's largest size
    dropped = -(-record.dropped_bytes * curve[-1][0] // captured.batch_size)
    return dataclasses.replace(with_curve(record, curve), dropped_bytes=dropped)

