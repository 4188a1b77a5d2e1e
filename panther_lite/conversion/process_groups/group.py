"""The process group a conversion runs across and its collectives: sums gathered and added in
rank order (the same bits on every rank, run to run), flags agreed, rank 0's values broadcast;
a failed or timed-out collective becomes one clear :class:`DistributedError`."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["DistributedError", "ProcessGroupRun", "active_run", "running_on"]


class DistributedError(RuntimeError):
    """A collective of a conversion across processes failed (a rank died or timed out); ``what``
    names the collective (e.g. "barrier (the hidden states after block 1 written)")."""

    def __init__(self, message: str, what: str = "exchange") -> None:
        super().__init__(message)
        self.what = what


class ProcessGroupRun:
    """One conversion's process group: ``rank`` and ``world`` in it, and its collectives.
    Tensors travel on the backend's device (CUDA for NCCL, the CPU otherwise). ``owned``: a group
    the conversion made for itself (:func:`~.own_group.owned_copy`), which :meth:`close` destroys."""

    def __init__(self, group=None, owned: bool = False) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.owned, self.closed = dist, group, owned, False
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")

    def close(self) -> None:
        """An owned group destroyed and let go, which closes its connections: a collective another
        rank waits in on this one fails at once; this run's later collectives raise. A group the
        caller gave (or the default one) is left as it is."""
        if self.owned and not self.closed:
            self.closed, group, self.group = True, self.group, None
            if self.dist.is_initialized():
                self.dist.destroy_process_group(group)

    def _collective(self, what: str, call):
        if self.closed:
            raise DistributedError(f"panther_lite: the {what} across {self.world} processes: the run's process "
                                   "group was closed after a failure", what)
        try:
            return call()
        except Exception as error:  # gloo/NCCL raise RuntimeError (DistBackendError) on a lost peer or a timeout
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DistributedError(
                f"panther_lite: the {what} across {self.world} processes failed on rank {self.rank} "
                f"({first}); another rank stopped or timed out (see its log). A compress_checkpoint run leaves "
                "its staging directory: rerun with resume=True (--resume)", what
            ) from error

    def sum_in_rank_order(self, tensors: Sequence[Tensor], what: str) -> List[Tensor]:
        """Each tensor summed over the ranks as ``((t_0 + t_1) + t_2) + …`` on every rank (gathered,
        then added in rank order: deterministic, unlike a reduction tree); results on each tensor's
        device and dtype. Tensors of one dtype travel as one flat buffer."""
        results: List[Optional[Tensor]] = [None] * len(tensors)
        by_dtype = {}
        for index, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(index)
        for dtype in sorted(by_dtype, key=str):
            indices = by_dtype[dtype]
            flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device) for i in indices])
            gathered = [torch.empty_like(flat) for _ in range(self.world)]
            self._collective(f"all-gather of {what}", lambda: self.dist.all_gather(gathered, flat, group=self.group))
            total = gathered[0].clone()
            for part in gathered[1:]:
                total += part
            offset = 0
            for i in indices:
                size = tensors[i].numel()
                results[i] = total[offset:offset + size].reshape(tensors[i].shape).to(tensors[i].device)
                offset += size
        return results  # type: ignore[return-value]

    def sum_ints(self, values: Sequence[int], what: str) -> List[int]:
        """Integers summed over the ranks (exact)."""
        if not values:
            return []
        summed = self.sum_in_rank_order([torch.tensor(list(values), dtype=torch.int64)], what)[0]
        return [int(v) for v in summed.tolist()]

    def any(self, flags: Sequence[bool], what: str) -> List[bool]:
        """Each flag True on some rank."""
        return [count > 0 for count in self.sum_ints([int(bool(f)) for f in flags], what)]

    def from_first(self, value, what: str):
        """Rank 0's ``value`` (any picklable object) on every rank."""
        box = [value]
        self._collective(
            f"broadcast of {what}",
            lambda: self.dist.broadcast_object_list(box, src=self.dist.get_global_rank(self.group, 0)
                                                    if self.group is not None else 0, group=self.group),
        )
        return box[0]

    def gather_objects(self, value, what: str) -> list:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        found = [None] * self.world
        self._collective(f"all-gather of {what}", lambda: self.dist.all_gather_object(found, value, group=self.group))
        return found

    def barrier(self, what: str) -> None:
        self._collective(f"barrier ({what})", lambda: self.dist.barrier(group=self.group))


_ACTIVE: contextvars.ContextVar[Optional[ProcessGroupRun]] = contextvars.ContextVar("panther_lite_run", default=None)


def active_run() -> Optional[ProcessGroupRun]:
    """The process group of the conversion running now (None: one process)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def running_on(run: Optional[ProcessGroupRun]) -> Iterator[None]:
    """``run`` is the active process group for the duration."""
    token = _ACTIVE.set(run)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
