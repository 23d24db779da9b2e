"""Structural keys ([Note: rank-independent values] in capture/keys.py): two captures of one model whose forward
ran its independent parts in another order (a loop over a set of strings on two processes) list every cut in
one order, so the stages built from one capture fit those built from the other."""

from __future__ import annotations

import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.keys import layout_digest
from lightning_autopart.runtime.stages import build_stage_module


class Tables(nn.Module):
    """Tables of one shape computed in ``order`` (as Gemma 3 does over ``set(config.layer_types)``)."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.order = order
        self.embed = nn.Linear(4, 8)
        for i, kind in enumerate(sorted(order)):
            self.register_buffer(f"{kind}_freq", torch.linspace(0.1, 1.0, 8) * (i + 1))
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        tables = {kind: torch.cos(getattr(self, f"{kind}_freq")) for kind in self.order}
        for layer, kind in zip(self.layers, sorted(self.order), strict=True):
            h = torch.tanh(layer(h) * tables[kind])
        return h


def _captures() -> tuple[Tables, list]:  # type: ignore[type-arg]
    kinds = ("a", "b", "c")
    models = [Tables(kinds), Tables(kinds[::-1])]
    x = torch.randn(2, 4)
    return models[0], [capture(m, (x,)) for m in models]


def test_captures_in_another_order_list_every_cut_alike() -> None:
    _, (first, second) = _captures()
    assert first.method == "export"
    names = [[t.name for t in cut] for cut in first.cuts[:-1]]
    assert names != [[t.name for t in cut] for cut in second.cuts[:-1]], "the two runs named values alike"
    keys = [[(t.key, t.shape) for t in cut] for cut in first.cuts]
    assert keys == [[(t.key, t.shape) for t in cut] for cut in second.cuts]
    assert layout_digest(first) == layout_digest(second)


def test_stages_from_either_capture_fit_together() -> None:
    model, (first, second) = _captures()
    x = torch.randn(2, 4)
    middle = first.num_blocks // 2
    sent = build_stage_module(first, 0, middle)(x)
    got = build_stage_module(second, middle, second.num_blocks)(*sent)
    torch.testing.assert_close(got[0], model(x), rtol=0, atol=0)


def test_another_model_has_another_layout() -> None:
    _, (first, _) = _captures()
    wider = Tables(("a", "b", "c"))
    wider.layers[2] = nn.Linear(8, 8, bias=False)
    assert layout_digest(capture(wider, (torch.randn(2, 4),))) != layout_digest(first)


def test_two_alike_random_draws_keep_apart() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            noise = torch.rand_like(x), torch.rand_like(x)
            return self.b(self.a(x) + noise[0]) + noise[1]

    captured = capture(Noisy(), (torch.randn(2, 4),))
    crossing = [t for t in captured.cuts[0] if t.shape == (2, 4)]
    assert len({t.key for t in crossing}) == len(crossing)


class Heads(nn.Module):
    """Heads run in ``order`` and summed in a fixed one: one function, parameters used in another order."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        self.order = order
        self.heads = nn.ModuleDict({kind: nn.Linear(4, 1) for kind in sorted(order)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = {kind: self.heads[kind](x) for kind in self.order}
        return torch.cat([outs[kind] for kind in sorted(self.order)], dim=1)


def test_replicas_list_their_parameters_alike() -> None:
    from lightning_autopart.runtime.stages import parameters_in_order

    lists, used = [], []
    for order in (("a", "b", "c"), ("c", "b", "a")):
        captured = capture(Heads(order), (torch.randn(2, 4),))
        stage = build_stage_module(captured, 0, captured.num_blocks)
        names = {id(p): n for n, p in captured.module.named_parameters()}
        used.append([names[id(p)] for p in stage.parameters()])
        lists.append([names[id(p)] for p in parameters_in_order(captured, [stage])])
    assert used[0] != used[1], "the stages list their parameters alike: the test proves nothing"
    assert lists[0] == lists[1] == ["heads.a.weight", "heads.a.bias", "heads.b.weight", "heads.b.bias",
                                    "heads.c.weight", "heads.c.bias"]  # fmt: skip


def test_a_device_index_is_not_part_of_a_key() -> None:
    """Each rank's model may sit on its own GPU when captured: ``cuda:0`` and ``cuda:1`` make one key."""
    from torch import fx

    from lightning_autopart.capture.keys import value_keys

    keys = []
    for device in (torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")):
        graph = fx.Graph()
        x = graph.placeholder("x")
        made = graph.call_function(torch.ops.aten.arange.default, (4,), {"device": device})
        total = graph.call_function(torch.ops.aten.add.Tensor, (x, made))
        graph.output(total)
        keys.append(value_keys(graph, {}, {}, [x])[total.name])
    assert keys[0] == keys[1] != keys[2]
