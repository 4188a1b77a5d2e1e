"""A checkpoint's tensors under the model's own names when transformers saved them in another
layout: transformers' conversion mapping for the model type (``transformers.conversion_mapping``,
transformers ≥ 5) renames modules and merges per-expert tensors into one stacked parameter, and
each model tensor becomes a :class:`Source`, the file tensors it is read from and how they join.

Example (Mixtral): ``model.layers.0.block_sparse_moe.experts.{0..3}.w1.weight`` and ``.w3.weight``
(each F × H on disk) become ``model.layers.0.mlp.experts.gate_up_proj`` (4 × 2F × H: each
pattern's experts stacked on dim 0, then the patterns concatenated on dim 1), ``.w2.weight``
(H × F) ``mlp.experts.down_proj`` (4 × H × F). Only renames and these two operations (stack,
concatenate) are read; a mapping with any other operation leaves its names as they are (the
model then lacks them, and the checkpoint is loaded whole, saying so)."""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["Source", "model_sources"]


@dataclasses.dataclass
class Source:
    """One model tensor: ``parts[i]`` the file tensors of source pattern ``i`` (in expert
    order), stacked on ``stack`` (None: a single tensor, taken as it is) and concatenated on
    ``concat`` (None: one pattern)."""

    parts: List[List[str]]
    stack: Optional[int] = None
    concat: Optional[int] = None

    def names(self) -> List[str]:
        return [name for part in self.parts for name in part]

    def build(self, read: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The model tensor from ``read`` (``{file name: tensor}`` holding :meth:`names`)."""
        joined = [read[part[0]] if self.stack is None else torch.stack([read[n] for n in part], self.stack)
                  for part in self.parts]
        return joined[0] if self.concat is None else torch.cat(joined, self.concat)


def _mapping(model_type: str) -> list:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers < 5: checkpoints are saved under the model's names
        return []
    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _pattern(source: str) -> "re.Pattern[str]":
    """transformers' source pattern (``*`` an index) as a regular expression capturing the index."""
    return re.compile(re.escape(source).replace(r"\*", r"(\d+)"))


_READ = (["MergeModulelist"], ["Concatenate"], ["MergeModulelist", "Concatenate"])  # the chains read


def _operations(converter) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """``(stack dim, concat dim)`` of a converter whose chain is one of ``_READ``, else None."""
    names = [type(op).__name__ for op in converter.operations]
    if names not in _READ:
        return None
    dims = {name: op.dim for name, op in zip(names, converter.operations)}
    return dims.get("MergeModulelist"), dims.get("Concatenate")


def _renamed(name: str, renamings: list) -> str:
    for renaming in renamings:
        for source, target in zip(renaming.source_patterns, renaming.target_patterns):
            name = re.sub(_pattern(source), target.replace("\\", r"\\"), name)
    return name


def model_sources(model_type: str, names: Iterable[str]) -> Dict[str, Source]:
    """``{model name: Source}`` for the file tensors ``names`` of a ``model_type`` checkpoint;
    a tensor no mapping touches is its own source under its own name."""
    mapping = _mapping(model_type)
    renamings = [m for m in mapping if type(m).__name__ == "WeightRenaming"]
    converters = [(m, _operations(m)) for m in mapping if type(m).__name__ == "WeightConverter"]
    converters = [(m, ops) for m, ops in converters if ops is not None and len(m.target_patterns) == 1]
    sources: Dict[str, Source] = {}
    grouped: Dict[str, Dict[int, Dict[int, str]]] = {}
    for name in names:
        renamed = _renamed(name, renamings)
        for converter, (stack, concat) in converters:
            found = [(i, m) for i, p in enumerate(converter.source_patterns) if (m := _pattern(p).search(renamed))]
            if found:
                index, match = found[0]
                target = renamed[:match.start()] + converter.target_patterns[0] + renamed[match.end():]
                grouped.setdefault(target, {}).setdefault(index, {})[int(match.group(1) if match.groups() else 0)] = name
                sources[target] = Source([], stack, concat)
                break
        else:
            sources[renamed] = Source([[name]])
    for target, by_pattern in grouped.items():
        sources[target].parts = [[by_index[i] for i in sorted(by_index)] for _, by_index in sorted(by_pattern.items())]
    return sources
