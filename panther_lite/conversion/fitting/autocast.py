"""Training under ``torch.autocast``: the dtype (``"auto"``: bfloat16 where native), its context, float16's loss scaler.

The forward and backward run in the autocast dtype while the parameters, their gradients and
Adam's state stay in float32 (mixed-precision training, Micikevicius et al. 2018). bfloat16
keeps float32's range, so its gradients need no scaling; float16's smallest normal is 6e-5,
so its loss is scaled (``torch.amp.GradScaler``) before the backward and the gradients
unscaled before the step, which is skipped when they overflow.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional, Union

import torch

__all__ = ["AUTOCAST_CHOICES", "autocast_run", "check_autocast", "loss_scaler", "native_bfloat16", "resolve_autocast"]

AUTOCAST_CHOICES = ("auto", "bfloat16", "float16")
_NAMED = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_BFLOAT16_UNITS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's probes (torch >= 2.1)


def check_autocast(autocast, caller: str) -> Union[None, str, torch.dtype]:
    """``autocast`` as None, ``"auto"``, ``torch.bfloat16`` or ``torch.float16`` (their names
    accepted); ValueError naming the choices otherwise.

    Examples:
        >>> check_autocast("bfloat16", "distill")
        torch.bfloat16
        >>> check_autocast("auto", "distill"), check_autocast(None, "distill")
        ('auto', None)
    """
    if autocast is None or autocast == "auto":
        return autocast
    dtype = _NAMED.get(autocast) if isinstance(autocast, str) else autocast
    if dtype not in _NAMED.values():
        raise ValueError(f"{caller}: autocast must be None, 'auto', torch.bfloat16 or torch.float16 (or 'bfloat16', "
                         f"'float16'), got {autocast!r}")
    return dtype


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA device of compute capability 8.0
    or later, a CPU with AVX512-BF16 or AMX. Elsewhere bfloat16 is emulated and slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in _CPU_BFLOAT16_UNITS)
    return False


def resolve_autocast(autocast: Union[None, str, torch.dtype], device: torch.device) -> Optional[torch.dtype]:
    """The dtype to train in on ``device``: ``"auto"`` is bfloat16 where :func:`native_bfloat16`,
    else None (the parameters' own float32); a dtype or None is itself."""
    if autocast == "auto":
        return torch.bfloat16 if native_bfloat16(device) else None
    return autocast


def autocast_run(dtype: Optional[torch.dtype], device: torch.device) -> ContextManager:
    """``torch.autocast`` on ``device`` in ``dtype``; no context at all when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def loss_scaler(dtype: Optional[torch.dtype], device: torch.device) -> torch.amp.GradScaler:
    """A ``GradScaler`` on ``device``, enabled for float16 only (disabled, it scales by 1 and
    steps plainly)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
