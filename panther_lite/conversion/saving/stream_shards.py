"""The hidden states a resumable run carries between blocks, split by process: each rank of a run
across ``world`` processes keeps its own batches' states (batch ``i`` on rank ``i % world``) in a
file of its own, and a resumed run, on any number of processes, takes its own batches back from
whatever wrote them (one process's list, or the files of another world size).

A stream is ``(original, current)``, each one tensor per batch (the same list twice without
sequential fits). Files: ``streams/<finished>-<rank>-of-<world>.pt`` in the resume directory,
each written whole under a temporary name; only the files of the committed block count.

Example: two processes wrote batches ``[0, 2]`` and ``[1, 3]``; resumed on three, rank 1 takes
batches ``[1]``, rank 0 ``[0, 3]``; resumed on one, ``[0, 1, 2, 3]``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from .weight_files import writing

__all__ = ["save_shard", "shard_streams", "remove_shards"]

Streams = Tuple[List[Tensor], List[Tensor]]


def _path(root: Path, finished: int, rank: int, world: int) -> Path:
    return root / "streams" / f"{finished:05d}-{rank}-of-{world}.pt"


def save_shard(root: Path, finished: int, rank: int, world: int, streams: Streams) -> None:
    """Rank ``rank``'s streams after ``finished`` blocks, whole or not at all."""
    path = _path(root, finished, rank, world)
    temporary = path.with_name(path.name + ".tmp")
    with writing(temporary):
        torch.save(tuple(streams), temporary)
    os.replace(temporary, path)


def _select(parts: Iterable[Tuple[int, Streams]], written: int, rank: int, world: int) -> Optional[Streams]:
    """The batches ``i % world == rank`` of ``parts`` (``(k, streams)``: rank ``k``'s of ``written``
    processes, its ``j``-th batch being batch ``k + j·written``), in batch order."""
    original, current, same, seen = {}, {}, True, False
    for k, (first, second) in parts:
        seen, same = True, same and first is second
        for j, (x, y) in enumerate(zip(first, second)):
            if (k + j * written) % world == rank:
                original[k + j * written], current[k + j * written] = x, y
    if not seen:
        return None
    order = sorted(original)
    kept = [original[i] for i in order]
    return kept, kept if same else [current[i] for i in order]


def shard_streams(root: Path, progress: dict, rank: int = 0, world: int = 1) -> Optional[Streams]:
    """Rank ``rank``'s streams (of ``world`` processes) at the commit ``progress`` describes (its
    ``streams``, or its ``shards`` processes' files); None when the commit kept none."""
    written = progress.get("shards", 0)
    if not written:
        streams = progress["streams"]
        return None if streams is None else _select([(0, streams)], 1, rank, world)
    finished = progress["finished"]
    parts = ((k, torch.load(_path(root, finished, k, written), weights_only=True)) for k in range(written))
    return _select(parts, written, rank, world)


def remove_shards(root: Path, keep: Optional[int] = None) -> None:
    """Every stream file but those after ``keep`` finished blocks (None: all of them)."""
    prefix = None if keep is None else f"{keep:05d}-"
    for path in (root / "streams").glob("*"):
        if prefix is None or not path.name.startswith(prefix) or path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
