"""SIGTERM handled like Ctrl-C while a command runs: raised as an exception in the main thread,
so that everything a command cleans up on KeyboardInterrupt is cleaned up too."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["Terminated", "TERMINATED", "sigterm_raises"]

TERMINATED = 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM


class Terminated(BaseException):
    """The process received SIGTERM (a BaseException, like KeyboardInterrupt: ``except
    Exception`` blocks do not swallow it, cleanup in ``finally`` and ``except BaseException`` runs)."""


def _raise_once(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated(f"received signal {signum}")


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (once) instead of ending the process
    on the spot; the previous handler is restored after. Outside the main thread, where Python
    cannot install handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_once)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
