"""Capture of models whose structure torch.export handles only with help: output containers registered without
pytree keys ([Note: pytree keys]; transformers 4.x registers its ModelOutputs so), one module at two paths of the
tree (transformers 4.x's T5 shares its embedding module with encoder and decoder), and the hint a capture error
gives on an older transformers ([Note: transformers before 5])."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_autopart.capture import capture
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.capture.libraries import library_hint
from lightning_autopart.errors import CaptureError
from lightning_autopart.runtime.stages import build_stage_module


class Named:
    """A container of named tensors, registered with names as its context and no keys (as transformers 4.x)."""

    def __init__(self, first: Tensor, second: Tensor) -> None:
        self.first, self.second = first, second


class Positional:
    """A container whose context is not one name per child: keys are positions."""

    def __init__(self, values: list[Tensor]) -> None:
        self.values = values


@pytest.fixture
def keyless() -> Iterator[None]:
    """Both containers registered without ``flatten_with_keys_fn`` for the test, then removed."""
    pytree.register_pytree_node(
        Named,
        lambda n: ([n.first, n.second], ["first", "second"]),
        lambda v, c: Named(*v),
        serialized_type_name=f"{__name__}.Named",
    )
    pytree.register_pytree_node(
        Positional,
        lambda p: (list(p.values), len(p.values)),
        lambda v, c: Positional(list(v)),
        serialized_type_name=f"{__name__}.Positional",
    )
    try:
        yield
    finally:
        pytree._deregister_pytree_node(Named)
        pytree._deregister_pytree_node(Positional)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Named:
        return Named(self.lin(x).relu(), x)


class _Containers(nn.Module):
    """Submodules return a keyless container (export records their outputs by path), and so does the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.one, self.two = _Layer(), _Layer()
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Positional:
        a = self.one(x)
        b = self.two(a.first + a.second)
        return Positional([self.head(b.first), b.second])


def _run_all(captured: CapturedModel, inputs: list[Any]) -> Any:
    """Every block chained in two stages, the output rebuilt as the forward returns it."""
    values = tuple(inputs)
    half = captured.num_blocks // 2
    for start, end in itertools.pairwise([0, half, captured.num_blocks]):
        values = build_stage_module(captured, start, end)(*values)
    return captured.output.rebuild(values)


@pytest.mark.usefixtures("keyless")
def test_containers_without_keys_are_exported_and_the_registry_is_put_back() -> None:
    model, x = _Containers(), torch.randn(3, 4)
    captured = capture(model, x, method="export")
    assert captured.method == "export" and captured.num_blocks >= 2
    out, reference = _run_all(captured, [x]), model(x)
    assert type(out) is Positional
    for got, want in zip(out.values, reference.values, strict=True):
        torch.testing.assert_close(got, want)
    assert pytree.SUPPORTED_NODES[Named].flatten_with_keys_fn is None
    assert pytree.SUPPORTED_NODES[Positional].flatten_with_keys_fn is None


class _Decoder(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed  # the model's own module, a second path to it
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(self.embed(x)).tanh()


class _SharedModule(nn.Module):
    """``shared`` is also ``decoder.embed``: ``named_modules()`` lists it once, export's call records both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 4)
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.decoder = _Decoder(self.shared)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.decoder(self.encoder(self.shared(x))))


@pytest.mark.parametrize("method", ["export", "modules"])
def test_a_module_at_two_paths_is_captured(method: str) -> None:
    model, x = _SharedModule(), torch.randn(3, 4)
    captured = capture(model, x, method=method)
    assert captured.method == method
    torch.testing.assert_close(_run_all(captured, [x]), model(x))
    held = {n for block in captured.blocks for n in block.params}
    assert "shared.weight" in held and not any(n.startswith("decoder.embed.") for n in held)


def test_a_capture_error_on_an_older_transformers_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")

    class Branchy(nn.Module):  # data-dependent control flow outside any submodule: neither method captures it
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            y = self.a(x)
            return self.b(y if y.sum() > 0 else y * 2) * y.mean()

    Branchy.__module__ = "transformers.models.branchy.modeling_branchy"
    model, x = Branchy(), torch.randn(3, 4)
    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    with pytest.raises(CaptureError, match=r"transformers 4\.57\.6 is installed; .* pip install -U transformers"):
        capture(model, x)
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    assert library_hint(model) == ""
    with pytest.raises(CaptureError) as caught:
        capture(model, x)
    assert "transformers" not in str(caught.value)
    assert library_hint(_SharedModule()) == ""  # not a transformers model
