"""plan_model: capture -> profile -> partition as one call."""

from __future__ import annotations

import torch

from examples.tutorial import Net
from lightning_autopart import Cluster, plan_model


def test_estimate_without_spec_prices_the_clusters_own_device() -> None:
    # Regression: with spec=None the estimate used the calibrated CPU instead of the devices being planned for.
    with torch.device("meta"):
        model = Net(hidden=256, layers=8)
    cluster = Cluster.from_spec("h100-80gb", devices=4)
    implicit = plan_model(model, model.example_input_array, cluster, batch_size=64)
    explicit = plan_model(model, model.example_input_array, cluster, batch_size=64, spec="h100-80gb")
    assert implicit.device == explicit.device == "h100-80gb"
    assert implicit.prediction.step_us == explicit.prediction.step_us
    cpu = plan_model(model, model.example_input_array, cluster, batch_size=64, spec="cpu")
    assert cpu.device == "cpu"
    assert cpu.prediction.step_us > implicit.prediction.step_us  # the calibrated CPU is slower on any machine
