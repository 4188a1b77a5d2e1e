"""Command-line argument types that reject bad values with a usable message, and the dtype
names they accept (the ``compress`` command's; the benchmark scripts use them too)."""
from __future__ import annotations

import argparse
import math

import torch

__all__ = ["DTYPES", "positive_int", "non_negative_int", "non_negative_float", "positive_float"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def positive_int(text: str) -> int:
    """``argparse`` type: an integer >= 1."""
    return _bounded(text, int, 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """``argparse`` type: an integer >= 0."""
    return _bounded(text, int, 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    """``argparse`` type: a finite number >= 0."""
    return _bounded(text, float, 0.0, "a finite number >= 0")


def positive_float(text: str) -> float:
    """``argparse`` type: a finite number > 0."""
    value = _bounded(text, float, 0.0, "a finite number > 0")
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _bounded(text: str, kind: type, minimum, expected: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not math.isfinite(value) or value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value
