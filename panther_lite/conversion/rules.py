"""The rules every conversion stage shares, each written once: the seed of a layer's fit, where
cached activations live, and progress bars (tqdm, imported only when a bar is shown)."""
from __future__ import annotations

import sys
from typing import Iterable, Optional, Union

import torch

from ..nn.validation import check_bool

__all__ = ["layer_seed", "cache_device", "progress_bar"]


def layer_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of the fit of layer ``index`` of a plan: ``seed + index`` (None stays None)."""
    return None if seed is None else seed + index


def cache_device(calibration_device: Optional[torch.device]) -> torch.device:
    """Where cached block inputs and outputs live: the calibration device, else the CPU."""
    return calibration_device or torch.device("cpu")


def progress_bar(
    iterable: Union[Iterable, None], desc: str, unit: str, progress: Optional[bool], total: Optional[int] = None
):
    """``iterable`` wrapped in a tqdm bar (``iterable`` None: a bar of ``total`` steps to
    ``update`` by hand); ``progress`` None shows it on a terminal only (tqdm's
    ``disable=None``), False never imports tqdm and returns ``iterable`` itself."""
    if progress is not None:
        check_bool("progress", progress)
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=None if progress is None else not progress)
