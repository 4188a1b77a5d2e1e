"""This machine's physical memory, for the checks that refuse work it cannot hold before starting it."""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["physical_memory"]


def physical_memory() -> Optional[int]:
    """The machine's physical memory in bytes, or None where the system does not say (Windows).

    Examples:
        >>> physical_memory() is None or physical_memory() > 0
        True
    """
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows) or no such name
        return None
