"""Distilling: end-to-end training of a converted model against the original — its options
(:class:`DistillConfig`), the API and its result, what is compared (outputs and losses at the real tokens), and the training run."""
from .config import DistillConfig
from .distillation import DistillationResult, distill, trained_parameters

__all__ = ["DistillConfig", "DistillationResult", "distill", "trained_parameters"]
