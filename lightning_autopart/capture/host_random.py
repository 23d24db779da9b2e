"""Random numbers a forward draws on the host, which torch.export would freeze into the captured graph.

[Note: host random numbers] torch.export runs the forward once and records tensor operations; a value the
forward computes in Python is a constant of the graph. ``torch.rand`` is an operation and draws afresh at
every step, but ``random.random()`` (a LayerDrop written ``if random.random() < p``) or ``numpy.random`` (a
SpecAugment mask drawn with numpy) would be drawn once, at capture, and every training step would replay that
draw: the same layers skipped, the same positions masked, silently. So the export is watched: when the forward
advanced Python's or NumPy's global random state, the export is refused, and :func:`capture` falls back to
module hooks, whose blocks run the forward's Python at every step. Module hooks freeze the Python between
blocks in turn (the path a parent's forward took at capture is the path the stages take), so a draw there
makes that parent one block, or refuses the root. Either way :func:`capture` restores the states
(:func:`keep_host_random`), so capturing leaves the user's random streams as it found them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_autopart.errors import CaptureError

__all__ = ["drawn", "host_random_state", "keep_host_random", "watch_host_random"]


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy.random


@contextmanager
def keep_host_random() -> Iterator[None]:
    """Restore Python's and NumPy's global random states on exit: capturing runs the forward, and must not
    move the user's streams."""
    np_random = _numpy_random()
    python_state = random.getstate()
    numpy_state = np_random.get_state() if np_random is not None else None
    try:
        yield
    finally:
        random.setstate(python_state)
        if np_random is not None:
            np_random.set_state(numpy_state)


def host_random_state() -> tuple[Any, Any]:
    """Python's and NumPy's global random states, comparable with :func:`drawn`."""
    np_random = _numpy_random()
    numpy_state = None
    if np_random is not None:
        name, keys, *rest = np_random.get_state()
        numpy_state = (name, keys.tobytes(), *rest)
    return random.getstate(), numpy_state


def drawn(before: tuple[Any, Any], after: tuple[Any, Any]) -> str:
    """Which of the host's random streams advanced between two :func:`host_random_state` ("" for none)."""
    streams = zip(("Python's random", "numpy.random"), before, after, strict=True)
    names = [name for name, a, b in streams if a != b]
    return " and ".join(names)


@contextmanager
def watch_host_random(cls: str) -> Iterator[None]:
    """Raise :class:`CaptureError` after the body if it drew from Python's or NumPy's global random state
    (see [Note: host random numbers])."""
    before = host_random_state()
    yield
    streams = drawn(before, host_random_state())
    if streams:
        raise CaptureError(
            f"{cls}.forward draws random numbers with {streams}, which torch.export would freeze into the "
            "graph (every step would repeat the capture's draw); draw them with torch (torch.rand, "
            "torch.bernoulli), which draws afresh at every step"
        )
