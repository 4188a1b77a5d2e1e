"""Distilling: end-to-end training of a converted model against the original — the API and its
result, what is compared (outputs and losses at the real tokens), and the training run."""
from .distillation import DistillationResult, distill, trained_parameters

__all__ = ["DistillationResult", "distill", "trained_parameters"]
