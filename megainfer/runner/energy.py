"""Energy drawn by the GPU an engine runs on, from NVML's total-energy counter (pynvml,
the `gpu` extra). Where there is no NVML device the meter says so and why: energy is then
unavailable, never reported as zero.

The GPU is found by UUID. NVML numbers every GPU on the host and ignores
CUDA_VISIBLE_DEVICES, while a CUDA ordinal counts only the visible ones: under Ray each
actor sees its own GPU as cuda:0, so NVML's index 0 would be physical GPU 0 for all of them."""

from __future__ import annotations


def nvml_uuid(device: str) -> str:
    """NVML's name ("GPU-<uuid>") for the GPU behind a torch device string ("cuda", "cuda:1")."""
    import torch

    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    # torch's UUID prints as the bare 8-4-4-4-12 hex form; NVML prefixes it with "GPU-".
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


class EnergyMeter:
    def __init__(self, device: str) -> None:
        self.available = False
        self.reason = ""
        self._handle = None
        self._start_mj = 0  # millijoules, NVML's counter when the meter was made
        if not device.startswith("cuda"):
            self.reason = f"no GPU: the engine runs on {device!r}"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "pynvml is not installed (pip install 'megainfer[gpu]')"
            return
        self._pynvml = pynvml
        try:
            uuid = nvml_uuid(device)
        except Exception as exc:  # torch without CUDA, or an ordinal that is not visible
            self.reason = f"cannot identify the GPU behind {device!r} ({exc})"
            return
        self.reason = self._open(uuid)
        self.available = not self.reason

    def _open(self, uuid: str) -> str:
        """Binds the meter to the NVML device `uuid`; returns why it cannot, or ""."""
        pynvml = self._pynvml
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except pynvml.NVMLError as exc:  # no driver, no such device (a MIG instance), no counter
            return f"NVML cannot read the energy counter of {uuid} ({exc})"
        return ""

    def joules(self) -> float | None:
        """Energy since the meter was made, or None where unavailable."""
        if not self.available:
            return None
        return (self._pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj) / 1e3
