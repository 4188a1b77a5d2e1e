"""A checkpoint directory run as a model that is never whole in memory: its skeleton (parameters
on the meta device) holds the parts outside its repeated blocks (embeddings, final norm, head),
and each block is read from the checkpoint as it is called and released when it returns, so
memory holds one block at a time. A panther_lite output (``panther_lite_config.json``) gets its
sketched layers first, so its factors load into them."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator, List, Optional

import torch
import torch.nn as nn

from .blocks import BlockList, repeated_block_list
from .skeleton_parts import SkeletonParts
from ..saving.checkpoint_files import CheckpointFiles
from ..saving.pretrained_format import PRETRAINED_CONFIG_NAME
from ..saving.serialization import swap_in_conversion

__all__ = ["streamed_model"]


def _skeleton(directory: Path, files: CheckpointFiles, dtype: Optional[torch.dtype]) -> nn.Module:
    """The model ``directory`` holds, on the meta device, with its recorded sketched layers."""
    model = files.skeleton(dtype)
    record = directory / PRETRAINED_CONFIG_NAME
    if record.is_file():
        try:
            conversion = json.loads(record.read_text())["conversion"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{str(record)!r} is not a panther_lite save record: {error}") from None
        swap_in_conversion(model, conversion)
    return model


def _block_hooks(parts: SkeletonParts, block_list: BlockList, loaded: List[int]) -> list:
    """Forward hooks reading each block in before it runs and releasing it after."""
    handles = []
    for index, block in enumerate(block_list.blocks):
        def load(module, args, index=index):
            parts.load(index)
            loaded.append(index)

        def release(module, args, output, index=index):
            parts.release(index)
            loaded.remove(index)

        handles += [block.register_forward_pre_hook(load), block.register_forward_hook(release)]
    return handles


@contextlib.contextmanager
def streamed_model(directory, dtype: Optional[torch.dtype] = None) -> Iterator[nn.Module]:
    """The model of the transformers checkpoint (or panther_lite output) ``directory``, in eval
    mode, its parts outside the block list loaded and each block read only while it runs; all
    released on exit. Memory: the parts outside the blocks plus one block. A model with no list
    of repeated blocks, or whose blocks share parameters, is a ValueError (load it whole)."""
    directory = Path(directory)
    files = CheckpointFiles(directory)
    model = _skeleton(directory, files, dtype)
    block_list = repeated_block_list(model)
    if block_list is None:
        raise ValueError(f"{str(directory)!r}: the model has no list of repeated blocks to stream; load it whole")
    parts = SkeletonParts(model, files, block_list)
    tied, missing = parts.ties_across_parts(), parts.missing()
    if tied:
        raise ValueError(f"{str(directory)!r}: parameters tied across blocks ({', '.join(tied[0])}); load it whole")
    if missing:
        raise ValueError(f"{str(directory)!r}: the checkpoint holds no {', '.join(missing[:3])}")
    loaded: List[int] = []
    handles = _block_hooks(parts, block_list, loaded)
    parts.load(None)
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for index in list(loaded):  # a forward that failed inside a block
            parts.release(index)
        parts.release(None)
