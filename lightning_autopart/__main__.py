"""``python -m lightning_autopart``: the ``autopart`` command."""

from __future__ import annotations

import sys

from lightning_autopart.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
