"""The planning milestone's acceptance cases: the seed tutorial model and ResNet-152x8 on clusters we do not have."""

from __future__ import annotations

import itertools

import pytest
import torch

from examples.resnet import ResNet
from examples.tutorial import Net
from lightning_autopart import Cluster, plan_model


def test_seed_tutorial_2_5b_fits_on_8_a100_40gb() -> None:
    # RaNNC's tutorial case: hidden 5000, 100 layers, 8 x 40 GB, global batch 512, SGD (RaNNC chose 2 stages x 4).
    with torch.device("meta"):
        model = Net(hidden=5000, layers=100)
    cluster = Cluster.from_spec("a100-40gb", devices=8, device_memory="40GB")
    plan = plan_model(model, model.example_input_array, cluster, batch_size=512, profile="estimate", optimizer="sgd")
    assert plan.fingerprint["param_count"] == 2_500_500_000
    assert plan.world_size == 8
    assert all(s.memory_bytes <= cluster.usable_memory_bytes for s in plan.stages)
    assert plan.prediction.peak_memory_bytes <= cluster.usable_memory_bytes
    bounds = [(s.block_start, s.block_end) for s in plan.stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == 100
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(bounds))


def test_small_net_on_two_devices_is_pure_data_parallel() -> None:
    with torch.device("meta"):
        model = Net(hidden=512, layers=10)
    cluster = Cluster.from_spec("a100-40gb", devices=2)
    plan = plan_model(model, model.example_input_array, cluster, batch_size=64, profile="estimate")
    assert plan.num_stages == 1
    assert plan.replicas == 2
    assert plan.stages[0].ranks == (0, 1)


@pytest.mark.slow
def test_resnet_152x8_fits_on_32_v100() -> None:
    # RaNNC's ResNet152x8 (3.7B parameters) on 32 V100-32GB at batch 1024 (RaNNC used 3 stages).
    with torch.device("meta"):
        model = ResNet(depth=152, width_factor=8)
    cluster = Cluster.from_spec("v100-32gb", devices=8, nodes=4)
    plan = plan_model(model, model.example_input_array, cluster, batch_size=1024, profile="estimate")
    assert plan.num_stages >= 2  # 3.7B parameters with gradients do not fit one 32 GB device with activations
    assert plan.world_size <= 32
    assert all(s.memory_bytes <= cluster.usable_memory_bytes for s in plan.stages)
