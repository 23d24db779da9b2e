"""The ``autopart`` command: ``plan`` a model for a cluster, ``show`` a saved plan and draw its timeline,
``consolidate`` a sharded checkpoint into one file."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from rich.console import Console
from rich.text import Text
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.cluster import Cluster
from lightning_autopart.devices import DeviceSpec
from lightning_autopart.errors import AutopartError, CheckpointError, ConfigError
from lightning_autopart.lightning.hooks import batch_size_of, find_forward
from lightning_autopart.lightning.step_loss import step_loss
from lightning_autopart.plan import SCHEDULES, Plan, check_compatible, load_plan, with_planning_time
from lightning_autopart.plan.report import WIDTH, print_plan, profiling_progress
from lightning_autopart.planner import example_inputs_of, meta_inputs, plan_model
from lightning_autopart.profile.loader import LoaderCost, time_loader
from lightning_autopart.profile.loss import LossFn
from lightning_autopart.profile.readback import LoopFacts
from lightning_autopart.profile.records import capture_fingerprint

__all__ = ["build_parser", "main"]

#: Device spec of ``--profile estimate`` when ``--device-spec`` is not given.
DEFAULT_ESTIMATE_SPEC = "a100-40gb"


def build_parser() -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """The ``autopart`` parser and its subcommand parsers by name."""
    root = ArgumentParser(
        prog="autopart",
        description="Plan pipeline x data-parallel training of a PyTorch/Lightning model. "
        "Add --debug anywhere for tracebacks.",
        exit_on_error=False,
    )
    sub = root.add_subcommands(dest="command")
    plan = ArgumentParser(
        exit_on_error=False, description="Capture, profile and partition a model; print the plan."
    )
    plan.add_argument("--config", action=ActionConfigFile, help="YAML file with any of these options.")
    plan.add_subclass_arguments(nn.Module, "model", required=True)
    plan.add_argument("--devices", type=int, default=1, help="Devices (ranks) per node.")
    plan.add_argument("--nodes", type=int, default=1, help="Nodes.")
    plan.add_argument(
        "--device-memory", type=str | None, default=None, help="Memory per device: 40GB, 80GiB."
    )
    plan.add_argument("--batch-size", type=int, required=True, help="Global samples per optimizer step.")
    plan.add_argument(
        "--profile",
        type=Literal["estimate", "measure"],
        default="estimate",
        help="estimate: roofline of --device-spec on meta tensors; measure: time on this machine.",
    )
    plan.add_argument(
        "--device-spec",
        type=str | None,
        default=None,
        help=f"a100-40gb, h100-80gb, ... (default: {DEFAULT_ESTIMATE_SPEC} for estimate, local device "
        "for measure).",
    )
    plan.add_argument("--optimizer", type=str, default="sgd", help="sgd, adam, adamw:fused... (docs/cli.md).")
    plan.add_argument(
        "--precision",
        type=str,
        default="32-true",
        help="Training precision, as the Trainer's: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true.",
    )
    plan.add_argument(
        "--num-stages", type=int | None, default=None, help="Pipeline stages (default: searched)."
    )
    plan.add_argument(
        "--replicas", type=int | None, default=None, help="Data-parallel replicas (default: searched)."
    )
    plan.add_argument("--micro-batches", type=int | None, default=None, help="Micro-batches per step.")
    plan.add_argument(
        "--schedule", type=str, nargs="+", default=None, help=f"Schedules to try: {', '.join(SCHEDULES)}."
    )
    _add_input_arguments(plan)
    plan.add_argument("--progress-bar-refresh", type=int, default=1, help="The Trainer's (0: no progress bar).")
    plan.add_argument("--log-every-n-steps", type=int, default=50, help="The Trainer's (0: no logger).")
    plan.add_argument(
        "-o", "--output", type=str | None, default=None, help="Write the plan to this JSON file."
    )
    sub.add_subcommand("plan", plan, help="Plan a model for a cluster.")

    show = ArgumentParser(
        exit_on_error=False, description="Print a saved plan; optionally draw it or check it."
    )
    show.add_argument("plan_file", type=str, help="Plan JSON written by `autopart plan -o`.")
    show.add_argument(
        "--timeline", type=str | None, default=None, help="Draw the pipeline timeline to this PNG."
    )
    show.add_argument(
        "--memory", type=str | None, default=None, help="Draw per-stage memory bars to this PNG."
    )
    show.add_subclass_arguments(
        nn.Module,
        "model",
        required=False,
        instantiate=False,
        help="Check that the plan was made for this model (built on meta).",
    )
    _add_input_arguments(show)
    show.add_argument(
        "--world-size", type=int | None, default=None, help="Check the plan against this world size."
    )
    show.add_argument(
        "--batch-size", type=int | None, default=None, help="Check the plan against this batch size."
    )
    sub.add_subcommand("show", show, help="Print a saved plan and draw its timeline.")

    merge = ArgumentParser(
        exit_on_error=False,
        description="Write a sharded checkpoint directory (AutoPartitionStrategy(checkpoint='sharded')) as one "
        "file that LightningModule.load_from_checkpoint and torch.load read on one process.",
    )
    merge.add_argument("checkpoint", type=str, metavar="CKPT_DIR", help="The sharded checkpoint directory.")
    merge.add_argument("target", type=str | None, nargs="?", default=None, metavar="OUTPUT", help="The file.")
    merge.add_argument("-o", "--output", type=str | None, default=None, help="The file (instead of OUTPUT).")
    merge.add_argument("--force", action="store_true", help="Replace OUTPUT if it exists.")
    sub.add_subcommand("consolidate", merge, help="Turn a sharded checkpoint into one file.")
    return root, {"plan": plan, "show": show, "consolidate": merge}


def _add_input_arguments(parser: ArgumentParser) -> None:
    parser.add_argument(
        "--input-shape",
        type=str | None,
        default=None,
        help="Shape of the model's one input, e.g. 64,5000 (default: model.example_input_array).",
    )
    parser.add_argument("--input-dtype", type=str, default="float32", help="dtype of --input-shape's tensor.")
    parser.add_argument(
        "--max-blocks", type=int, default=64, help="Finest number of blocks to cut the model into."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``autopart``; returns the exit code (0, or 2 for a usage or planning error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if os.getcwd() not in sys.path:  # model class paths are usually relative to the project directory
        sys.path.insert(0, os.getcwd())
    out, err = _console(sys.stdout), _console(sys.stderr)
    root, parsers = build_parser()
    try:
        try:
            cfg = root.parse_args(args)
        except argparse.ArgumentError as error:
            command = next((a for a in args if a in parsers), None)
            hint = f"; see `autopart {command} --help`" if command else "; see `autopart --help`"
            raise ConfigError(f"{_argument_message(str(error))}{hint}") from error
        if cfg.command is None:
            root.print_help()
            return 2
        if cfg.command == "plan":
            _plan(cfg.plan, out, err)
        elif cfg.command == "show":
            _show(cfg.show, out)
        else:
            _consolidate(cfg.consolidate, out)
    except SystemExit as exit_:  # --help, --print_config
        return exit_.code if isinstance(exit_.code, int) else 0
    except AutopartError as error:
        if debug:
            raise
        err.print(Text.assemble(("error: ", "bold red"), (str(error), "red")), soft_wrap=True)
        return 2
    return 0


def _argument_message(message: str) -> str:
    """jsonargparse's multi-line parse error as one line: the option, and the most specific reason."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if lines and lines[0].startswith('expected "command"'):
        return (
            "give a command: `autopart plan --model CLASS ...`, `autopart show PLAN.json` or "
            "`autopart consolidate CKPT_DIR OUTPUT`"
        )
    key = re.match(r'Parser key "([^"]+)"', lines[0]) if lines else None
    option = "--" + key.group(1).replace("_", "-") if key else None
    for i, line in enumerate(lines):
        found = re.match(r"- Problem with given class_path '([^']+)':", line)
        if found and i + 1 < len(lines):
            reason = lines[i + 1]
            if "has no attribute" in reason or "No module" in reason:
                reason += " (give a class importable from the current directory, e.g. examples.tutorial.Net)"
            return f"cannot use {option or '--model'} {found.group(1)}: {reason}"
    text = " ".join(lines[1:] if key else lines)
    text = re.sub(r"Expected a typing\.Literal\[(.*?)\]\.", r"expected one of \1;", text)
    text = re.sub(r"Expected a <class '(\w+)'>\.", lambda m: f"expected {_TYPE_NAMES.get(m[1], m[1])};", text)
    text = text.replace("; Got value:", ", got")
    text = re.sub(r"\b(?:plan|show|consolidate)\.(\w+)", _option_name, text)
    return f"{option}: {text}" if option else text


