"""Sketched layers, their operator and tensor-core-aligned rank selection."""
from .functional import clear_factor_cache, sketched_linear
from .layer_base import SketchedLayer
from .rank_selection import SketchSize, align_rank, dense_size, select_config, sketch_size, tensor_core_multiple
from .skconv import SKConv1d, SKConv2d, SKConv3d, conv_sketch_size
from .sklinear import SKLinear

__all__ = [
    "SKLinear",
    "SKConv1d",
    "SKConv2d",
    "SKConv3d",
    "SketchedLayer",
    "conv_sketch_size",
    "sketched_linear",
    "clear_factor_cache",
    "SketchSize",
    "align_rank",
    "dense_size",
    "select_config",
    "sketch_size",
    "tensor_core_multiple",
]
