"""Distilling: end-to-end training of a converted model against the original — its options
(:class:`DistillConfig`), the API and its result, what is compared (outputs and losses at the real tokens), the
teacher's outputs cached once (:func:`teacher_outputs`), text the teacher samples to train on
(:func:`sampled_batches`, with its outputs kept as it samples: :func:`sampled_with_outputs`), and
the training run."""
from .config import DistillConfig
from .distillation import DistillationResult, distill, trained_parameters
from .teacher_cache import TeacherOutputs, teacher_outputs
from .teacher_samples import sampled_batches, sampled_with_outputs

__all__ = ["DistillConfig", "DistillationResult", "TeacherOutputs", "distill", "sampled_batches", "sampled_with_outputs",
           "teacher_outputs", "trained_parameters"]
