"""Where a measurement runs: argument checks, the device and its name, and the layer
warnings a measurement silences on purpose."""
from __future__ import annotations

import contextlib
import math
import platform
import warnings
from typing import Union

import torch

DeviceLike = Union[str, torch.device]


def check_int(name: str, value: int, minimum: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_non_negative(name: str, value: float) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite real number ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def as_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device``; only CPU and CUDA devices can be timed."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    return device


def device_name(device: DeviceLike) -> str:
    """The accelerator's name, or the CPU's with the number of threads torch uses."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()} ({torch.get_num_threads()} threads)"


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@contextlib.contextmanager
def ignore_size_warnings():
    """Silence the layers' warning that a configuration stores more than the dense layer
    (a sweep measures such configurations on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*more than the dense layer.*", category=UserWarning)
        yield
