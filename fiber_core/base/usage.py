"""What this process uses of its machine: CPU, memory and, where one is visible, a GPU.

A pool worker sends a sample with each heartbeat, so that the live view can show what
every worker uses. Reading it costs a few microseconds: the CPU from the process's own
clock (``time.process_time``), its resident memory from ``/proc/self/statm`` (where there
is none, the peak that ``resource`` keeps), and a GPU through ``pynvml`` only if that
imports and finds a device, at most every :data:`GPU_SAMPLE_SECONDS`. Nothing here is
required: what cannot be read is ``None``.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

GPU_SAMPLE_SECONDS = 5.0
"""How often the GPU is read at most (NVML calls take milliseconds); between two reads a
sample repeats the last values."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident memory in bytes (its peak, where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        pass
    try:
        import resource  # only where /proc is missing (macOS): ru_maxrss is bytes there
    except ImportError:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


class Gpu:
    """The GPU this process sees, through NVML: its utilisation and the memory this process
    holds on it (or the device's used memory, where NVML does not list processes)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        self._tried = False
        self._at = 0.0
        self._last: tuple[float | None, int | None] = (None, None)

    def _open(self) -> None:
        self._tried = True
        try:
            import pynvml  # optional, and only on first use: most workers have no GPU

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() < 1:
                return
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            index = int(visible) if visible.isdigit() else 0
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # not installed, no driver, no device, a UUID we do not map
            self._nvml = self._handle = None

    def read(self, now: float) -> tuple[float | None, int | None]:
        """(utilisation %, memory bytes), or (None, None) without a GPU; read again only
        :data:`GPU_SAMPLE_SECONDS` after the last read."""
        if not self._tried:
            self._open()
        if self._nvml is None or now - self._at < GPU_SAMPLE_SECONDS and self._at:
            return self._last
        self._at = now
        nvml, handle = self._nvml, self._handle
        try:
            util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            memory = None
            pid = os.getpid()
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    memory = int(p.usedGpuMemory)
            if memory is None:
                memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            self._last = (util, memory)
        except Exception:
            self._last = (None, None)
        return self._last


class Sampler:
    """Samples of this process's use: the CPU of each is the share of one CPU since the last."""

    def __init__(self) -> None:
        self._wall = time.monotonic()
        self._cpu = time.process_time()
        self.gpu = Gpu()

    def sample(self) -> dict[str, Any]:
        """``{"cpu": % of one CPU since the last sample, "rss": bytes, "gpu": % or None,
        "gpu_memory": bytes or None}``."""
        wall, cpu = time.monotonic(), time.process_time()
        span = wall - self._wall
        percent = 100.0 * (cpu - self._cpu) / span if span > 0 else 0.0
        self._wall, self._cpu = wall, cpu
        gpu, gpu_memory = self.gpu.read(wall)
        return {"cpu": round(max(0.0, percent), 1), "rss": rss_bytes(), "gpu": gpu,
                "gpu_memory": gpu_memory}


_default: Sampler | None = None


def sample() -> dict[str, Any]:
    """A sample of this process's use (:meth:`Sampler.sample`), against the last call's."""
    global _default
    if _default is None:
        _default = Sampler()
    return _default.sample()
