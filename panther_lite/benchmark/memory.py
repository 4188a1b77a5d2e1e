"""Memory: parameter counts and bytes, the activations autograd saves for backward, the
footprint of a training forward (the allocator's peak on CUDA), a process's peak resident
memory sampled in a thread, and a command's peak resident memory as the kernel counts it."""
from __future__ import annotations

import itertools
import os
import resource
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from ..nn import SketchSize


def _storage_key(t: Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr())


def _storage_bytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def count_parameters(module: nn.Module) -> SketchSize:
    """Entries of ``module``'s parameters (``trainable``) and of its parameters plus
    buffers (``stored``: the fixed U sketches are stored, though never trained)."""
    trainable = sum(p.numel() for p in module.parameters())
    return SketchSize(trainable=trainable, stored=trainable + sum(b.numel() for b in module.buffers()))


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each storage counted once
    (tied or aliased tensors are not double-counted)."""
    seen = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        seen.setdefault(_storage_key(t), _storage_bytes(t))
    return sum(seen.values())


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[Tensor] = ()) -> int:
    """Bytes autograd saves for backward while ``fn()`` runs.

    Every tensor packed by autograd is counted by its whole storage, once per storage
    (a saved view and its base, or a tensor saved by two ops, count once). Tensors
    sharing a storage with one in ``exclude`` (typically the module's parameters and
    buffers, which exist anyway) are not counted.

    Args:
        fn: runs the forward with autograd recording (its result is discarded).
        exclude: tensors whose storages are not activations.
    """
    skip = {_storage_key(t) for t in exclude}
    seen: Dict[tuple, int] = {}
    alive: List[Tensor] = []  # holds saved tensors so that no storage address is reused meanwhile

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in skip and key not in seen:
            seen[key] = _storage_bytes(t)
            alive.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def training_memory_bytes(module: nn.Module, *inputs: Tensor) -> int:
    """Memory footprint in bytes of ``module(*inputs)`` with autograd recording.

    CUDA: the allocator's peak above what was allocated before the call, plus
    :func:`parameter_bytes` of the module (so temporaries, the output and the saved
    activations all count). CPU: :func:`parameter_bytes` plus
    :func:`saved_activation_bytes` of the forward.
    """
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    device = inputs[0].device if inputs else (tensors[0].device if tensors else torch.device("cpu"))
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.enable_grad():
                module(*inputs)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
        return int(extra) + parameter_bytes(module)

    def forward() -> None:
        with torch.enable_grad():
            module(*inputs)

    return parameter_bytes(module) + saved_activation_bytes(forward, tensors)


class ResidentPeak:
    """Context manager sampling this process's resident memory (``/proc/self/statm``, Linux)
    every millisecond in a thread; ``peak`` is the largest seen (bytes), ``now()`` the current."""

    def __init__(self) -> None:
        self.peak, self._running = self.now(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def now() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __enter__(self) -> "ResidentPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()


def _high_water_mark(pid: int) -> Optional[int]:
    """``VmHWM`` of a live process (its peak resident memory so far, bytes); None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    found = next((line.split()[1] for line in lines if line.startswith("VmHWM:")), None)
    return None if found is None else int(found) * 1024


def command_peak(argv: Sequence[str], env: Optional[dict] = None, log=None, every: float = 10.0) -> Dict[str, float]:
    """Run ``argv`` to its end and measure it: ``{"seconds", "peak_bytes", "returncode"}``, the
    peak being its resident memory's high-water mark as the kernel keeps it (``ru_maxrss``
    from ``wait4``; Linux). With ``log`` (a text file), a line ``seconds,peak_bytes`` is written
    every ``every`` seconds while it runs, so a run that cannot finish leaves its figures."""
    started = time.perf_counter()
    process = subprocess.Popen(list(argv), env=env)
    next_log = started
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        now = time.perf_counter()
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return dict(seconds=now - started, peak_bytes=usage.ru_maxrss * 1024, returncode=process.returncode)
        if log is not None and now >= next_log:
            log.write(f"{now - started:.0f},{_high_water_mark(process.pid)}\n")
            log.flush()
            next_log = now + every
        time.sleep(0.2)
