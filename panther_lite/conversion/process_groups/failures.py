"""A rank's failure in the middle of a run across processes told to every rank: the failing rank
leaves its error's text in the process group's store and takes the group down, so the others'
pending (or next) collective fails at once rather than at the collective timeout; each of them
then raises a :class:`RankFailed` quoting that error. No rank waits past the store's timeout
(``init_process_group``'s ``timeout``, torchrun's ``--collective-timeout``).

Example: rank 0 runs out of disk while writing block 3; rank 1, waiting at the all-gather of the
next block's Grams, raises ``RankFailed: panther_lite: rank 0 of 2 processes failed (OSError:
[Errno 28] No space left on device); rank 1 stopped at the all-gather of ... A compress_checkpoint
run leaves its staging directory: rerun with resume=True (--resume)``."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

from .group import DistributedError, ProcessGroupRun

__all__ = ["FailureNotes", "RankFailed"]

_RESUME = "A compress_checkpoint run leaves its staging directory: rerun with resume=True (--resume)"


class RankFailed(DistributedError):
    """Another rank's run raised (its error quoted); this rank stopped with it."""


class FailureNotes:
    """The failure notes of one run in ``run``'s store, under ``token`` (the same on every rank,
    fresh for each run, so one run never reads another's). ``run`` should own its group
    (:func:`~.own_group.owned_copy`): closed on every rank after a failure, a run stopped
    half-way leaves no collectives out of step; a group the caller owns stays open, and a rank
    waiting on the failed one then stops at the collective timeout or when that process exits."""

    def __init__(self, run: ProcessGroupRun, token: str) -> None:
        group = run.group if run.group is not None else run.dist.group.WORLD
        self.run, self.store, self.prefix = run, group.get_group_store(), f"panther_lite/{token}"

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    @contextlib.contextmanager
    def sharing(self) -> Iterator[None]:
        """The run inside: an error leaving it goes through :meth:`handle`."""
        try:
            yield
        except BaseException as error:
            self.handle(error)
            raise

    def handle(self, error: BaseException) -> None:
        """Called with the error ending this rank's run (the caller re-raises it): a failed
        collective behind which another rank's failure was told becomes :class:`RankFailed`
        (raised here); this rank's own error is told to the others, who are then awaited."""
        if isinstance(error, RankFailed) or not isinstance(error, (Exception, KeyboardInterrupt)):
            return
        if isinstance(error, DistributedError):
            told = self._told()
            self._leave()
            if told is not None:
                rank, text = told
                raise RankFailed(
                    f"panther_lite: rank {rank} of {self.run.world} processes failed ({text}); rank {self.run.rank} "
                    f"stopped at the {error.what}. {_RESUME}"
                ) from error
            return
        self._quietly(lambda: self.store.set(self._key("failed", self.run.rank), f"{type(error).__name__}: {error}"))
        self._leave()
        others = [self._key("left", rank) for rank in range(self.run.world) if rank != self.run.rank]
        self._quietly(lambda: self.store.wait(others, self.store.timeout))  # they read it while the store lives

    def _told(self) -> Optional[Tuple[int, str]]:
        """The lowest rank that told a failure, and its error's text (None: none could be read)."""
        for rank in range(self.run.world):
            key = self._key("failed", rank)
            text = None if rank == self.run.rank else self._quietly(
                lambda: self.store.get(key) if self.store.check([key]) else None)
            if text is not None:
                return rank, text.decode(errors="replace")
        return None

    def _leave(self) -> None:
        """This rank marked as gone and the run's own process group closed
        (:meth:`~.group.ProcessGroupRun.close`): a collective another rank still waits in (on
        this rank) fails now."""
        self._quietly(lambda: self.store.set(self._key("left", self.run.rank), "1"))
        self._quietly(self.run.close)

    @staticmethod
    def _quietly(call):
        """``call()``, or None when the store or the group is gone (a rank killed outright)."""
        try:
            return call()
        except Exception:  # noqa: BLE001 - the error being handled is the one to report
            return None
