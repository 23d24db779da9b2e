"""A spec for the local CUDA device ([Note: derived device specs]): the named spec where the device is that
part, else peaks and bandwidth computed from the reported SMs, clocks and bus, which must land on the vendors'
sheets for parts we have no named spec for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_autopart import devices
from lightning_autopart.devices import device_spec
from lightning_autopart.errors import ConfigError
from lightning_autopart.profile.cuda_spec import CudaProperties, local_cuda_spec, spec_from_properties

_GIB = 1 << 30


@pytest.fixture(autouse=True)
def _forget_registered_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Specs registered here stay here: later tests see only the named ones."""
    monkeypatch.setattr(devices, "_SPECS", dict(devices._SPECS))


def _props(name: str, cc: str, sms: int, clock_mhz: int, mem_mhz: int, bus: int, gib: float) -> CudaProperties:
    major, minor = (int(x) for x in cc.split("."))
    return CudaProperties(name, major, minor, sms, clock_mhz * 1000, mem_mhz * 1000, bus, int(gib * _GIB))


# What the driver reports (deviceQuery) for parts on hand in the world.
H100_SXM = _props("NVIDIA H100 80GB HBM3", "9.0", 132, 1980, 2619, 5120, 79.1)
H200 = _props("NVIDIA H200", "9.0", 132, 1980, 3201, 6144, 139.8)
A100_40 = _props("NVIDIA A100-SXM4-40GB", "8.0", 108, 1410, 1215, 5120, 39.4)
A100_80 = _props("NVIDIA A100-SXM4-80GB", "8.0", 108, 1410, 1593, 5120, 79.2)
V100_32 = _props("Tesla V100-SXM2-32GB", "7.0", 80, 1530, 877, 4096, 31.7)


@pytest.mark.parametrize(
    ("props", "name"),
    [(H100_SXM, "h100-80gb"), (H200, "h200-141gb"), (A100_40, "a100-40gb"), (A100_80, "a100-80gb"),
     (V100_32, "v100-32gb")],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_the_parts_we_have_sheets_for_get_their_named_spec(props: CudaProperties, name: str) -> None:
    assert spec_from_properties(props) is device_spec(name)


@pytest.mark.parametrize(
    ("props", "fp32", "tf32", "bf16", "bw"),
    [
        # sheet figures (dense), TFLOP/s and GB/s
        (_props("NVIDIA H100 PCIe", "9.0", 114, 1755, 1593, 5120, 79.6), 51.2, 378, 756, 2039),
        (_props("NVIDIA L4", "8.9", 58, 2040, 6251, 192, 22.0), 30.3, 60, 121, 300),
        (_props("NVIDIA L40S", "8.9", 142, 2520, 9001, 384, 44.4), 91.6, 183, 362, 864),
        (_props("NVIDIA A10", "8.6", 72, 1695, 6251, 384, 22.0), 31.2, 62.5, 125, 600),
        (_props("Tesla V100-PCIE-16GB", "7.0", 80, 1380, 877, 4096, 15.8), 14.1, 0, 113, 898),
        (_props("NVIDIA GeForce RTX 4090", "8.9", 128, 2520, 10501, 384, 23.6), 82.6, 82.6, 165, 1008),
    ],
    ids=lambda x: x.name if isinstance(x, CudaProperties) else "",
)
def test_other_parts_are_priced_from_their_clocks_as_their_sheets_say(
    props: CudaProperties, fp32: float, tf32: float, bf16: float, bw: float
) -> None:
    spec = spec_from_properties(props)
    assert spec.name not in ("h100-80gb", "v100-32gb") and spec.sm_count == props.sm_count
    assert spec.memory_bytes == props.total_memory
    assert spec.fp32_flops == pytest.approx(fp32 * 1e12, rel=0.03)
    assert spec.tf32_flops == pytest.approx(tf32 * 1e12, rel=0.03)
    assert spec.bf16_flops == pytest.approx(bf16 * 1e12, rel=0.03)
    assert spec.memory_bw == pytest.approx(bw * 1e9, rel=0.03)
    # the wiring is unknown: PCIe figures, below every named NVLink node's
    assert spec.intra_allreduce_bw < device_spec("v100-32gb").intra_allreduce_bw


def test_a_derived_spec_is_found_by_name_in_this_process() -> None:
    pcie = SimpleNamespace(
        name="NVIDIA H100 PCIe", major=9, minor=0, multi_processor_count=114, clock_rate=1755000,
        memory_clock_rate=1593000, memory_bus_width=5120, total_memory=int(79.6 * _GIB),
    )
    spec = local_cuda_spec(pcie)
    assert spec.name == "nvidia-h100-pcie-80gb"
    assert device_spec(spec.name) == spec
    assert local_cuda_spec(pcie) == spec  # registered once, found again


@pytest.mark.parametrize(
    ("props", "says"),
    [
        (_props("NVIDIA Future", "11.0", 100, 2000, 4000, 8192, 200.0), "compute capability 11.0"),
        (_props("NVIDIA L4", "8.9", 58, 0, 0, 0, 22.0), "does not report its clocks"),
    ],
    ids=["unknown-architecture", "no-clocks"],
)
def test_a_device_that_cannot_be_priced_says_so_and_names_the_fix(props: CudaProperties, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        spec_from_properties(props)
    assert "--device-spec" in str(err.value) and f"{props.total_memory / _GIB:.0f}GB" in str(err.value)
    raw = SimpleNamespace(
        name=props.name, major=props.major, minor=props.minor, multi_processor_count=props.sm_count,
        clock_rate=props.clock_khz, memory_clock_rate=props.memory_clock_khz,
        memory_bus_width=props.memory_bus_width, total_memory=props.total_memory,
    )
    with pytest.warns(UserWarning, match="priced as a100-40gb"):
        assert local_cuda_spec(raw) is device_spec("a100-40gb")



def test_profiling_on_a_cuda_device_resolves_its_derived_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lightning_autopart.profile import resolve_spec

    l4 = SimpleNamespace(
        name="NVIDIA L4", major=8, minor=9, multi_processor_count=58, clock_rate=2040000,
        memory_clock_rate=6251000, memory_bus_width=192, total_memory=int(22.0 * _GIB),
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: l4)
    spec = resolve_spec(None, torch.device("cuda", 0))
    assert spec.name == "nvidia-l4-22gb" and spec.memory_bw == pytest.approx(300e9, rel=0.01)
    assert resolve_spec(spec.name) == spec  # profiles and clusters look it up by name


def test_a_part_sharing_a_named_specs_chip_but_not_its_memory_is_derived() -> None:
    nvl = _props("NVIDIA H100 NVL", "9.0", 132, 1785, 2619, 6016, 87.1)
    spec = spec_from_properties(nvl)
    assert spec.name == "nvidia-h100-nvl-87gb" and spec.memory_bw == pytest.approx(3.94e12, rel=0.01)
