"""Energy drawn by the GPU an engine runs on, from NVML's total-energy counter (pynvml,
the `gpu` extra). Where there is no NVML device the meter says so and why: energy is then
unavailable, never reported as zero."""

from __future__ import annotations


class EnergyMeter:
    def __init__(self, device: str) -> None:
        self.available = False
        self.reason = ""
        self._handle = None
        self._start_mj = 0
        if not device.startswith("cuda"):
            self.reason = f"no GPU: the engine runs on {device!r}"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(device.split(":")[1]) if ":" in device else 0
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self._pynvml = pynvml
            self.available = True
        except ImportError:
            self.reason = "pynvml is not installed (pip install 'megainfer[gpu]')"
        except Exception as exc:  # NVMLError_* when the driver or the counter is missing
            self.reason = f"NVML cannot read the energy counter ({exc})"

    def joules(self) -> float | None:
        """Energy since the meter was made, or None where unavailable."""
        if not self.available:
            return None
        return (self._pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj) / 1e3
