"""Progress bars of the conversion stages (tqdm, imported only when a bar is shown)."""
from __future__ import annotations

import sys
from typing import Iterable, Optional, Union

from ..nn.validation import check_bool

__all__ = ["progress_bar"]


def progress_bar(
    iterable: Union[Iterable, None], desc: str, unit: str, progress: Optional[bool], total: Optional[int] = None
):
    """``iterable`` wrapped in a tqdm bar (``iterable`` None: a bar of ``total`` steps to
    ``update`` by hand); ``progress`` None shows it on a terminal only (tqdm's
    ``disable=None``), False never imports tqdm and returns ``iterable`` itself.

    Examples:
        >>> progress_bar([1, 2], "fitting", "layer", progress=False)
        [1, 2]
    """
    if progress is not None:
        check_bool("progress", progress)
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=None if progress is None else not progress)