_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string"}
#: What the messages call the positional arguments.
_POSITIONALS = {"plan_file": "PLAN_FILE", "checkpoint": "CKPT_DIR"}


def _option_name(match: re.Match[str]) -> str:
    """A parser key ("show.plan_file", "plan.batch_size") as the user types it ("PLAN_FILE", "--batch-size")."""
    return _POSITIONALS.get(match[1], "--" + match[1].replace("_", "-"))


def _console(file: Any) -> Console:
    console = Console(file=file)
    return console if console.is_terminal else Console(file=file, width=WIDTH)


def _plan(cfg: Namespace, out: Console, err: Console) -> None:
    estimate = cfg.profile == "estimate"
    spec = cfg.device_spec or (DEFAULT_ESTIMATE_SPEC if estimate else None)
    cluster = Cluster.from_spec(
        spec or _local_spec(), devices=cfg.devices, nodes=cfg.nodes, device_memory=cfg.device_memory
    )
    model = _build_model(cfg.model, meta=estimate)
    step = _training_step(model, meta=estimate) if cfg.input_shape is None else None
    if step is not None:
        root, inputs, loss, samples, loader = step
    else:
        root, inputs, loss, samples, loader = model, _example_inputs(cfg, model, meta=estimate), None, None, None
    start = time.perf_counter()
    with profiling_progress(err) as progress:
        plan = plan_model(
            root,
            inputs,
            cluster,
            cfg.batch_size,
            profile=cfg.profile,
            spec=spec,
            optimizer=cfg.optimizer,
            num_stages=cfg.num_stages,
            replicas=cfg.replicas,
            micro_batches=cfg.micro_batches,
            schedules=cfg.schedule,
            max_blocks=cfg.max_blocks,
            progress=progress,
            dtype=None if cfg.precision in ("32", "32-true") else cfg.precision,
            loss=loss,
            loss_samples=samples,
            loader=loader,
            # strategy="autopart" takes SIGTERM, so Lightning's loop exchanges nothing per batch (synced=False)
            loop=LoopFacts(cfg.progress_bar_refresh, cfg.log_every_n_steps, scaler=cfg.precision == "16-mixed"),
        )
    plan = with_planning_time(plan, time.perf_counter() - start)  # what the strategy's load_plan skips
    print_plan(plan, out)
    if cfg.output:
        path = Path(cfg.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
        out.print(f"plan saved to {path}", highlight=False)
    else:
        out.print("(pass -o plan.json to save the plan)", style="dim")


def _show(cfg: Namespace, out: Console) -> None:
    plan = load_plan(cfg.plan_file)
    fingerprint = None
    if cfg.model is not None:
        model = _build_model(cfg.model, meta=True)
        inputs = _example_inputs(cfg, model, meta=True)
        max_blocks = plan.notes.get("max_blocks", cfg.max_blocks)
        fingerprint = capture_fingerprint(capture(model, inputs, max_blocks=max_blocks))  # no profile needed
    check_compatible(plan, fingerprint=fingerprint, world_size=cfg.world_size, batch_size=cfg.batch_size)
    print_plan(plan, out)
    if fingerprint is not None:
        out.print(
            f"the plan matches {fingerprint['model']} ({len(fingerprint['blocks'])} blocks)", highlight=False
        )
    for path, what in ((cfg.timeline, "timeline"), (cfg.memory, "memory")):
        if path:
            _draw(plan, Path(path), what)
            out.print(f"{what} drawn to {path}", highlight=False)


def _consolidate(cfg: Namespace, out: Console) -> None:
    """``autopart consolidate``: the sharded checkpoint ``cfg.checkpoint`` as one file, written atomically."""
    from lightning_autopart.runtime.checkpoint import consolidate

    if cfg.target and cfg.output and cfg.target != cfg.output:
        raise ConfigError(f"two outputs given, {cfg.target} and -o {cfg.output}; give one")
    if not (cfg.target or cfg.output):
        raise ConfigError(f"give the output file: `autopart consolidate {cfg.checkpoint} OUTPUT` (or -o OUTPUT)")
    source, target = Path(cfg.checkpoint), Path(cfg.target or cfg.output)
    try:
        checkpoint = consolidate(source, target, overwrite=cfg.force)
    except (OSError, RuntimeError, ValueError, KeyError) as error:  # a damaged directory, a full disk
        raise CheckpointError(f"cannot consolidate {source}: {type(error).__name__}: {error}") from error
    entries, optimizers = len(checkpoint.get("state_dict", {})), len(checkpoint.get("optimizer_states", []))
    out.print(
        f"consolidated {source} ({entries} model entries, {optimizers} optimizer states) into {target} "
        f"({target.stat().st_size / 1e6:.1f} MB); load it with YourModule.load_from_checkpoint({str(target)!r})",
        highlight=False,
        soft_wrap=True,
    )


def _draw(plan: Plan, path: Path, what: str) -> None:
    from lightning_autopart.plan.visualize import draw_memory, draw_timeline

    path.parent.mkdir(parents=True, exist_ok=True)
    (draw_timeline if what == "timeline" else draw_memory)(plan, path)


def _build_model(spec: Namespace, *, meta: bool) -> nn.Module:
    """Instantiate the ``--model`` class spec (on the meta device when ``meta``: a 10 GB model costs nothing)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(nn.Module, "model", required=True)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    with torch.device("meta") if meta else nullcontext():
        try:
            model = instantiate(Namespace(model=spec)).model
        except AutopartError:
            raise
        except Exception as error:
            cause: BaseException = error
            while (
                cause.__cause__ or cause.__context__
            ) is not None:  # jsonargparse wraps the constructor's error
                cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
            raise ConfigError(
                f"cannot build the model {spec.class_path}: {type(cause).__name__}: {cause}"
            ) from error
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec.class_path} built a {type(model).__name__}; give a torch.nn.Module class")
    return model


def _training_step(
    model: nn.Module, *, meta: bool
) -> tuple[nn.Module, Any, LossFn, int, LoaderCost | None] | None:
    """For a LightningModule with a ``train_dataloader``: the module its ``training_step`` calls, that call's
    inputs on the first batch, the step's loss as a function of the module's output, the batch's samples (see
    [Note: the loss]) and the loader's time per batch ([Note: loader time]); None for any other model (it plans
    from ``example_input_array`` alone)."""
    make, training_step = getattr(model, "train_dataloader", None), getattr(model, "training_step", None)
    if not callable(make) or not callable(training_step):
        return None
    try:
        loader = make()
        batch = next(iter(loader))
    except StopIteration:
        raise ConfigError(
            f"{type(model).__name__}.train_dataloader() yields no batch; give it data, or pass --input-shape"
        ) from None
    except Exception:  # no train_dataloader implemented (Lightning's default raises): plan from the example
        return None
    if meta:
        batch = meta_inputs(batch)
    call = find_forward(model, lambda: training_step(batch, 0))
    root = model.get_submodule(call.name) if call.name else model
    samples = batch_size_of(batch)
    cost = time_loader(loader, samples)
    return root, (call.args, call.kwargs), step_loss(model, call.name, batch, samples), samples, cost


def _example_inputs(cfg: Namespace, model: nn.Module, *, meta: bool) -> Any:
    """``--input-shape``/``--input-dtype`` as a tensor, else the model's ``example_input_array``."""
    if cfg.input_shape is None:
        inputs = example_inputs_of(model)
        return meta_inputs(inputs) if meta else inputs
    shape = parse_shape(cfg.input_shape)
    dtype = getattr(torch, cfg.input_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown --input-dtype {cfg.input_dtype!r}; use float32, bfloat16, int64, ...")
    if meta:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)


def parse_shape(text: str) -> tuple[int, ...]:
    """ "64,5000" or "64x5000" -> (64, 5000)."""
    parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(
            f"cannot parse --input-shape {text!r}; write positive sizes separated by commas: 64,5000"
        )
    return shape


def _local_spec() -> str | DeviceSpec:
    """The spec closest to this machine's device (for cluster bandwidths when measuring); on CPU the probed one,
    whose host overheads are this machine's."""
    from lightning_autopart.profile import calibrate_cpu, resolve_spec

    if torch.cuda.is_available():
        return resolve_spec(None, torch.device("cuda", torch.cuda.current_device())).name
    return calibrate_cpu()
