"""panther_lite: low-rank sketched layers for PyTorch."""
from . import benchmark, nn, sketch
from .nn import SKConv2d, SKLinear
from .convert import apply_conversion_config, conversion_config, conversion_summary, convert, densify

__version__ = "0.1.0"

__all__ = [
    "SKLinear",
    "SKConv2d",
    "convert",
    "densify",
    "conversion_summary",
    "conversion_config",
    "apply_conversion_config",
    "benchmark",
    "nn",
    "sketch",
    "__version__",
]
