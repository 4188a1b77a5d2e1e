"""The anchor's (Panther's) per-term formulation of a sketched layer, the reference
baseline that materialises one output per term."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..nn import SKConv2d, SKLinear


def anchor_linear(layer: SKLinear) -> Callable[[Tensor], Tensor]:
    """The anchor's per-term forward of ``layer``, as a function of ``x`` (batch × in).

    Contiguous per-term copies ``S1s`` (L, in, k), ``U1s`` (L, k, out), ``U2s`` (L, in, k),
    ``S2s`` (L, k, out) are made once (the anchor's storage layout); the forward expands
    ``x`` over the ``L`` terms, runs two ``bmm`` chains that materialise ``L × batch × out``
    per-term outputs, and averages: ``mean_L(x S1_i U1_i + x U2_i S2_i) / 2 + b``.
    """
    S1s, U1s, U2s, S2s = (t.detach().contiguous() for t in (layer.S1s, layer.U1s, layer.U2s, layer.S2s))
    bias = None if layer.bias is None else layer.bias.detach()
    num_terms = layer.num_terms

    def forward(x: Tensor) -> Tensor:
        if x.dim() != 2:
            raise ValueError(f"the anchor formulation takes x of shape (batch, in), got {tuple(x.shape)}")
        xs = x.unsqueeze(0).expand(num_terms, *x.shape)
        out = (torch.bmm(torch.bmm(xs, S1s), U1s) + torch.bmm(torch.bmm(xs, U2s), S2s)).mean(0) / 2
        return out if bias is None else out + bias

    return forward


def anchor_conv2d(layer: SKConv2d) -> Callable[[Tensor], Tensor]:
    """The per-term forward of ``layer`` (zero padding only): each of the ``2L`` terms is
    a convolution with its kernel ``S_i`` (k channels) and a 1×1 convolution with
    ``U_iᵀ`` back to ``C_out``; the ``2L × N × C_out × H × W`` outputs are averaged."""
    if layer.padding_mode != "zeros":
        raise ValueError(f"the per-term formulation supports padding_mode='zeros' only, got {layer.padding_mode!r}")
    kernels = [s.detach().contiguous() for s in layer.Ss.unbind(0)]
    mixes = [u.detach().t().contiguous()[:, :, None, None] for u in layer.Us.unbind(0)]
    bias = None if layer.bias is None else layer.bias.detach()
    options = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation)

    def forward(x: Tensor) -> Tensor:
        outs = torch.stack([F.conv2d(F.conv2d(x, s, None, **options), u) for s, u in zip(kernels, mixes)])
        out = outs.mean(0)
        return out if bias is None else out + bias[:, None, None]

    return forward
