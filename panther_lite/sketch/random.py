"""Random-number plumbing shared by the sketching operators."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["resolve_generator"]


def resolve_generator(seed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> Optional[torch.Generator]:
    """A CPU generator seeded with ``seed``, the given ``generator``, or None (global RNG).

    Operators draw on the CPU and then move to the target device, so one seed gives the
    same operator on every device.
    """
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if seed is not None:
        return torch.Generator(device="cpu").manual_seed(int(seed))
    return generator
