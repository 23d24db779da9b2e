"""Materialising a meta model: a rank's share only, the weights of a plain construction, no silent garbage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopart.errors import ConfigError
from lightning_autopart.runtime.materialize import check_initialisable, has_meta_tensors, materialize
from tests.hf_cases import build


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Embedding(10, 32), nn.Linear(32, 4))


def test_a_share_with_the_weights_of_a_plain_construction() -> None:
    torch.manual_seed(3)
    plain = _model()
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        model = _model()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # made over the meta tensors
    keep = {id(t) for n, t in (*params.items(), *buffers.items()) if n.startswith(("1.", "4."))}
    torch.manual_seed(99)
    after = torch.random.get_rng_state()
    done = materialize(model, keep, state)
    assert torch.equal(torch.random.get_rng_state(), after), "the caller's random state is put back"
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        assert t is (params | buffers)[name], "tensors keep their identity"
        if name.startswith(("1.", "4.")):
            assert not t.is_meta
            torch.testing.assert_close(t, plain.state_dict()[name], rtol=0, atol=0, msg=name)
        else:
            assert t.is_meta, name
    assert optimizer.param_groups[0]["params"][2] is model[1].weight and not model[1].weight.is_meta
    share = sum(t.nbytes for t in model.state_dict().values() if not t.is_meta)
    assert done.kept_bytes == share and done.modules == 4
    biggest = max(sum(t.nbytes for t in m.state_dict().values()) for m in plain.children())
    assert done.peak_bytes <= share + biggest


def test_materialised_model_trains() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    materialize(model, {id(t) for t in model.parameters()})
    assert not has_meta_tensors(model)
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class _HalfReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(3))
        self.b = nn.Parameter(torch.empty(3))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.a)


def test_module_without_reset_parameters_is_refused_up_front() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoReset())
    with pytest.raises(ConfigError, match=r"1 \(_NoReset\) own tensors on the meta device.*add a reset_parameters"):
        check_initialisable(model)
    assert model[0].weight.is_meta, "nothing was touched"


def test_uninitialised_tensor_is_refused() -> None:
    with torch.device("meta"):
        model = _HalfReset()
    with pytest.raises(ConfigError, match="does not initialise 'b'"):
        materialize(model, {id(model.a), id(model.b)})


def test_metrics_on_meta_are_refused() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    with torch.device("meta"):
        model = nn.ModuleDict({"net": nn.Linear(2, 2), "acc": torchmetrics.MeanMetric()})
    with pytest.raises(ConfigError, match="torchmetrics metrics acc were created on the meta device"):
        check_initialisable(model)


def test_hugging_face_model_gets_its_own_fix() -> None:
    with torch.device("meta"):
        model = build("gpt2")
    with pytest.raises(ConfigError, match="Hugging Face models initialise in post_init"):
        check_initialisable(model)
