"""Calibration statistics of a mixture-of-experts module: for every expert and projection, the
Gram of the rows the router sends that expert — the hidden states of its tokens for the up
(``gate_up_proj``) projection, and the dense expert's activations of them (its own up
projection and gate) for ``down_proj`` — with the row moments their shrinkage needs.

An expert that received fewer rows than a projection has inputs cannot be fitted from them
(its Gram is singular): that projection of that expert is fitted to its weights alone
("data-free"), and the report lists it (the global allocation's spectra of the experts:
:func:`~panther_lite.conversion.planning.allocation.expert_energies`).

Only real tokens are routed rows here: while a batch's token mask is current
(:mod:`.tokens`) and the experts' input is the block's ``(batch·seq, hidden)`` flattening of
it, padded tokens enter no expert's statistics; inputs that do not line up use every row, and
the report says so. ``shrinkage="auto"`` keeps no held-back half here: each expert's Gram is
shrunk by its own Ledoit–Wolf ``α``; a number sets every expert's strength (0: off).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ...nn.experts_shell import expert_activation
from ...nn.low_rank_fit import gram_dtype
from ...nn.validation import check_finite
from .shrinkage import RowMoments, shrink, shrinkage_intensity
from .tokens import current_token_mask

__all__ = ["ExpertsRecorder"]


class ExpertsRecorder:
    """Forward pre-hook (``with_kwargs=True``) of an experts module (called as
    ``experts(hidden_states, top_k_index, top_k_weights)``) accumulating, per projection,
    ``grams[name]`` ``(E, fan_in, fan_in)`` (``gram_dtype(fan_in)``) on ``device`` (None: the weights'), the
    ``moments`` of each expert's rows and ``expert_rows``, the rows each expert received."""

    def __init__(self, record, device: Optional[torch.device] = None) -> None:
        self.record = record
        device = record.device if device is None else device
        self.grams = {
            part.projection: torch.zeros(part.copies, part.fan_in, part.fan_in, dtype=gram_dtype(part.fan_in), device=device)
            for part in record.parts
        }
        experts = record.parts[0].copies
        self.moments = {part.projection: [RowMoments() for _ in range(experts)] for part in record.parts}
        self.expert_rows: List[int] = [0] * experts
        self.rows = 0
        self.unaligned = False  # a token mask was active that the routed rows did not line up with
        self.last_input: Optional[Tensor] = None

    def _add(self, projection: str, expert: int, rows: Tensor) -> None:
        rows = rows.detach().to(torch.float64)
        gram = self.grams[projection][expert]
        summed = rows.to(gram.dtype)
        gram.add_((summed.t() @ summed).to(gram.device))
        self.moments[projection][expert].add(rows)

    def _real_tokens(self, hidden: Tensor) -> Optional[Tensor]:
        """The current token mask flattened to ``hidden``'s rows ``(tokens,)`` when they line up
        (the block flattens ``(batch, seq)`` into its tokens); None without a mask or when they
        do not (then every row counts, and :attr:`unaligned` says so)."""
        mask = current_token_mask()
        if mask is None:
            return None
        if hidden.dim() == 2 and hidden.shape[0] == mask.numel():
            return mask.reshape(-1).to(hidden.device)
        self.unaligned = True
        return None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        record = self.record
        hidden = record.kind.read_input(record.name, module, args, kwargs)
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        self.last_input = hidden
        up, down = record.parts
        routed = index.reshape(hidden.shape[0], -1)
        real = self._real_tokens(hidden)
        for expert in range(up.copies):
            chosen = (routed == expert).any(-1)
            tokens = (chosen if real is None else chosen & real).nonzero().squeeze(-1)
            if tokens.numel() == 0:
                continue
            rows = hidden[tokens]
            self._add(up.projection, expert, rows)
            self._add(down.projection, expert, expert_activation(module, up.apply(expert, rows)))
            self.expert_rows[expert] += tokens.numel()
            self.rows += tokens.numel()

    def statistics(self) -> List[Tensor]:
        return list(self.grams.values())

    def check_finite(self) -> None:
        """ValueError naming the module when its statistics hold inf/NaN."""
        for projection, gram in self.grams.items():
            check_finite(f"the Grams of its experts' {projection} inputs", gram, layer=self.record.name)

    def data_free(self, part) -> List[int]:
        """The experts whose rows are fewer than ``part``'s inputs (fitted to their weights alone)."""
        return [e for e, rows in enumerate(self.expert_rows) if rows < part.fan_in]

    def strengths(self, part, setting) -> List[Optional[float]]:
        """Per expert, the strength its ``part`` Gram is shrunk by: ``setting`` (the config's
        ``shrinkage``) when it is a number, else (``"auto"``, no held-back half here) the
        expert's Ledoit–Wolf ``α``; None for a data-free expert."""
        free = set(self.data_free(part))
        grams, moments = self.grams[part.projection], self.moments[part.projection]
        if setting != "auto":
            return [None if e in free else float(setting) for e in range(part.copies)]
        return [None if e in free else shrinkage_intensity(grams[e], moments[e]) for e in range(part.copies)]

    def fit_grams(self, setting="auto") -> Dict[str, Tensor]:
        """Per projection, the Grams the fit whitens by ``(E, fan_in, fan_in)``: each calibrated
        expert's shrunk by its :meth:`strengths`, the identity for a data-free one."""
        grams = {}
        for part in self.record.parts:
            stack = self.grams[part.projection].clone()
            for e, strength in enumerate(self.strengths(part, setting)):
                if strength is None:
                    stack[e] = torch.eye(part.fan_in, dtype=stack.dtype, device=stack.device)
                else:
                    stack[e] = shrink(stack[e], strength)
            grams[part.projection] = stack
        return grams
