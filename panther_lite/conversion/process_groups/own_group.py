"""A conversion's own copy of its process group (the same ranks, backend and collective timeout),
so that a failure can take it down (:meth:`~.group.ProcessGroupRun.close`, which closes its
connections: another rank's pending collective fails at once) without touching the caller's group,
which other code (``torch.distributed.nn``'s defaults, the caller's) keeps alive."""
from __future__ import annotations

import contextlib
import datetime
from typing import Iterator

import torch

from .group import ProcessGroupRun

__all__ = ["owned_copy"]


def _timeout(group, device: torch.device) -> datetime.timedelta:
    """The collective timeout ``group`` was made with (its store's where the backend does not say)."""
    options = getattr(group._get_backend(device), "options", None)
    return getattr(options, "_timeout", None) or group.get_group_store().timeout


@contextlib.contextmanager
def owned_copy(run: ProcessGroupRun) -> Iterator[ProcessGroupRun]:
    """A run on a new group of ``run``'s ranks, made by each of them (in step, as every collective)
    and destroyed at the end; e.g. ``with owned_copy(resolve_run(None)) as own: ...``."""
    dist = run.dist
    group = run.group if run.group is not None else dist.group.WORLD
    copy = dist.new_group(dist.get_process_group_ranks(group), timeout=_timeout(group, run.device),
                          backend=dist.get_backend(group), use_local_synchronization=True)
    own = ProcessGroupRun(copy, owned=True)
    del copy, group  # only ``own`` holds the copy: close() lets it go
    try:
        yield own
    finally:
        own.close()
