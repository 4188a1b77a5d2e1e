"""The size options of a conversion validated into a :class:`SizeRequest`: the default size
(a stored ratio, or a ``(num_terms, low_rank)`` pair) and the ``rank_pattern`` entries, each
checked once, with errors naming the option."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Tuple, Union

from ..nn.validation import check_fraction, check_positive_int

__all__ = ["RankSpec", "SizeRequest", "parse_sizes", "check_ratio", "compile_regex"]

RankSpec = Union[float, Tuple[int, int]]


def compile_regex(name: str, pattern: str) -> "re.Pattern":
    """``re.compile(pattern)``; ValueError naming the argument when it is not a regex."""
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{name} {pattern!r} is not a valid regular expression: {error}") from None


@dataclass
class SizeRequest:
    """The validated size options: ``default``, the size of layers no pattern names (a ratio,
    a ``(num_terms, low_rank)`` pair, or None); ``ratio_terms``: the ``num_terms`` used with
    ratios; ``patterns``: ``[(regex, key, spec)]`` from ``rank_pattern``, first match wins."""

    default: Optional[RankSpec]
    ratio_terms: int
    patterns: List[Tuple["re.Pattern", str, RankSpec]] = field(default_factory=list)

    def spec_for(self, name: str) -> Tuple[Optional[RankSpec], Optional[str]]:
        """``(spec, matching rank_pattern key or None)`` for the layer named ``name``."""
        for regex, key, spec in self.patterns:
            if regex.fullmatch(name):
                return spec, key
        return self.default, None


def check_ratio(name: str, value) -> float:
    """``value`` as a float in (0, 1]; ValueError naming ``name`` otherwise."""
    return check_fraction(name, value, "stored size as a fraction of the dense layer")


def _rank_spec(name: str, value) -> RankSpec:
    """A ratio in (0, 1] or a ``(num_terms, low_rank)`` pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be a ratio or a (num_terms, low_rank) pair, got {value!r}")
        return (check_positive_int(f"{name} num_terms", value[0]), check_positive_int(f"{name} low_rank", value[1]))
    return check_ratio(name, value)


def _default_size(num_terms, low_rank, param_ratio) -> Tuple[Optional[RankSpec], int]:
    if param_ratio is not None:
        if low_rank is not None:
            raise ValueError(
                "param_ratio chooses low_rank: pass param_ratio (optionally with num_terms), "
                "or num_terms and low_rank, not both"
            )
        ratio_terms = 1 if num_terms is None else check_positive_int("num_terms", num_terms)
        return check_ratio("param_ratio", param_ratio), ratio_terms
    if num_terms is None and low_rank is None:
        return None, 1
    if num_terms is None or low_rank is None:
        raise ValueError(
            f"num_terms and low_rank go together (got num_terms={num_terms!r}, low_rank={low_rank!r}); "
            "or pass param_ratio to choose low_rank per layer"
        )
    return (check_positive_int("num_terms", num_terms), check_positive_int("low_rank", low_rank)), num_terms


def parse_sizes(num_terms, low_rank, param_ratio, rank_pattern) -> SizeRequest:
    """Validate the size options (ValueError/TypeError on bad or contradictory ones)."""
    default, ratio_terms = _default_size(num_terms, low_rank, param_ratio)
    request = SizeRequest(default, ratio_terms)
    if rank_pattern is not None:
        if not isinstance(rank_pattern, Mapping):
            raise TypeError(f"rank_pattern must be a dict {{regex: ratio or (num_terms, low_rank)}}, got {rank_pattern!r}")
        for key, value in rank_pattern.items():
            if not isinstance(key, str):
                raise TypeError(f"rank_pattern keys must be regex strings, got {key!r}")
            regex = compile_regex("rank_pattern key", rf"(?:.*\.)?(?:{key})")
            request.patterns.append((regex, key, _rank_spec(f"rank_pattern[{key!r}]", value)))
    if default is None and not request.patterns:
        raise ValueError("give a size: param_ratio=..., or num_terms=... and low_rank=..., or a rank_pattern")
    return request
