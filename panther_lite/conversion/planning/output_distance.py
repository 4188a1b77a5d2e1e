"""How far a model's output moved, as the gains of the global allocation measure it: the squared
change of its first floating-point tensor, or, for an output holding ``logits``, the KL divergence
between the next-token distributions they give.

A perturbation ``δ`` of the logits ``z`` of one token changes its predicted distribution by
``KL(p ‖ p') ≈ ½ δᵀ F δ`` with ``F = diag(p) − p pᵀ`` (the Fisher information of the softmax), so
what a language model's perplexity feels is ``δᵀ F δ``, not ``‖δ‖²``: a logit moved where ``p`` is
tiny costs nothing. The plain norm weighs every one of the vocabulary's logits alike, and so
spends the budget on layers that move logits no prediction depends on.

:class:`OutputProbe` holds the reference output of one calibration batch and offers the two
things a gain needs in either metric: :meth:`~OutputProbe.distance` to a moved output (noise
probes) and :meth:`~OutputProbe.direction`, a random ``u`` with ``E[u uᵀ]`` the metric
(gradient probes: ``E‖Jᵀu‖² = tr(Jᵀ M J)``). For logits, ``u = p − e_y`` with ``y`` drawn from
``p``: its covariance is exactly ``F``. Both are divided by :meth:`~OutputProbe.reference` (the
output's squared norm, or the count of real tokens), a constant shared by every layer of one plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor

from ..calibration.tokens import zero_padding

__all__ = ["OutputProbe", "first_tensor", "output_logits", "probe_output"]

def first_tensor(output) -> Optional[Tensor]:
    """The first floating-point tensor in a model's output (a Tensor, a tuple/list, a dict or
    a Hugging Face ``ModelOutput``)."""
    if isinstance(output, Tensor):
        return output if output.is_floating_point() else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def output_logits(output) -> Optional[Tensor]:
    """The ``logits`` of a model output (a dict or Hugging Face ``ModelOutput`` holding a
    floating-point tensor under that key, or an object with such an attribute), else None."""
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return logits if isinstance(logits, Tensor) and logits.is_floating_point() and logits.dim() >= 2 else None


def _real_rows(tensor: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``tensor`` ``(..., vocab)`` as rows ``(rows, vocab)``, padded positions left out when
    ``mask`` lines up with its leading dimensions."""
    if mask is not None and tensor.dim() >= 3 and tuple(tensor.shape[:2]) == tuple(mask.shape):
        return tensor[mask.to(tensor.device)]
    return tensor.reshape(-1, tensor.shape[-1])


# rows of logits per float64 softmax: a whole batch's (8 x 256 tokens x 49,152 words) would take 0.8 GB a copy
ROW_CHUNK = 256


def _row_chunks(rows: Tensor):
    """``rows`` ``(rows, vocab)`` in chunks of :data:`ROW_CHUNK` rows (views)."""
    return rows.split(ROW_CHUNK)


def _sampled_fisher_rows(rows: Tensor, generator: torch.Generator) -> Tensor:
    """``p − e_y`` for each row of logits ``(rows, vocab)``, ``p`` its softmax and ``y ~ p``: on the
    CPU in ``rows``' dtype, computed in float64 a chunk of rows at a time."""
    noise = torch.empty(rows.shape, dtype=rows.dtype)
    for chunk, out in zip(_row_chunks(rows), _row_chunks(noise)):
        probabilities = torch.softmax(chunk.double().cpu(), dim=-1)
        drawn = torch.multinomial(probabilities, 1, generator=generator)
        out.copy_(probabilities.scatter_add_(1, drawn, torch.full(drawn.shape, -1.0, dtype=torch.double)))
    return noise


@dataclass
class OutputProbe:
    """The reference output of one batch (``tensor``; ``kl``: compared as next-token logits, else by
    squared norm) and its real-token mask ``(batch, seq)`` (None: every position is real).

    Examples:
        >>> probe = OutputProbe(torch.tensor([[[0.0, 0.0]]]), None, kl=True)
        >>> probe.reference(), round(probe.distance(torch.tensor([[[1.0, -1.0]]])), 4)
        (1.0, 0.8676)
    """

    tensor: Tensor
    mask: Optional[Tensor]
    kl: bool

    def reference(self) -> float:
        """The divisor of every gain: the count of real rows (``kl``) or ``‖output‖²``."""
        if self.kl:
            return float(_real_rows(self.tensor, self.mask).shape[0])
        return float(zero_padding(self.tensor, self.mask).detach().double().norm() ** 2)

    def moves(self) -> bool:
        """Whether a gain can be measured against it (some real row; a non-zero norm)."""
        return self.reference() > 0

    def distance(self, moved: Tensor) -> float:
        """``2·Σ KL(p ‖ p')`` over the real rows (``kl``), else ``‖moved − output‖²`` at them:
        both ``δᵀ M δ`` to second order."""
        if not self.kl:
            return float((zero_padding(moved, self.mask) - zero_padding(self.tensor, self.mask)).double().norm() ** 2)
        total = 0.0
        for reference, other in zip(_row_chunks(_real_rows(self.tensor, self.mask)),
                                    _row_chunks(_real_rows(moved, self.mask))):
            log_p, log_q = torch.log_softmax(reference.double(), -1), torch.log_softmax(other.double(), -1)
            total += float((log_p.exp() * (log_p - log_q)).sum())
        return 2 * total

    def direction(self, generator: torch.Generator) -> Tensor:
        """A random ``u`` shaped like the output, zero at padded positions, with ``E[u uᵀ]`` the
        metric: Gaussian (norm), or ``p − e_y`` per position with ``y ~ p`` (``kl``). Drawn on the
        CPU from ``generator``, so a run repeats whatever the device."""
        if not self.kl:
            noise = torch.randn(self.tensor.shape, generator=generator)
        else:
            rows = self.tensor.detach().reshape(-1, self.tensor.shape[-1])
            noise = _sampled_fisher_rows(rows, generator).reshape(self.tensor.shape)
        return zero_padding(noise.to(self.tensor), self.mask)


def probe_output(output, mask: Optional[Tensor], metric: str) -> Optional[OutputProbe]:
    """The :class:`OutputProbe` of a model output under ``metric`` (``"auto"``/``"kl"``: its
    logits when it holds some, else the norm of its first floating-point tensor; ``"norm"``: that
    always), or None when the output holds no floating-point tensor."""
    logits = output_logits(output) if metric != "norm" else None
    if logits is not None:
        return OutputProbe(logits, mask, kl=True)
    tensor = first_tensor(output)
    return None if tensor is None else OutputProbe(tensor, mask, kl=False)
