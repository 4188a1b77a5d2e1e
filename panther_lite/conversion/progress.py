"""Progress bars of a conversion (tqdm, imported only when a bar is shown)."""
from __future__ import annotations

import sys
from typing import Iterable, Optional


def progress_bar(iterable: Iterable, desc: str, unit: str, progress: Optional[bool]) -> Iterable:
    """``iterable`` wrapped in a tqdm bar; ``progress`` None shows it on a terminal only
    (tqdm's ``disable=None``), False never imports tqdm."""
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, unit=unit, disable=None if progress is None else not progress)
