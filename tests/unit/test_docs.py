"""The docs cannot drift from the code: the options table lists exactly ``AutoPartitionStrategy``'s arguments
with their defaults, and every error message quoted in docs/limitations.md is produced by the code (or, for
messages that need a running job, matches a message template in the package's source)."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import re
import textwrap
from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins import TorchSyncBatchNorm
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_autopart import Cluster, plan_model
from lightning_autopart.capture import capture
from lightning_autopart.cluster import parse_bytes
from lightning_autopart.devices import device_spec
from lightning_autopart.errors import AutopartError
from lightning_autopart.lightning.input_checks import check_stages, check_trainable, empty_loader_message
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.plan import check_compatible, load_plan
from lightning_autopart.planner import check_settings
from lightning_autopart.profile import profile
from lightning_autopart.profile.records import capture_fingerprint
from lightning_autopart.runtime.materialize import check_initialisable
from tests.models import Uncapturable

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "lightning_autopart"

#: A quoted message starts with the CLI's "error: " or the exception's class name, which is not compared.
_PREFIX = re.compile(r"^(?:error|[A-Z]\w*(?:Error|Exception)): ")


def _ws(text: str) -> str:
    return " ".join(text.split())


# -- the options table ------------------------------------------------------------------------------------------


def _table_rows(page: Path) -> dict[str, str]:
    """``argument -> default cell`` of every table row of ``page`` whose first cell is one code span."""
    rows = {}
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def _shown(default: Any) -> str:
    """How the table writes a default: its repr, a timedelta in minutes."""
    if isinstance(default, timedelta):
        return f"timedelta(minutes={default.total_seconds() / 60:g})"
    return repr(default)


def test_the_options_table_lists_exactly_the_strategy_arguments_with_their_defaults() -> None:
    parameters = inspect.signature(AutoPartitionStrategy.__init__).parameters
    expected = {name: p.default for name, p in parameters.items() if name != "self"}
    rows = _table_rows(DOCS / "options.md")
    assert sorted(rows) == sorted(expected), (
        "docs/options.md and AutoPartitionStrategy.__init__ list other arguments"
    )
    for name, default in expected.items():
        assert rows[name] == f"`{_shown(default)}`", f"docs/options.md gives {name} the default {rows[name]}"


# -- the data-flow picture ---------------------------------------------------------------------------------------


def test_the_design_picture_names_every_module_and_only_modules_that_exist() -> None:
    text = (DOCS / "design.md").read_text()
    picture = text[text.index("```\n") : text.index("```", text.index("```\n") + 4)]
    lines = picture.splitlines()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if path.name in ("__init__.py", "__main__.py"):
            continue
        folder = module.rpartition("/")[0]
        if not folder:  # the top-level modules are named in the text below the picture
            assert f"`{module}`" in text, f"docs/design.md does not name {module}"
            continue
        named = module in picture or any(path.name in line and f"{folder}/" in line for line in lines)
        assert named, f"docs/design.md's picture does not name {module}"
    for name in set(re.findall(r"[\w/]+\.py", text)):
        candidates = [ROOT / name, PACKAGE / name, *PACKAGE.rglob(name)]
        assert any(c.is_file() for c in candidates), f"docs/design.md names {name}, which does not exist"


# -- quoted error messages --------------------------------------------------------------------------------------


def quoted_messages(page: Path) -> list[str]:
    """Every message in the ```text blocks of ``page``: a line at the margin starts one, indented lines continue
    it; whitespace is collapsed and the ``error: ``/``SomeError: `` prefix dropped."""
    messages: list[list[str]] = []
    for block in re.findall(r"^ *```text\n(.*?)^ *```", page.read_text(), flags=re.M | re.S):
        for line in textwrap.dedent(block).splitlines():
            if line[:1].isspace() and messages:
                messages[-1].append(line)
            elif line.strip():
                messages.append([line])
    return [_PREFIX.sub("", _ws(" ".join(lines))) for lines in messages]


def _template(node: ast.expr) -> str | None:
    """A regex for the strings ``node`` evaluates to: literal text as it is, anything computed as ``.+?``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(_ws(node.value)) if node.value.strip() else r"\s*"
    if isinstance(node, ast.JoinedStr):
        parts = [_template(v) if isinstance(v, ast.Constant) else r".+?" for v in node.values]
        return r"\s*".join(p for p in parts if p)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        if left is None and right is None:
            return None
        return r"\s*".join((left or r".+?", right or r".+?"))
    return None


@functools.cache
def source_templates() -> tuple[re.Pattern[str], ...]:
    """A regex for every error message the package can raise or warn: the first argument of each call whose
    callee's name ends in Error or Exception, or is ``warn``."""
    patterns = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if callee.endswith(("Error", "Exception", "Glue")) or callee == "warn":
                regex = _template(node.args[0])
                if regex is not None and len(re.sub(r"\\.|[.+?*]", "", regex)) >= 30:
                    patterns.append(re.compile(regex, re.S))
    return tuple(patterns)


def _raised(action: Callable[[], Any]) -> str:
    try:
        action()
    except AutopartError as error:
        return str(error)
    raise AssertionError(f"{action} raised nothing")


class FrozenNet(nn.Module):
    """A model whose every parameter is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4).requires_grad_(False)


class Gain(nn.Module):
    """A module that owns a parameter but cannot initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))


class Norm(nn.Module):
    """Divides by the batch's largest magnitude, read on the host: fine on real tensors, impossible on meta."""

    def forward(self, x: Tensor) -> Tensor:
        return x / x.abs().max().item()


def _net(hidden: int, layers: int) -> nn.Module:
    from examples.tutorial import Net

    with torch.device("meta"):
        return Net(hidden, layers)


def _no_plan_fits() -> str:
    return _raised(
        lambda: plan_model(
            _net(1000, 8),
            torch.randn(2, 1000, device="meta"),
            Cluster.from_spec("a100-40gb", devices=2, device_memory="10MB"),
            64,
        )
    )


def _other_model(tmp: Path) -> str:
    made = plan_model(
        _net(1000, 4), torch.randn(2, 1000, device="meta"), Cluster.from_spec("a100-40gb", devices=2), 64
    )
    made.save(tmp / "plan.json")
    other = capture(_net(800, 4), torch.randn(2, 800, device="meta"))
    return _raised(
        lambda: check_compatible(load_plan(tmp / "plan.json"), fingerprint=capture_fingerprint(other))
    )


def _not_json(tmp: Path) -> str:
    (tmp / "bad.json").write_text('{\n"schema_version": 1\n"stages": []}\n')
    cwd = Path.cwd()
    os.chdir(tmp)
    try:
        return _raised(lambda: load_plan("bad.json"))
    finally:
        os.chdir(cwd)


def _sync_batchnorm() -> None:
    AutoPartitionStrategy()._layer_sync = TorchSyncBatchNorm()


def _estimate_reads_values() -> None:
    model = nn.Sequential(OrderedDict(inp=nn.Linear(8, 8), norm=Norm(), out=nn.Linear(8, 8)))
    profile(capture(model, (torch.randn(4, 8),)), "estimate", spec="a100-40gb")


#: Messages the docs quote, by their first words, and how the code produces each (given a scratch directory).
PRODUCERS: dict[str, Callable[[Path], str]] = {
    "unknown device spec": lambda _: _raised(lambda: device_spec("b200")),
    "cannot parse memory size": lambda _: _raised(lambda: parse_bytes("40 gigs")),
    "batch size 4 is smaller": lambda _: _raised(
        lambda: check_settings(Cluster.from_spec("a100-40gb", devices=8), 4, num_stages=1)
    ),
    "plan file bad.json": _not_json,
    "block 0 'layers.0' has": _other_model,
    "no plan for Net fits": lambda _: _no_plan_fits(),
    "unknown schedule": lambda _: _raised(lambda: AutoPartitionStrategy(schedule="zigzag")),
    "num_stages=2 does not divide": lambda _: _raised(lambda: check_stages(2, 3)),
    "the train dataloader yields no batch": lambda _: empty_loader_message(
        "train", DataLoader(list(range(3)), batch_size=4, drop_last=True)
    ),
    "nothing to train": lambda _: _raised(lambda: check_trainable(FrozenNet(), "", FrozenNet())),
    "cannot capture Uncapturable": lambda _: _raised(lambda: capture(Uncapturable(), torch.randn(3, 8))),
    "profiling block 1": lambda _: _raised(_estimate_reads_values),
    "Trainer(sync_batchnorm=True)": lambda _: _raised(_sync_batchnorm),
    "modules 1 (Gain)": lambda _: _raised(
        lambda: check_initialisable(nn.Sequential(nn.Linear(8, 8), Gain()).to("meta"))
    ),
}


def _matches_produced(quote: str, produced: str) -> bool:
    """``quote`` is ``produced``, where each ``...`` of the quote stands for any text."""
    return re.fullmatch(r".*".join(re.escape(p) for p in quote.split("...")), _ws(produced), re.S) is not None


def _producer(quote: str) -> Callable[[Path], str] | None:
    return next((make for start, make in PRODUCERS.items() if quote.startswith(start)), None)


def _limitations() -> Iterator[str]:
    yield from quoted_messages(DOCS / "limitations.md")


def test_the_limitations_page_quotes_messages() -> None:
    assert len(list(_limitations())) >= 15


@pytest.mark.parametrize("quote", list(_limitations()), ids=lambda q: q[:40])
def test_each_quoted_message_comes_from_the_code(quote: str, tmp_path: Path) -> None:
    make = _producer(quote)
    if make is not None:
        produced = make(tmp_path)
        assert _matches_produced(quote, produced), f"the docs quote\n{quote}\nthe code says\n{_ws(produced)}"
    else:
        assert any(p.fullmatch(quote) for p in source_templates()), (
            f"no message in the package reads\n{quote}"
        )


def test_the_template_check_refuses_a_changed_word() -> None:
    templates = source_templates()
    quote = (
        "num_stages=2 does not divide the 3 devices: every stage runs on the same number of replicas, so 1 "
        "device(s) would hold no stage; use a multiple of 2 devices (2 or 4), or num_stages=1 or 3"
    )
    assert any(p.fullmatch(quote) for p in templates)
    assert not any(p.fullmatch(quote.replace("every stage", "each stage")) for p in templates)


if __name__ == "__main__":  # print what each producer says, to quote it
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for start, make in PRODUCERS.items():
            print(json.dumps({start: make(Path(scratch))}, indent=1))
