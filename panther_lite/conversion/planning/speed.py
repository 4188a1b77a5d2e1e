"""Whether a sketched layer would run slower than its dense layer at the size the user runs.

Modelled, not measured (a measurement inside ``convert`` would make its result depend on the
machine's load): a GEMM call costs a fixed launch/dispatch overhead plus its FLOPs at the
device's throughput,

    t_dense  = c + 2·rows·fan_in·fan_out / P
    t_sketch = 2c + 2·rows·2Lk·(fan_in + fan_out) / P      (two GEMM chains of width 2Lk)

with ``rows`` the rows per call (batch × tokens for a linear layer, batch × output positions
for a convolution). The constants are deliberately round: ``c`` = 5 µs on CPU and CUDA
(PyTorch's eager dispatch plus a kernel launch), ``P`` = 100 GFLOP/s on CPU and 100 TFLOP/s on
CUDA. A sketch pays when the FLOPs it saves take longer than one extra call.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..records import KEPT_DENSE, LayerRecord

CALL_OVERHEAD_S = 5e-6
THROUGHPUT_FLOPS = {"cpu": 1e11, "cuda": 1e14}


def modelled_seconds(fan_in: int, fan_out: int, rows: int, device: torch.device, width: Optional[int] = None) -> float:
    """Modelled time of one call: the dense layer (``width=None``) or a sketch whose GEMM
    chains have ``width = 2Lk`` columns."""
    throughput = THROUGHPUT_FLOPS.get(device.type, THROUGHPUT_FLOPS["cuda"])
    if width is None:
        return CALL_OVERHEAD_S + 2 * rows * fan_in * fan_out / throughput
    return 2 * CALL_OVERHEAD_S + 2 * rows * width * (fan_in + fan_out) / throughput


def keep_slower_layers_dense(records: List[LayerRecord], rows: Optional[int]) -> None:
    """Mark kept dense, with the modelled times as the reason, every planned record whose
    sketch would be slower than the dense layer at ``rows`` rows per call (None: no check)."""
    if rows is None:
        return
    for part in [part for record in records for part in record.parts]:
        if not part.to_convert:
            continue
        device = part.device
        dense = modelled_seconds(part.fan_in, part.fan_out, rows, device)
        width = 2 * part.num_terms * part.low_rank
        sketch = modelled_seconds(part.fan_in, part.fan_out, rows, device, width)
        if sketch > dense:
            part.skip(
                KEPT_DENSE,
                f"slower than dense at {rows:,} rows per call (modelled: {sketch * 1e6:.1f} µs sketched vs "
                f"{dense * 1e6:.1f} µs dense; the saved FLOPs do not pay for a second GEMM call)",
            )
