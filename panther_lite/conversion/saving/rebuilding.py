"""Rebuilding a converted layout in a fresh copy of the dense model by hand:
:func:`apply_conversion_config`, whose model then saves like any other converted model."""
from __future__ import annotations

from typing import Mapping

import torch.nn as nn

from .hf_recording import record_conversion_on_save
from .serialization import swap_in_conversion

__all__ = ["apply_conversion_config"]


def apply_conversion_config(model: nn.Module, config: Mapping) -> nn.Module:
    """Swap the layers listed in ``config`` (from :func:`~panther_lite.conversion_config`) for
    sketched (or frozen) layers of the recorded sizes, in place, so a converted model's
    ``state_dict`` loads into ``model``, a fresh instance of the original architecture.

    No fitting happens: the new layers hold placeholder values until the state_dict is loaded
    (on the meta device, meta layers to load with ``assign=True``). The whole config is checked
    first, and on any error ``model`` is unchanged (the rules:
    :func:`~panther_lite.conversion.saving.serialization.swap_in_conversion`). A transformers
    model's own ``save_pretrained`` then records the conversion and the guard, as after
    :func:`~panther_lite.convert` (:mod:`.hf_recording`), so that save never loads elsewhere as a
    dense model with random weights.

    Args:
        model: the dense model, any ``nn.Module``.
        config: a conversion config, ``{"format", "version", "layers": [...]}``.

    Returns:
        ``model``.

    Example::

        config = panther_lite.conversion_config(converted)
        fresh = panther_lite.apply_conversion_config(AutoModelForCausalLM.from_config(cfg), config)
        fresh.load_state_dict(converted.state_dict())
        fresh.save_pretrained(out)   # records the conversion: AutoModel*.from_pretrained(out) rebuilds it
    """
    swap_in_conversion(model, config)
    record_conversion_on_save(model)
    return model
