"""panther_lite: low-rank sketched layers for PyTorch."""
from . import nn, sketch
from .nn import SKLinear

__version__ = "0.1.0"

__all__ = ["SKLinear", "nn", "sketch", "__version__"]
