"""The bandwidth-pressure signal, read from NVML off the hot path.

``nvmlDeviceGetUtilizationRates().memory`` (percent of time the memory controller was busy over
the driver's sample window) costs 2-4 us a call. Where GPM is supported (Hopper), the DRAM
bandwidth utilisation metric is closer to achieved bandwidth but a sample pair costs ~1 ms, so
the controller reads it on its own cadence, never per micro-batch; pairs closer than ~100 ms
apart read NaN on the H200, and then this falls back to ``utilization.memory`` for that read. ``.gpu`` is useless here: it
reads 100% even when work is confined to 16 SMs.
"""

from __future__ import annotations

import math
import time
from typing import Any


class NvmlUnavailable(RuntimeError):
    """NVML could not be initialised (no driver, no GPU); the caller falls back to no signal."""


class MemoryActivitySampler:
    """Sample one GPU's memory activity in percent, via GPM DRAM bandwidth where supported."""

    def __init__(self, gpu: int = 0, use_gpm: bool = True) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        except Exception as exc:
            raise NvmlUnavailable(f"NVML not available for GPU {gpu}: {exc}") from exc
        self.nvml: Any = pynvml
        self.gpm = False
        self._prev: Any = None
        if use_gpm:
            try:
                support = pynvml.nvmlGpmQueryDeviceSupport(self.handle)
                self.gpm = bool(support.isSupportedDevice)
            except Exception:
                self.gpm = False
        self.source = "gpm-dram-bw" if self.gpm else "utilization.memory"

    def utilization_memory(self) -> float:
        return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).memory)

    def gpm_dram_bw(self) -> float | None:
        """DRAM bandwidth utilisation (%) between this call and the previous one (None on the first)."""
        nv = self.nvml
        cur = nv.nvmlGpmSampleAlloc()
        nv.nvmlGpmSampleGet(self.handle, cur)
        prev, self._prev = self._prev, cur
        if prev is None:
            return None
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = 1
        mg.sample1, mg.sample2 = prev, cur
        mg.metrics[0].metricId = nv.NVML_GPM_METRIC_DRAM_BW_UTIL
        nv.nvmlGpmMetricsGet(mg)
        nv.nvmlGpmSampleFree(prev)
        return float(mg.metrics[0].value)

    def sample(self) -> float:
        """One reading in percent; GPM when it works, else ``utilization.memory``."""
        if self.gpm:
            try:
                v = self.gpm_dram_bw()
                if v is not None and math.isfinite(v):  # too short an interval reads NaN
                    return v
            except Exception:
                self.gpm = False
                self.source = "utilization.memory"
        return self.utilization_memory()

    def record(self, seconds: float, period_s: float = 0.01) -> list[tuple[float, float]]:
        """A trace ``[(t, percent), ...]`` for fixtures and calibration (blocking; tools only)."""
        out = []
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < seconds:
            out.append((t, self.sample()))
            time.sleep(period_s)
        return out
