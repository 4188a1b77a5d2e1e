"""Float32 master copies of half-precision parameters, for training a float16/bfloat16 model.

The model runs forward and backward in its own dtype; the optimizer steps float32 copies
(the "master weights" of mixed-precision training, Micikevicius et al. 2018), and each step
is rounded back into the model. Updates smaller than half a unit in the last place of a
bfloat16 value (2⁻⁸ relative) would be lost if applied to the parameter itself; applied to
the master copy they accumulate until they show. Float32 and float64 parameters are their
own masters (no copy). Memory: 4 bytes per half-precision parameter element.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["HALF_DTYPES", "MasterWeights"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


class MasterWeights:
    """``tensors``: what the optimizer steps, one per parameter (a float32 copy of a
    half-precision one, else the parameter itself). Call :meth:`take_gradients` after the
    backward and :meth:`write_back` after the optimizer's step."""

    def __init__(self, parameters: Sequence[nn.Parameter]) -> None:
        self.parameters = list(parameters)
        self.tensors: List[Tensor] = [
            p.detach().float() if p.dtype in HALF_DTYPES else p for p in self.parameters
        ]
        self.float16 = any(p.dtype == torch.float16 for p in self.parameters)

    def _copies(self):
        return [(p, m) for p, m in zip(self.parameters, self.tensors) if m is not p]

    def take_gradients(self) -> None:
        """Move each half-precision parameter's gradient onto its master, in float32."""
        for parameter, master in self._copies():
            master.grad = None if parameter.grad is None else parameter.grad.float()
            parameter.grad = None

    def write_back(self) -> None:
        """Round the masters into the model's parameters."""
        with torch.no_grad():
            for parameter, master in self._copies():
                parameter.copy_(master)
