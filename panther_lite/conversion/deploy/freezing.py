"""``freeze``: the inference form of a converted model, each sketched layer rebuilt by its kind
as a pair of standard layers computing the same function, so every tool that knows
``nn.Linear`` and ``nn.ConvNd`` (``quantize_dynamic``, torchao's ``quantize_``, ONNX, TensorRT,
``torch.compile``, ``torch.export``) applies to it.

- :class:`~panther_lite.nn.SKLinear` (GPT-2 ``Conv1D`` replacements included) becomes
  :class:`~panther_lite.conversion.FrozenLinear`: ``nn.Linear(in, 2Lk, bias=False)`` holding
  ``[S1 | U2]ᵀ`` then ``nn.Linear(2Lk, out)`` holding ``(scale·[U1; S2])ᵀ`` and the bias;
- ``SKConv1d``/``2d``/``3d`` become :class:`~panther_lite.conversion.FrozenConv1d`/``2d``/``3d``:
  the layer's convolution to ``2Lk`` channels (its stride, padding, dilation and padding mode)
  holding ``S``, then a 1×…×1 convolution holding ``Uᵀ/(2L)`` and the bias;
- a registered kind (:func:`~panther_lite.register_kind`) freezes as its
  :meth:`~panther_lite.conversion.kinds.LayerKind.frozen_twin` says.

Each intermediate channel's scale is balanced between the two layers (equal norms, the
function unchanged), so per-channel int8 quantization of either layer loses little.

One-way: the fixed sketches are folded into the second layer, so a frozen layer cannot be
turned back into a sketched one; keep training on the unfrozen model.
"""
from __future__ import annotations

import torch.nn as nn

from ..kinds import converted_kind, sketched_types
from ..surgery import swap_modules
from .quantized import warn_if_quantized_beside

__all__ = ["freeze", "frozen_twin"]


def frozen_twin(layer: nn.Module) -> nn.Module:
    """The frozen pair computing what the sketched ``layer`` computes (same dtype and device,
    trainability and training mode; on the meta device it holds no values)."""
    found = converted_kind(layer)
    if found is None or found[1]:
        raise TypeError(f"frozen_twin expects a sketched layer, got {type(layer).__name__}")
    return found[0].frozen_twin(layer)


def freeze(model: nn.Module) -> nn.Module:
    """Replace every sketched layer of ``model`` with its frozen pair of standard layers, in place.

    Each frozen layer computes the same function as the sketched one (up to float rounding):
    :class:`~panther_lite.conversion.FrozenLinear` for ``SKLinear`` (two ``nn.Linear``),
    :class:`~panther_lite.conversion.FrozenConv1d`/``2d``/``3d`` for the convolutions (a
    convolution to ``2Lk`` channels, then a 1×…×1 one). The stored size is the sketched
    layer's, with the fixed sketches folded in. Quantizers that handle
    ``nn.Linear``/``nn.ConvNd`` then apply: ``quantize_dynamic(model, {nn.Linear})``
    quantizes two ``nn.Linear`` per sketched linear layer.

    One-way: the frozen model cannot be unfrozen (train the unfrozen one).
    :func:`~panther_lite.save_pretrained` and :func:`~panther_lite.from_pretrained` save and
    rebuild it. A model holding no sketched layer is returned unchanged. The swap is all or
    nothing; a shared layer stays shared. Returns ``model``.

    Examples:
        >>> import torch.nn as nn, panther_lite
        >>> sketched = panther_lite.nn.SKLinear(16, 8, num_terms=1, low_rank=2)
        >>> frozen = panther_lite.freeze(nn.Sequential(sketched, nn.ReLU()))[0]
        >>> type(frozen).__name__, [type(layer).__name__ for layer in frozen]
        ('FrozenLinear', ['Linear', 'Linear'])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    layers = [(fqn, module) for fqn, module in model.named_modules() if isinstance(module, sketched_types())]
    if any(fqn == "" for fqn, _ in layers):
        raise ValueError(
            "the root module is a sketched layer: freeze() replaces layers inside a model; "
            "use panther_lite.conversion.deploy.freezing.frozen_twin(layer) for a lone layer"
        )
    warn_if_quantized_beside(model, [fqn for fqn, _ in layers], "freeze")
    # named_modules lists a shared layer once; swap_modules replaces it at every alias
    swap_modules(model, [(fqn, frozen_twin(layer)) for fqn, layer in layers])
    return model
