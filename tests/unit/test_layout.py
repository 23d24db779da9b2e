"""The package layout is the architecture: the core runs without Lightning and never reaches into the adapter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_autopart"
CORE = ("capture", "profile", "partition", "plan", "runtime")
CORE_MODULES = ("cluster.py", "devices.py", "errors.py", "planner.py")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _core_files() -> list[Path]:
    files = [p for d in CORE for p in (PACKAGE / d).rglob("*.py")]
    return files + [PACKAGE / m for m in CORE_MODULES]


def test_core_never_imports_lightning_or_the_adapter() -> None:
    bad = {}
    for path in _core_files():
        hits = {
            name
            for name in _imports(path)
            if name.split(".")[0] in {"lightning", "pytorch_lightning", "lightning_fabric"}
            or name.startswith("lightning_autopart.lightning")
        }
        if hits:
            bad[str(path.relative_to(PACKAGE))] = sorted(hits)
    assert not bad, f"core modules importing Lightning or the adapter: {bad}"


def test_core_imports_without_lightning_installed() -> None:
    code = """
import sys
for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
    sys.modules[name] = None  # import fails as if not installed
import lightning_autopart
import lightning_autopart.capture, lightning_autopart.profile, lightning_autopart.partition
import lightning_autopart.plan.report, lightning_autopart.plan.visualize, lightning_autopart.runtime
import lightning_autopart.planner, lightning_autopart.cli
assert not hasattr(lightning_autopart, "StrategyRegistry")
try:
    lightning_autopart.AutoPartitionStrategy
except ImportError as err:
    assert "pip install lightning" in str(err)
else:
    raise AssertionError("AutoPartitionStrategy without Lightning")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "lightning_fabric") and sys.modules[m])
assert not loaded, loaded
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_no_module_sits_flat_beyond_the_entry_points() -> None:
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert flat == sorted(["__init__.py", "__main__.py", "cli.py", *CORE_MODULES])
