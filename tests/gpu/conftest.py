"""Fixtures of the GPU tier: a one-process rendezvous for autopart's process group, deterministic cuDNN."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.distributed.launch import free_port


@pytest.fixture(autouse=True)
def _one_process_rendezvous() -> None:
    """autopart starts a process group even for one device (world size 1): it needs an address and a free port.

    tests/conftest.py restores the environment after each test and destroys the process group.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())


@pytest.fixture(autouse=True)
def _deterministic_cudnn() -> Iterator[None]:
    """The same convolution algorithms on both sides of a comparison (no autotuning, deterministic kernels)."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
