"""Random numbers a forward draws on the host, and reseeds it makes, which a captured graph would not repeat.

[Note: host random numbers] torch.export runs the forward once and records tensor operations; a value the
forward computes in Python is a constant of the graph. ``torch.rand`` is an operation and draws afresh at
every step, but ``random.random()`` (a LayerDrop written ``if random.random() < p``) or ``numpy.random`` (a
SpecAugment mask drawn with numpy) would be drawn once, at capture, and every training step would replay that
draw: the same layers skipped, the same positions masked, silently. The same holds for a generator the model
keeps (``self.rng = numpy.random.default_rng(0)``, a ``random.Random``) and for one the forward makes without
a seed (``numpy.random.default_rng()``). A reseed is the reverse case: ``torch.manual_seed(0)`` in a forward
makes its dropout repeat one mask at every call, but a graph does not record the reseed and draws on. So
the export is watched (:class:`HostRandom`): the global streams and the generators found on the modules are
compared around the forward, and calls that reseed torch or make an unseeded generator are recorded while
it runs (:func:`record_seeding`). Any of these refuses the export, and :func:`capture` falls back to module
hooks, whose blocks run the forward's Python at every step. Module hooks freeze the Python between blocks
in turn (the path a parent's forward took at capture is the path the stages take), so a draw or a reseed
there makes that parent one block, or refuses the root. Either way :func:`capture` restores the states
(:func:`keep_host_random`), so capturing leaves the user's random streams as it found them. A generator
kept in a global variable is seen where a module's ``forward`` names it (or a function or method it calls,
two calls deep), and a reseed capture cannot record
(a function imported by name, ``from torch import manual_seed``, or a generator's own ``manual_seed``) by
torch's initial seed, which every reseed sets. Not seen: a
global generator named deeper than that, and a reseed to the seed already in use.
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from lightning_autopart.errors import CaptureError

__all__ = [
    "HostRandom",
    "generator_state",
    "held_generators",
    "is_generator",
    "keep_host_random",
    "plain_object",
    "record_seeding",
    "set_generator_state",
    "watch_host_random",
]

_EVENTS: list[str] = []  # calls recorded by record_seeding (reseeds, unseeded generators), in order
_INSIDE: list[str] = []  # the recorded calls running now
_NOT_PLAIN = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType)


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy.random


def is_generator(value: Any) -> bool:
    """A host random generator whose state can be read and set (SystemRandom has none: see record_seeding)."""
    if isinstance(value, random.Random):
        return not isinstance(value, random.SystemRandom)
    np_random = _numpy_random()
    return np_random is not None and isinstance(value, (np_random.Generator, np_random.RandomState))


def plain_object(value: Any) -> bool:
    """An instance of a user's class holding its state in ``__dict__`` (a config, a counter object), not a
    module, tensor, generator, class, function or one of torch's own objects."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, _NOT_PLAIN)
        and not is_generator(value)
        and not type(value).__module__.startswith("torch")
    )


