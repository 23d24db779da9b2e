"""The ``autopart`` command: plan and show in-process and once as a subprocess, and every bad input's message."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from lightning_autopart.cli import main, parse_shape
from lightning_autopart.errors import ConfigError
from lightning_autopart.plan import Plan

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
NET = ["--model", "examples.tutorial.Net", "--model.init_args.hidden", "64", "--model.init_args.layers", "4"]


class NoExample(nn.Module):
    """A model without ``example_input_array``."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


class Empty(nn.Module):
    """Nothing to partition: capture refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        return x * 2


class Broken(nn.Module):
    """A model whose constructor fails."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        raise RuntimeError(f"width {width} is not supported")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # class paths (examples.tutorial.Net) resolve from the current directory


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "out" / "plan.json"  # "out/" does not exist yet
    assert main(["plan", *NET, "--devices", "2", "--batch-size", "16", "-o", str(path)]) == 0
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_prints_the_table_and_saves(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan.load(plan_file)
    assert plan.fingerprint["model"] == "Net"
    assert plan.cluster.world_size == 2 and plan.batch_size == 16
    assert plan.profile_mode == "estimate" and plan.device == "a100-40gb"
    assert plan.notes["max_blocks"] == 64
    assert plan.notes["planning_s"] > 0  # what load_plan skips (see tests/unit/test_plan_reuse.py)
    code, out, err = run(
        ["plan", *NET, "--devices", "2", "--batch-size", "16", "--schedule", "GPipe"], capsys
    )
    assert code == 0, err
    assert "Plan for Net (16,640 parameters, 4 blocks)" in out
    assert "GPipe" in out and "samples/s" in out
    assert "pass -o plan.json to save the plan" in out
    assert "profiled 4 blocks" in err


def test_show_prints_and_draws(plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timeline, memory = tmp_path / "pics" / "timeline.png", tmp_path / "memory.png"
    code, out, err = run(
        ["show", str(plan_file), "--timeline", str(timeline), "--memory", str(memory)], capsys
    )
    assert code == 0, err
    assert "Plan for Net" in out and f"timeline drawn to {timeline}" in out
    assert timeline.read_bytes().startswith(PNG) and memory.read_bytes().startswith(PNG)


def test_show_checks_the_model(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["show", str(plan_file), *NET, "--world-size", "2", "--batch-size", "16"], capsys)
    assert code == 0, err
    assert "the plan matches Net (4 blocks)" in out


def test_config_file_gives_the_same_plan(
    plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "plan.yaml"
    config.write_text(
        "model:\n  class_path: examples.tutorial.Net\n  init_args:\n    hidden: 64\n    layers: 4\n"
        f"devices: 2\nbatch_size: 16\noutput: {tmp_path / 'from-yaml.json'}\n"
    )
    code, _, err = run(["plan", "--config", str(config)], capsys)
    assert code == 0, err
    from_yaml, from_flags = Plan.load(tmp_path / "from-yaml.json"), Plan.load(plan_file)
    # notes: timings; the predicted time includes the loader's batches, timed in each run
    assert from_yaml.prediction.data_us > 0 and from_flags.prediction.data_us > 0
    assert dataclasses.replace(from_yaml, notes={}, prediction=from_flags.prediction) == dataclasses.replace(
        from_flags, notes={}
    )


def test_module_entry_point_in_a_subprocess(plan_file: Path, tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.png"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_autopart", "show", str(plan_file), "--timeline", str(timeline)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Plan for Net" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 120
    assert timeline.read_bytes().startswith(PNG)


BAD_PLANS = [
    (["--device-spec", "b200"], "unknown device spec 'b200'; known specs: a100-40gb"),
    (["--device-memory", "40 gigs"], "cannot parse memory size '40 gigs'; write a number with a unit"),
    (["--devices", "0"], "a cluster needs at least one node and one device per node"),
    (
        ["--devices", "8", "--num-stages", "2", "--batch-size", "2"],
        "batch size 2 is smaller than the 4 data-parallel",
    ),
    (["--schedule", "ZeroBubble"], "unknown schedule 'ZeroBubble'"),
    (["--input-shape", "64,abc"], "cannot parse --input-shape '64,abc'"),
    (["--input-shape", "4,64", "--input-dtype", "float99"], "unknown --input-dtype 'float99'"),
    (["--batch-size", "x"], "--batch-size: expected an integer, got x"),
    (["--profile", "guess"], "--profile: expected one of 'estimate', 'measure'"),
    (["--optimizer", "lion"], "unknown optimizer 'lion'"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_PLANS)
def test_bad_plan_inputs(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", *NET, "--devices", "2", "--batch-size", "16", *extra]
    code, _, err = run(argv, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (["--model", "tests.unit.test_cli.NoExample"], "NoExample has no example_input_array; set"),
        (["--model", "tests.unit.test_cli.Empty"], "cannot capture Empty: it has no parameters"),
        (
            ["--model", "tests.unit.test_cli.Broken"],
            "cannot build the model tests.unit.test_cli.Broken: RuntimeError",
        ),
        (["--model", "examples.tutorial.Nope"], "cannot use --model examples.tutorial.Nope: module"),
        ([*NET, "--model.init_args.depth", "3"], "cannot use --model examples.tutorial.Net: Option 'depth'"),
    ],
)
def test_bad_models(model: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", *model, "--batch-size", "4"], capsys)
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err
    assert message in err


def test_model_without_example_runs_with_input_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "tests.unit.test_cli.NoExample", "--input-shape", "4,8", "--batch-size", "4"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "Plan for NoExample" in out


def test_measure_mode_and_an_infeasible_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "measured.json"
    code, _, err = run(
        ["plan", *NET, "--profile", "measure", "--devices", "2", "--batch-size", "8", "-o", str(out)], capsys
    )
    assert code == 0, err
    plan = Plan.load(out)
    # measure times the blocks on this machine's device: the current CUDA device where there is one
    here = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    assert plan.profile_mode == "measure" and plan.device == here
    code, _, err = run(
        ["plan", *NET, "--devices", "2", "--batch-size", "8", "--device-memory", "10KB"], capsys
    )
    assert code == 2
    assert err.startswith("error: no plan for Net fits") and "Traceback" not in err


def test_bad_plan_files(plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    future = tmp_path / "future.json"
    future.write_text(json.dumps({**json.loads(plan_file.read_text()), "schema_version": 99}))
    other = [
        "--model",
        "examples.tutorial.Net",
        "--model.init_args.hidden",
        "32",
        "--model.init_args.layers",
        "4",
    ]
    cases = [
        ([str(corrupt)], f"plan file {corrupt} is not valid JSON"),
        ([str(tmp_path / "nope.json")], "does not exist"),
        ([str(future)], "schema_version 99 is newer than this lightning_autopart reads"),
        (
            [str(plan_file), *other],
            "block 0 'layers.0' has 4,160 parameters in the plan, 1,056 in this model",
        ),
        ([str(plan_file), "--world-size", "4"], "plan was made for world size 2, this job has 4 ranks"),
        ([str(plan_file), "--batch-size", "32"], "plan was made for global batch size 16, this job uses 32"),
    ]
    for args, message in cases:
        code, _, err = run(["show", *args], capsys)
        assert code == 2, args
        assert message in err, err


def test_hints_name_only_what_the_command_has(
    plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11: an unknown spec pointed at "bandwidth options" the command lacks, `show` at the strategy's
    load_plan, and a plan file that fails validation named the field but not the fix."""
    code, _, err = run(["plan", *NET, "--batch-size", "4", "--device-spec", "b200"], capsys)
    assert code == 2 and "bandwidth options" not in err
    assert "use the closest known spec and give the memory per device (CLI: --device-spec h200-141gb" in err
    for extra, fix in (
        (["--world-size", "4"], "re-plan for 4 ranks with `autopart plan ... --devices 4 -o PLAN.json`"),
        (["--batch-size", "32"], "re-plan for batch 32 with `autopart plan ... --batch-size 32 -o PLAN.json`"),
    ):
        code, _, err = run(["show", str(plan_file), *extra], capsys)
        assert code == 2 and fix in err and "load_plan" not in err, err
    edited = json.loads(plan_file.read_text())
    edited["micro_batches"] = "four"
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(edited))
    code, _, err = run(["show", str(bad)], capsys)
    assert code == 2
    assert err.strip().endswith(
        f"plan file {bad}: micro_batches must be an integer, got a string \"four\"; it is not a plan as "
        f"lightning_autopart writes one (edited, truncated or another file): re-plan and save it again "
        f"(`autopart plan ... -o {bad}`, or the strategy's save_plan)"
    ), err
    edited["micro_batches"] = 0
    bad.write_text(json.dumps(edited))
    code, _, err = run(["show", str(bad)], capsys)
    assert code == 2 and "invalid plan: micro_batches must be at least 1, got 0" in err and "re-plan" in err


def test_debug_shows_the_traceback_and_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="unknown device spec"):
        main(["plan", *NET, "--batch-size", "4", "--device-spec", "b200", "--debug"])
    assert main(["plan", "--help"]) == 0
    assert "--device-memory" in capsys.readouterr().out
    code, _, err = run([], capsys)
    assert code == 2 and "give a command" in err


def test_parse_shape() -> None:
    assert parse_shape("64,5000") == (64, 5000)
    assert parse_shape("2x3x4") == (2, 3, 4)
    for bad in ("", "0,4", "a"):
        with pytest.raises(ConfigError, match="cannot parse --input-shape"):
            parse_shape(bad)


def test_a_lightning_module_plans_from_its_first_batch_with_its_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI plans a LightningModule as the strategy does: its train_dataloader's first batch, the loss of its
    training_step priced on the last stage; --precision sets the compute dtype."""
    from examples.gpt import GPT
    from lightning_autopart.cli import _training_step

    with torch.device("meta"):
        model = GPT(vocab_size=1000, seq_len=16, d_model=32, n_layers=2, n_heads=2, batch_size=4, num_samples=8)
    found = _training_step(model, meta=True)
    assert found is not None
    root, (args, _kwargs), loss, samples, loader = found
    assert root is model and samples == 4 and args[0].shape == (4, 16) and args[0].device.type == "meta"
    assert loader is not None and loader.samples == 4 and loader.workers == 0  # its batches are timed
    logits = torch.randn(4, 16, 1000, device="meta", requires_grad=True)
    assert loss(logits, 4).device.type == "meta"
    common = ["plan", "--model", "examples.gpt.GPT", "--model.init_args.vocab_size", "1000",
              "--model.init_args.seq_len", "16", "--model.init_args.d_model", "32", "--model.init_args.n_layers", "2",
              "--model.init_args.n_heads", "2", "--model.init_args.num_samples", "8", "--batch-size", "4",
              "--micro-batches", "1", "--devices", "1"]  # fmt: skip
    saved = []
    for precision in ("32-true", "bf16-mixed"):
        assert main([*common, "--precision", precision, "-o", str(tmp_path / f"{precision}.json")]) == 0
        saved.append(Plan.load(tmp_path / f"{precision}.json").stages[0].activation_bytes)
    assert saved[0] > 4 * 16 * 1000 * 4  # the cross entropy's log-softmax over the logits is priced
    # bfloat16 activations, but the cross entropy runs as CUDA's autocast runs it ([Note: the loss under
    # autocast]): a bfloat16 log-softmax and a float32 copy of it, more than float32's one log-softmax here
    assert saved[1] != saved[0] and saved[1] > 4 * 16 * 1000 * (2 + 4)
    # the step logs its loss for a default Trainer's progress bar, which reads it back every step
    assert Plan.load(tmp_path / "32-true.json").notes["loader"].endswith("reads back every step")
    for loop, reads in ((["--progress-bar-refresh", "0"], "every 50 steps"),
                        (["--progress-bar-refresh", "0", "--log-every-n-steps", "0"], "never")):  # fmt: skip
        assert main([*common, *loop, "-o", str(tmp_path / "quiet.json")]) == 0
        assert Plan.load(tmp_path / "quiet.json").notes["loader"].endswith(f"reads back {reads}")
    quiet = [*common[:-1], "2", "--progress-bar-refresh", "0", "--log-every-n-steps", "0", "-o", str(tmp_path / "2.json")]
    assert main(quiet) == 0  # two processes: autopart takes SIGTERM, so Lightning's loop exchanges nothing per batch
    assert Plan.load(tmp_path / "2.json").notes["loader"].endswith("never")
    assert main([*common, "--progress-bar-refresh", "-1"]) == 2
    assert "refresh rate (-1)" in capsys.readouterr().err
    assert main([*common, "--precision", "int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Tensor]]:
    """A sharded checkpoint as the strategy writes it (one process, after one step) and the model's state then."""
    import lightning as L

    from examples.tutorial import Net
    from lightning_autopart.lightning.strategy import AutoPartitionStrategy
    from tests.distributed.launch import free_port

    folder = tmp_path_factory.mktemp("ckpt")
    saved = dict(os.environ)  # Lightning sets LOCAL_RANK, MASTER_PORT...: a module fixture outlives the env fixture
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # a process group even for one
    try:
        model = Net(hidden=16, layers=2, batch_size=4, num_samples=8)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=AutoPartitionStrategy(num_stages=1, profile="estimate"),
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        trainer.save_checkpoint(folder / "last.ckpt")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
    assert (folder / "last.ckpt").is_dir()
    return folder / "last.ckpt", {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_consolidate_writes_one_file_load_from_checkpoint_reads(
    sharded: tuple[Path, dict[str, Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from examples.tutorial import Net

    ckpt, state = sharded
    one = tmp_path / "model.ckpt"
    code, out, err = run(["consolidate", str(ckpt), str(one)], capsys)
    assert code == 0, err
    assert f"consolidated {ckpt} (4 model entries, 1 optimizer states) into {one}" in out
    assert one.is_file()
    model = Net.load_from_checkpoint(one)  # one process, plain Lightning, hyperparameters from the file
    assert model.hparams["hidden"] == 16
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
    # -o works as the positional OUTPUT does; an existing output needs --force
    code, _, err = run(["consolidate", str(ckpt), "-o", str(one)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"output {one} exists; choose another path, or replace it (--force)" in err
    assert main(["consolidate", str(ckpt), "-o", str(one), "--force"]) == 0
    assert torch.load(one, weights_only=False)["state_dict"].keys() == state.keys()


def test_consolidate_refuses_what_is_not_a_sharded_checkpoint(
    sharded: tuple[Path, dict[str, Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _ = sharded
    a_file = tmp_path / "plain.ckpt"
    a_file.write_bytes(b"")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([str(tmp_path / "nope")], "checkpoint " + str(tmp_path / "nope") + " does not exist; give the directory"),
        ([str(a_file), "x.ckpt"], f"checkpoint {a_file} is a file, not a sharded checkpoint directory"),
        ([str(empty), "x.ckpt"], f"{empty} is a directory without meta.pt: not a sharded checkpoint; give"),
        ([str(ckpt), str(tmp_path)], f"output {tmp_path} is a directory; give a file path"),
        ([str(ckpt)], f"give the output file: `autopart consolidate {ckpt} OUTPUT` (or -o OUTPUT)"),
        ([str(ckpt), "a.ckpt", "-o", "b.ckpt"], "two outputs given, a.ckpt and -o b.ckpt; give one"),
        ([], "the following arguments are required: CKPT_DIR; see `autopart consolidate --help`"),
    ]
    for args, message in cases:
        if args and args[0] == str(tmp_path / "nope"):
            args = [*args, str(tmp_path / "out.ckpt")]
        code, _, err = run(["consolidate", *args], capsys)
        assert code == 2, args
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, err
    assert not (tmp_path / "out.ckpt").exists() and not Path("x.ckpt").exists()
