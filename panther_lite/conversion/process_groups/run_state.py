"""A resumable ``compress_checkpoint`` run's state as every process of a run across processes
sees it: rank 0 holds the staging directory (its lock, manifest, plan, progress and the output's
parts) and announces it, or the error that stopped it, to the others (an error later in the run,
on any rank, is told through the store: :mod:`.failures`); each rank keeps its own
batches' hidden states and captured calls beside rank 0's, in the same resume directory (so the
staging directory must lie on a filesystem every process sees: always so on one machine).

A block is committed once every rank has written its share of the hidden states (a barrier),
then rank 0 records it; a resumed run, on any number of processes, reads back each rank's batches
from whatever wrote them (:mod:`~panther_lite.conversion.saving.stream_shards`)."""
from __future__ import annotations

import contextlib
import secrets
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from ..saving.resume_state import RunFiles, RunState
from ..saving.stream_shards import save_shard
from .failures import FailureNotes
from .group import ProcessGroupRun

__all__ = ["Announcement", "SharedRunState", "announcing", "await_staging"]

_TOKEN = "processes.token"


class Announcement:
    """Rank 0's word to the others on how its setup went: :meth:`ready` (the staging directory, which
    they then check they see when the pipeline is ``streamed``) or, on an error before that, the
    error (:func:`announcing`); an error after it goes through the run's
    :class:`~.failures.FailureNotes`. In one process it does nothing."""

    def __init__(self, run: Optional[ProcessGroupRun], streamed: bool) -> None:
        self.run, self.streamed, self.sent = run, streamed, run is None
        self.notes: Optional[FailureNotes] = None

    def ready(self, state: RunState):
        """``state`` as this run uses it (across processes: a :class:`SharedRunState`), announced."""
        if self.run is None:
            return state
        token = secrets.token_hex(8)
        if self.streamed:
            state.scratch(_TOKEN).write_text(token)
        self.notes, self.sent = FailureNotes(self.run, token), True
        self.run.from_first((str(state.root), token), "the staging directory")
        if self.streamed:
            _agree_seen(self.run, None)
        return SharedRunState(self.run, state, self.notes, state)

    def failed(self, error: BaseException) -> None:
        """``error`` ends rank 0's run: sent to the others before :meth:`ready`, told after it
        (another rank's told failure behind it raised as :class:`~.failures.RankFailed`)."""
        if not self.sent:
            self.sent = True
            self.run.from_first((None, f"{type(error).__name__}: {error}"), "rank 0's error")
        elif self.run is not None:
            self.notes.handle(error)


@contextlib.contextmanager
def announcing(run: Optional[ProcessGroupRun], streamed: bool) -> Iterator[Announcement]:
    """Rank 0's run: an error raised before :meth:`Announcement.ready` is sent to the others too,
    one raised after it told (:meth:`Announcement.failed`)."""
    announcement = Announcement(run, streamed)
    try:
        yield announcement
    except BaseException as error:
        announcement.failed(error)
        raise


def await_staging(run: ProcessGroupRun, streamed: bool) -> "SharedRunState":
    """A rank other than 0: the run state in the resume directory rank 0 announced (checked that
    this process sees it when ``streamed``), its run's failure notes
    (:attr:`SharedRunState.notes`); rank 0's error when it stopped first (RuntimeError quoting it)."""
    root, token = run.from_first(None, "the staging directory")
    if root is None:
        raise RuntimeError(f"compress_checkpoint across {run.world} processes: rank 0 stopped: {token}")
    files = RunFiles(Path(root))
    if streamed:
        path = files.scratch(_TOKEN)
        seen = path.is_file() and path.read_text() == token
        _agree_seen(run, None if seen else f"process {run.rank} does not see rank 0's staging directory {root!r}")
    return SharedRunState(run, files, FailureNotes(run, token))


def _agree_seen(run: ProcessGroupRun, problem: Optional[str]) -> None:
    found = [p for p in run.gather_objects(problem, "the staging directory's check") if p is not None]
    if found:
        raise ValueError(
            f"compress_checkpoint across {run.world} processes: {found[0]}; the streamed pipeline keeps each "
            "process's hidden states there, so OUT_DIR must lie on a filesystem every process sees (or pass "
            "in_memory=True, --in-memory)"
        )


class SharedRunState:
    """:class:`~panther_lite.conversion.saving.resume_state.RunState`'s interface across the
    processes of ``run``: ``state`` on rank 0 (which alone writes the output, the plan and the
    progress), ``files`` (its resume directory) on every rank, and ``notes``, the run's
    :class:`~.failures.FailureNotes`."""

    def __init__(self, run: ProcessGroupRun, files: RunFiles, notes: FailureNotes,
                 state: Optional[RunState] = None) -> None:
        self.run, self.files, self.notes, self.state = run, files, notes, state
        self.writes = state is not None
        self.root = files.root

    def part_path(self, name: str) -> Path:
        return self.files.part_path(name)

    def scratch(self, name: str) -> Path:
        return self.files.scratch(name)

    def _own(self, name: str) -> str:
        return f"{self.run.rank}-of-{self.run.world}-{name}"

    def save_scratch(self, name: str, value) -> None:
        """This rank's ``value`` (its batches' captured calls), kept for a resume at this world size."""
        self.files.save_scratch(self._own(name), value)

    def load_scratch(self, name: str):
        return self.files.load_scratch(self._own(name))

    def plan(self) -> Optional[dict]:
        """Rank 0's saved plan, on every rank."""
        return self.run.from_first(self.state.plan() if self.writes else None, "the saved plan")

    def save_plan(self, plan: dict) -> None:
        if self.writes:
            self.state.save_plan(plan)

    def commit(self, finished: int, record: dict, streams, outside: bool = False) -> None:
        """Each rank's ``streams`` written, then (every rank's written) the commit recorded by rank 0."""
        if streams is not None:
            save_shard(self.root, finished, self.run.rank, self.run.world, streams)
        self.run.barrier(f"the hidden states after block {finished - 1} written")
        if self.writes:
            self.state.commit(finished, record, None, outside, shards=self.run.world if streams is not None else 0)

    def progress(self) -> Dict[str, Any]:
        """The last commit, with this rank's batches' hidden states (whatever world size wrote them)."""
        return self.files.progress(self.run.rank, self.run.world)

    def record(self, name) -> dict:
        return self.files.record(name)

    @property
    def holds_work(self) -> bool:
        return self.writes and self.state.holds_work

    def close(self) -> None:
        if self.writes:
            self.state.close()
