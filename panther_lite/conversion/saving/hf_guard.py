"""The guard in a saved ``config.json`` that makes transformers fail loudly, instead of loading
random weights, when panther_lite's plugin is not registered (panther_lite not imported).

transformers only warns about an unknown ``quant_method`` and then initialises every missing
dense weight at random. So each ``config.json`` recording a panther_lite conversion also names
a weights file that transformers refuses with a ValueError quoting it
(``"transformers_weights": "panther_lite output: import panther_lite before from_pretrained"``);
the plugin lifts the guard before transformers looks for the weights. transformers' own
``config.save_pretrained`` drops that key, so a converted or loaded model saves through
:mod:`.hf_recording`, which writes the guard again after transformers' save.

Example::

    guard_saved_configs(directory)      # after writing config.json files under directory
    # transformers alone: ValueError "...(*.safetensors.index.json): panther_lite output: import panther_lite ..."
"""
from __future__ import annotations

import json
from pathlib import Path

from .pretrained_format import QUANT_METHOD

__all__ = ["GUARD_KEY", "GUARD", "guard_saved_configs", "lift_guard"]

GUARD_KEY = "transformers_weights"
GUARD = "panther_lite output: import panther_lite before from_pretrained (pip install panther_lite)"


def guard_saved_configs(directory: Path) -> None:
    """Add the guard to every ``config.json`` under ``directory`` whose ``quantization_config``
    is panther_lite's (a sentence-transformers save may hold several)."""
    for path in sorted(Path(directory).rglob("config.json")):
        config = json.loads(path.read_text())
        quantization = config.get("quantization_config") if isinstance(config, dict) else None
        if isinstance(quantization, dict) and quantization.get("quant_method") == QUANT_METHOD:
            config[GUARD_KEY] = GUARD
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def lift_guard(config) -> None:
    """Remove the guard from a loaded transformers ``config`` (the real weights files load)."""
    if getattr(config, GUARD_KEY, None) == GUARD:
        delattr(config, GUARD_KEY)
