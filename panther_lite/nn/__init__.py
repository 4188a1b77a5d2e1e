"""Sketched layers (linear, conv, mixture-of-experts), their operators and tensor-core-aligned rank selection."""
from .factor_layout import use_decode_layout
from .functional import clear_factor_cache, sketched_linear
from .layer_base import SketchedLayer
from .rank_selection import SketchSize, align_rank, dense_size, select_config, sketch_size, tensor_core_multiple
from .skconv import SKConv1d, SKConv2d, SKConv3d, conv_sketch_size
from .skexperts import SKExperts
from .sklinear import SKLinear
from .stacked_linear import SKStackedLinear

__all__ = [
    "SKLinear",
    "SKConv1d",
    "SKConv2d",
    "SKConv3d",
    "SKExperts",
    "SKStackedLinear",
    "SketchedLayer",
    "conv_sketch_size",
    "sketched_linear",
    "clear_factor_cache",
    "use_decode_layout",
    "SketchSize",
    "align_rank",
    "dense_size",
    "select_config",
    "sketch_size",
    "tensor_core_multiple",
]