def _comparable(value: Any) -> Any:
    """``value`` (a generator's state: dicts, tuples, arrays) as something ``==`` compares plainly."""
    if isinstance(value, dict):
        return tuple((k, _comparable(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(v) for v in value)
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a numpy array
        return (str(value.dtype), value.shape, value.tobytes())
    return value


def generator_state(generator: Any) -> Any:
    """The state of a host generator or a ``torch.Generator``, for :func:`set_generator_state`."""
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # numpy.random.Generator
        return generator.bit_generator.state
    return generator.get_state()


def set_generator_state(generator: Any, state: Any) -> None:
    """Put back a state that :func:`generator_state` read."""
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def _candidates(value: Any) -> Iterator[tuple[str, Any]]:
    """Values held by a module attribute where a generator may sit: itself, a container's items, and a plain
    object's attributes (one level each)."""
    yield "", value
    if isinstance(value, (list, tuple)):
        yield from ((f"[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        yield from ((f"[{k!r}]", v) for k, v in value.items())
    elif plain_object(value):
        yield from ((f".{k}", v) for k, v in vars(value).items())


def held_generators(owner: Any) -> list[Any]:
    """The generators (host ones and ``torch.Generator``) that ``owner`` holds as attributes, or that a plain
    object among them holds (a dataset's augmentation generator, say); containers are not searched, as a
    dataset's may hold every sample."""
    found: dict[int, Any] = {}
    for value in getattr(owner, "__dict__", {}).values():
        inner = vars(value).values() if plain_object(value) else ()
        for candidate in (value, *inner):
            if is_generator(candidate) or isinstance(candidate, torch.Generator):
                found.setdefault(id(candidate), candidate)
    return list(found.values())


def find_generators(module: nn.Module) -> list[tuple[str, Any]]:
    """The host random generators ``module``'s submodules keep, and those kept in global variables their
    ``forward`` names, each once, named where first found."""
    found: dict[int, tuple[str, Any]] = {}
    for fqn, sub in module.named_modules():
        for name, value in vars(sub).items():
            if name.startswith("_") or isinstance(value, _NOT_PLAIN):
                continue
            for suffix, candidate in _candidates(value):
                if is_generator(candidate) and id(candidate) not in found:
                    found[id(candidate)] = (f"{fqn + '.' if fqn else ''}{name}{suffix}", candidate)
    for cls in dict.fromkeys(type(sub) for sub in module.modules()):
        for name, value in _globals_named(cls):
            if is_generator(value) and id(value) not in found:
                found[id(value)] = (f"{name} (a global of {cls.__module__})", value)
    return list(found.values())


def _globals_named(cls: type, depth: int = 2) -> Iterator[tuple[str, Any]]:
    """The global variables ``cls.forward`` names, and those the functions and methods it names name in
    turn (``depth`` calls deep): where a generator kept in a global variable would be drawn from."""
    seen: set[int] = set()
    todo = [(getattr(cls, "forward", None), depth)]
    while todo:
        function, left = todo.pop()
        code = getattr(function, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        scope = getattr(function, "__globals__", {})
        for name in code.co_names:
            value = scope.get(name, getattr(cls, name, None))
            yield name, value
            if left and isinstance(value, (types.FunctionType, types.MethodType)):
                todo.append((value, left - 1))


class HostRandom:
    """The host's random streams a forward of ``module`` may draw from (Python's and NumPy's global ones, and
    the generators its modules keep) and the seeding calls recorded so far, to tell what a forward did."""

    def __init__(self, module: nn.Module) -> None:
        self.generators = find_generators(module)

    def state(self) -> tuple[Any, ...]:
        """Every stream's state and the number of recorded calls, comparable with :meth:`drawn`."""
        np_random = _numpy_random()
        numpy_state = _comparable(np_random.get_state()) if np_random is not None else None
        mine = tuple(_comparable(generator_state(g)) for _, g in self.generators)
        return random.getstate(), numpy_state, mine, len(_EVENTS), _initial_seeds()

    def drawn(self, before: tuple[Any, ...]) -> str:
        """The streams drawn from since ``before`` (a :meth:`state`), as a phrase ("" for none)."""
        after = self.state()
        streams = zip(("Python's random", "numpy.random"), before[:2], after[:2], strict=True)
        names = [name for name, a, b in streams if a != b]
        names += [
            f"the generator {name} ({type(g).__name__})"
            for (name, g), a, b in zip(self.generators, before[2], after[2], strict=True)
            if a != b
        ]
        made = [e for e in dict.fromkeys(_EVENTS[before[3] : after[3]]) if not e.startswith("torch")]
        return " and ".join(names + made)

    def reseeded(self, before: tuple[Any, ...]) -> str:
        """The torch seeding functions called since ``before`` (a :meth:`state`), or ""."""
        calls = [e for e in dict.fromkeys(_EVENTS[before[3] : len(_EVENTS)]) if e.startswith("torch")]
        if not calls and _initial_seeds() != before[4]:  # a seeding function imported by name
            calls = ["its initial seed changed: a manual_seed imported by name?"]
        return ", ".join(calls)

    def raw_states(self) -> list[Any]:
        """The generators' states as they set them back (for :meth:`restore`)."""
        return [generator_state(g) for _, g in self.generators]

    def restore(self, raw: list[Any]) -> None:
        """Put back the generators' states ``raw`` (read by :meth:`raw_states`)."""
        for (_, generator), saved in zip(self.generators, raw, strict=True):
            set_generator_state(generator, saved)


def _initial_seeds() -> tuple[int, ...]:
    """torch's generators' seeds, which every reseed sets (CUDA's only where CUDA is in use already)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return (torch.initial_seed(), *((torch.cuda.initial_seed(),) if cuda else ()))


_Target = tuple[Any, str, str, "tuple[int, str] | None"]


def _seeding_targets() -> list[_Target]:
    """(owner, attribute, label, position of the seed argument) of each function that reseeds torch, makes a
    host generator (recorded when its seed is None) or draws from the OS's entropy."""
    targets: list[_Target] = []
    owners = [(torch, "torch"), (torch.random, "torch")]
    owners += [(torch.cuda, "torch.cuda"), (torch.cuda.random, "torch.cuda")]
    for owner, label in owners:
        for name in ("manual_seed", "manual_seed_all", "seed", "seed_all"):
            if callable(getattr(owner, name, None)):
                targets.append((owner, name, f"{label}.{name}", None))
    np_random = _numpy_random()
    if np_random is not None:
        targets.append((np_random, "default_rng", "numpy.random.default_rng() without a seed", (0, "seed")))
    targets.append((random.Random, "seed", "random.Random() without a seed", (1, "a")))  # (self, a=None)
    targets += [(random.SystemRandom, n, "random.SystemRandom", None) for n in ("random", "getrandbits")]
    return targets


def _recording(function: Callable[..., Any], label: str, seed: tuple[int, str] | None) -> Callable[..., Any]:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if _INSIDE:  # torch.manual_seed calls torch.cuda.manual_seed_all: the user called one
            return function(*args, **kwargs)
        if seed is None or (args[seed[0]] if len(args) > seed[0] else kwargs.get(seed[1])) is None:
            _EVENTS.append(label)
        _INSIDE.append(label)
        try:
            return function(*args, **kwargs)
        finally:
            _INSIDE.pop()

    return recorded


@contextmanager
def record_seeding() -> Iterator[None]:
    """Record, while the body runs, calls that reseed torch's generators or make a host generator without a
    seed (see [Note: host random numbers]); :meth:`HostRandom.state` counts them."""
    with ExitStack() as stack:
        for owner, name, label, seed_at in _seeding_targets():
            original = getattr(owner, name)
            setattr(owner, name, _recording(original, label, seed_at))
            stack.callback(setattr, owner, name, original)
        yield


@contextmanager
def keep_host_random(module: nn.Module) -> Iterator[None]:
    """Restore torch's, Python's and NumPy's global random states and those of the generators ``module``
    keeps on exit: capturing runs the forward, and must not move the user's streams."""
    np_random = _numpy_random()
    python_state = random.getstate()
    numpy_state = np_random.get_state() if np_random is not None else None
    host = HostRandom(module)
    kept = host.raw_states()
    tensors = [*module.parameters(), *module.buffers()]
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):  # torch's too: module hooks run dropout
            yield
    finally:
        random.setstate(python_state)
        if np_random is not None:
            np_random.set_state(numpy_state)
        host.restore(kept)


@contextmanager
def watch_host_random(module: nn.Module, cls: str) -> Iterator[None]:
    """Raise :class:`CaptureError` after the body if it drew from a host random stream, made an unseeded
    generator or reseeded torch (see [Note: host random numbers])."""
    host = HostRandom(module)
    with record_seeding():
        before = host.state()
        yield
    reseeds = host.reseeded(before)
    if reseeds:
        raise CaptureError(
            f"{cls}.forward reseeds torch's random generator ({reseeds}), which torch.export would leave out "
            "of the graph (every step would draw on where the model repeats its draws); module hooks run it"
        )
    streams = host.drawn(before)
    if streams:
        raise CaptureError(
            f"{cls}.forward draws random numbers with {streams}, which torch.export would freeze into the "
            "graph (every step would repeat the capture's draw); draw them with torch (torch.rand, "
            "torch.bernoulli), which draws afresh at every step"
        )
