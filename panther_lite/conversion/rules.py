"""Deprecated alias, removed in the next release: ``progress_bar`` moved to
:mod:`panther_lite.conversion.progress`, ``layer_seed`` to :mod:`panther_lite.conversion.fitting.layer`
and ``cache_device`` to :mod:`panther_lite.conversion.config`."""
import warnings

from .config import cache_device
from .fitting.layer import layer_seed
from .progress import progress_bar

__all__ = ["layer_seed", "cache_device", "progress_bar"]

warnings.warn(
    "panther_lite.conversion.rules is deprecated: import progress_bar from panther_lite.conversion.progress, "
    "layer_seed from panther_lite.conversion.fitting.layer and cache_device from panther_lite.conversion.config",
    DeprecationWarning, stacklevel=2,
)
