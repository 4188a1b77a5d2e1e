"""Pipelines: named implementations of one seam (:class:`~panther_lite.conversion.pipelines.base.Pipeline`: plan, fit, replay) —
the whole model at once, or block by block — and :func:`choose_pipeline`, the one function that
picks the pipeline and says why."""
from .base import Conversion, Pipeline
from .by_blocks import ByBlocks
from .choice import choose_pipeline
from .whole_model import WholeModel

__all__ = ["Conversion", "Pipeline", "ByBlocks", "WholeModel", "choose_pipeline"]
