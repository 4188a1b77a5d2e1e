"""A checkpoint directory run as a model that is never whole in memory: its skeleton (parameters
on the meta device) holds the parts outside its repeated blocks (embeddings, final norm, head),
and each block is read from the checkpoint as it is called and released when it returns, so
memory holds one block at a time; or, within a budget of resident bytes, blocks once read stay
(a decoding loop calls every block once per token: reading them again costs SmolLM2-135M about a
fifth of its sampling time). A panther_lite output (``panther_lite_config.json``) gets its
sketched layers first, so its factors load into them."""
from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path
from typing import Iterator, Optional, Set

import torch
import torch.nn as nn

from ...nn.validation import check_int
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


def _block_bytes(block: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(block.parameters(), block.buffers()))


class _Kept:
    """The blocks left in memory after they ran, while they total at most ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget, self.used, self.blocks = budget, 0, set()

    def keeps(self, index: int, block: nn.Module) -> bool:
        """Whether ``block`` (number ``index``, loaded, just run) stays: kept already, or it fits."""
        if index not in self.blocks:
            size = _block_bytes(block)
            if self.used + size > self.budget:
                return False
            self.blocks.add(index)
            self.used += size
        return True


def _block_hooks(parts: SkeletonParts, block_list: BlockList, loaded: Set[int], kept: _Kept) -> list:
    """Forward hooks reading each block in before it runs (unless still loaded) and releasing it
    after (unless ``kept`` keeps it); ``loaded`` holds the blocks in memory."""
    handles = []
    for index, block in enumerate(block_list.blocks):
        def load(module, args, index=index):
            if index not in loaded:
                parts.load(index)
                loaded.add(index)

        def release(module, args, output, index=index):
            if not kept.keeps(index, module):
                parts.release(index)
                loaded.discard(index)

        handles += [block.register_forward_pre_hook(load), block.register_forward_hook(release)]
    return handles


@contextlib.contextmanager
def streamed_model(directory, dtype: Optional[torch.dtype] = None, *, resident_bytes: int = 0) -> Iterator[nn.Module]:
    """The model of the transformers checkpoint (or panther_lite output) ``directory``, in eval
    mode, its parts outside the block list loaded and each block read only while it runs; all
    released on exit. Memory: the parts outside the blocks plus one block, and ``resident_bytes``
    more at most: the blocks that ran first stay in memory while they total at most that (0:
    none stays). A model with no list of repeated blocks, or whose blocks share parameters, is
    a ValueError (load it whole).

    Example::

        with streamed_model("SmolLM2-135M", resident_bytes=2**30) as model:  # its 30 blocks stay
            for step in range(256):
                logits = model(input_ids=ids, cache=cache).logits  # the checkpoint read once
    """
    resident_bytes = check_int("resident_bytes", resident_bytes, minimum=0)
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
    loaded: Set[int] = set()
    handles = _block_hooks(parts, block_list, loaded, _Kept(resident_bytes))
    parts.load(None)
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for index in sorted(loaded):  # those kept, and one a failed forward left
            parts.release(index)
        parts.release(None)
