"""Reading safetensors weight files (one file or a sharded set), with errors naming the file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import torch

from ...extras import require

WEIGHTS_NAME = "model.safetensors"
SHARD_INDEX_NAME = "model.safetensors.index.json"


def load_weights_file(path: Path) -> Dict[str, torch.Tensor]:
    """The tensors of one safetensors file; ValueError naming the file when it is truncated,
    corrupt or not a safetensors file at all."""
    load_file = require("safetensors.torch", "reading a safetensors weights file").load_file
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        message = f"{str(path)!r} is not a readable safetensors file (truncated or corrupt?): {error}"
        raise ValueError(message) from error


def read_weights(directory: Path) -> Dict[str, torch.Tensor]:
    """The tensors of a transformers-style weights file, or of all its shards."""
    if (directory / WEIGHTS_NAME).is_file():
        return load_weights_file(directory / WEIGHTS_NAME)
    index = directory / SHARD_INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"{str(directory)!r} has neither {WEIGHTS_NAME} nor {SHARD_INDEX_NAME}")
    tensors: Dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_weights_file(directory / shard))
    return tensors
