"""Regenerate the docs' plan pictures: the tutorial model planned as ``make plan-demo`` plans it, drawn by
``autopart show --timeline --memory`` into docs/img/, then shrunk to small palette PNGs fit to commit.

Run from the repository root: ``python scripts/docs_images.py`` (``make docs-images``). Needs the ``plot`` extra.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

__all__ = ["PLAN_ARGS", "main", "shrink"]

ROOT = Path(__file__).resolve().parents[1]

#: The 2.5B-parameter tutorial model on 8 x A100-40GB, estimated: the same arguments as ``make plan-demo``.
PLAN_ARGS = [
    "--model", "examples.tutorial.Net", "--model.init_args.hidden", "5000", "--model.init_args.layers", "100",
    "--devices", "8", "--device-memory", "40GB", "--batch-size", "512", "--profile", "estimate",
    "--device-spec", "a100-40gb",
]  # fmt: skip


def shrink(path: Path, colors: int = 256) -> int:
    """Rewrite the PNG at ``path`` with an adaptive palette of ``colors`` and no metadata; return its bytes.

    Matplotlib's charts use a handful of flat colours, so the palette loses nothing visible, and without the
    metadata (matplotlib's version) the same plan gives the same bytes.
    """
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.FASTOCTREE)
    small.save(path, optimize=True)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    """Plan, draw and shrink; print each picture's path and size."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder of the pictures")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # examples.tutorial is imported from the repository root
    from lightning_autopart.cli import main as autopart

    args.out.mkdir(parents=True, exist_ok=True)
    timeline, memory = args.out / "tutorial-timeline.png", args.out / "tutorial-memory.png"
    with tempfile.TemporaryDirectory() as scratch:
        plan = str(Path(scratch) / "tutorial-plan.json")
        if autopart(["plan", *PLAN_ARGS, "-o", plan]) != 0:
            return 1
        if autopart(["show", plan, "--timeline", str(timeline), "--memory", str(memory)]) != 0:
            return 1
    for path in (timeline, memory):
        print(
            f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {shrink(path) / 1000:.0f} kB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
