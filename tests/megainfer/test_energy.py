"""The energy meter reads the NVML device that is the engine's GPU, named by UUID.

No driver here: torch.cuda and pynvml are replaced by fakes of a four-GPU host on which the
process sees physical GPUs 3 and 1 (CUDA_VISIBLE_DEVICES=3,1, as Ray sets it per actor), so
cuda:0 is GPU 3 while NVML's index 0 is GPU 0."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megainfer.runner.energy import EnergyMeter, nvml_uuid

HOST_UUIDS = [f"{n}{n}{n}{n}0000-1111-2222-3333-44445555666{n}" for n in range(4)]  # physical order
VISIBLE = [3, 1]  # CUDA_VISIBLE_DEVICES=3,1: CUDA ordinal 0 is physical GPU 3, ordinal 1 is GPU 1


class FakeUuid:
    """torch's _CUuuid: str() gives the bare 8-4-4-4-12 form."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


class FakeNvmlError(Exception):
    pass


def fake_pynvml(counters_mj: list[int]) -> types.ModuleType:
    """NVML over the whole host: index i and UUID "GPU-<HOST_UUIDS[i]>" both name physical GPU i."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNvmlError
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: ("physical", index)

    def by_uuid(uuid: str):
        names = [f"GPU-{u}" for u in HOST_UUIDS]
        if uuid not in names:
            raise FakeNvmlError("Not Found")
        return ("physical", names.index(uuid))

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda handle: counters_mj[handle[1]]
    return nvml


@pytest.fixture
def host(monkeypatch):
    """The fake host; returns the per-GPU energy counters (millijoules) a test may advance."""
    counters = [1_000, 2_000, 3_000, 4_000]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, VISIBLE)))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(counters))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda ordinal: types.SimpleNamespace(uuid=FakeUuid(HOST_UUIDS[VISIBLE[ordinal]])))
    return counters


def test_cuda_0_under_visible_devices_meters_the_visible_gpu_not_physical_gpu_0(host):
    meter = EnergyMeter("cuda:0")
    assert meter.available, meter.reason
    host[0] += 50_000  # another actor's GPU works hard
    host[3] += 7_500  # ours
    assert meter.joules() == pytest.approx(7.5)


def test_an_ordinal_names_the_visible_gpu_it_counts(host):
    assert nvml_uuid("cuda:1") == f"GPU-{HOST_UUIDS[1]}"


def test_bare_cuda_uses_the_current_device(host, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert nvml_uuid("cuda") == f"GPU-{HOST_UUIDS[1]}"


def test_a_uuid_already_prefixed_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda ordinal: types.SimpleNamespace(uuid=f"GPU-{HOST_UUIDS[1]}"))
    assert nvml_uuid("cuda:0") == f"GPU-{HOST_UUIDS[1]}"


def test_an_unknown_uuid_is_unavailable_with_the_reason(host, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda ordinal: types.SimpleNamespace(uuid=FakeUuid("deadbeef-0000-0000-0000-000000000000")))
    meter = EnergyMeter("cuda:0")
    assert not meter.available and meter.joules() is None  # unavailable, never zero
    assert "GPU-deadbeef" in meter.reason and "Not Found" in meter.reason


def test_a_torch_without_the_device_is_unavailable_with_the_reason(host, monkeypatch):
    def no_device(ordinal):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device)
    meter = EnergyMeter("cuda:0")
    assert meter.joules() is None and "not compiled with CUDA" in meter.reason


def test_without_pynvml_energy_is_unavailable_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    meter = EnergyMeter("cuda:0")
    assert meter.joules() is None and "megainfer[gpu]" in meter.reason


def test_on_the_cpu_energy_is_unavailable():
    meter = EnergyMeter("cpu")
    assert meter.joules() is None and "no GPU" in meter.reason
