"""Sketching operators: Gaussian, scaled sign, SRHT, CountSketch and SJLT."""
from .dense import gaussian_matrix, sign_matrix
from .random import resolve_generator

__all__ = ["gaussian_matrix", "sign_matrix", "resolve_generator"]
