"""The conversion workflows, each on one shared setup step (:mod:`.setup`): :func:`convert` (a
model in memory), :func:`compress_checkpoint` (a checkpoint directory, streamed), :func:`tune`
(the smallest budget within a tolerance) and :func:`densify`."""
from .compress import compress_checkpoint
from .convert import convert, densify
from .tune import tune

__all__ = ["convert", "densify", "compress_checkpoint", "tune"]
