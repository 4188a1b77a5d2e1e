"""Sharded safetensors output written part by part: each part (a block, or everything outside
the blocks) is one file, written whole or not at all; at the end the parts become the shards
``model-00001-of-0000N.safetensors`` of a transformers checkpoint, with their index."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

from torch import Tensor

from ...extras import require
from .weight_files import SHARD_INDEX_NAME, read_header, writing

__all__ = ["write_part", "finalize_shards", "shard_name"]


def write_part(path: Path, tensors: Dict[str, Tensor]) -> None:
    """Write ``tensors`` to the safetensors file ``path`` under a temporary name, then rename it
    into place: ``path`` holds all of them or does not exist (a process killed meanwhile
    leaves at most the temporary file, rewritten by the next attempt)."""
    save_file = require("safetensors.torch", "writing safetensors shards").save_file
    temporary = path.with_name(path.name + ".tmp")
    with writing(temporary):
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, path)


def shard_name(index: int, count: int) -> str:
    """The file name transformers gives shard ``index`` (from 0) of ``count``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def finalize_shards(parts: List[Path], directory: Path) -> Path:
    """Move ``parts`` (in order) into ``directory`` as the shards of one checkpoint and write
    their index (``weight_map`` and ``metadata.total_size``, as transformers writes it); a part
    already moved by an interrupted earlier call is found in place. Returns the index's path."""
    weight_map, total = {}, 0
    for index, part in enumerate(parts):
        shard = directory / shard_name(index, len(parts))
        if not shard.exists():
            os.replace(part, shard)
        header, _ = read_header(shard)
        for name, entry in header.items():
            weight_map[name] = shard.name
            begin, end = entry["data_offsets"]
            total += end - begin
    index_path = directory / SHARD_INDEX_NAME
    record = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with writing(index_path):
        index_path.write_text(json.dumps(record, indent=2) + "\n")
    return index_path
