"""LoRA adapters (PEFT) on sketched linear layers: the LoRA layer PEFT wraps an
:class:`~panther_lite.nn.SKLinear` in, and the config helper that makes PEFT use it.

PEFT builds LoRA layers only for the layer types it knows; its custom-module mapping
(``LoraConfig._register_custom_module``) adds :class:`SKLinearLora` for ``SKLinear``. Training and
saving the adapters are PEFT's own. ``merge_and_unload`` folds each adapter's ``s·B·A`` (rank
``r``) exactly into the sketched layer by growing it: with ``L = num_terms``, ``low_rank`` grows by
``ceil(r/L)``, ``S1`` gains the columns ``2L·s·Aᵀ`` and ``U1`` the rows ``Bᵀ``, ``U2``/``S2`` gain
zeros, so ``W_eff`` gains ``s·B·A`` and nothing else (zero padding fills ``L·ceil(r/L) - r``
columns). ``unmerge`` cuts them off again. This module imports peft.

Example::

    from peft import LoraConfig, PeftModel, get_peft_model
    from panther_lite.lora import sketched_lora

    peft_model = get_peft_model(compressed, sketched_lora(LoraConfig(r=8, target_modules=["q_proj", "v_proj"])))
    ...  # train; peft_model.save_pretrained(adapters)
    reloaded = PeftModel.from_pretrained(compressed, adapters, config=sketched_lora(LoraConfig.from_pretrained(adapters)))
    merged = reloaded.merge_and_unload()     # SKLinear layers of low_rank + ceil(r/L), same outputs
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import Tensor

from .nn import SKLinear
from .nn.factor_layout import use_decode_layout, uses_decode_layout

__all__ = ["SKLinearLora", "sketched_lora", "grow_by_low_rank", "cut_to_low_rank"]


def grow_by_low_rank(layer: SKLinear, down: Tensor, up: Tensor) -> None:
    """Add ``up @ down`` (``(out, r) @ (r, in)``, the ``nn.Linear`` layout) to ``layer``'s
    effective weight exactly, growing ``low_rank`` by ``ceil(r / num_terms)`` in place.

    Example::

        layer = SKLinear(64, 32, num_terms=2, low_rank=4)
        grow_by_low_rank(layer, torch.randn(3, 64), torch.randn(32, 3))   # low_rank 4 -> 6
    """
    rank = down.shape[0]
    if down.shape != (rank, layer.in_features) or up.shape != (layer.out_features, rank):
        raise ValueError(
            f"down must be (r, {layer.in_features}) and up ({layer.out_features}, r), "
            f"got {tuple(down.shape)} and {tuple(up.shape)}"
        )
    width = layer.num_terms * math.ceil(rank / layer.num_terms)
    dtype, device = layer.S1.dtype, layer.S1.device

    def padded(values: Tensor, rows: bool) -> Tensor:
        values = values.to(device=device, dtype=torch.float32)
        shape = (width, values.shape[1]) if rows else (values.shape[0], width)
        block = torch.zeros(shape, device=device, dtype=torch.float32)
        (block[:rank] if rows else block[:, :rank]).copy_(values)
        return block.to(dtype)

    with torch.no_grad():  # W_eff = scale · (S1 U1 + U2 S2)ᵀ: S1 U1 gains (up @ down)ᵀ / scale
        extra_s1 = padded(down.t() / layer.scale, rows=False)
        extra_u1 = padded(up.t(), rows=True)
        zeros_u2 = torch.zeros(layer.in_features, width, device=device, dtype=layer.U2.dtype)
        zeros_s2 = torch.zeros(width, layer.out_features, device=device, dtype=dtype)
        factors = (
            torch.cat([layer.S1, extra_s1], 1), torch.cat([layer.U1, extra_u1.to(layer.U1.dtype)], 0),
            torch.cat([layer.U2, zeros_u2], 1), torch.cat([layer.S2, zeros_s2], 0),
        )
    _set_factors(layer, factors, layer.low_rank + width // layer.num_terms)


def cut_to_low_rank(layer: SKLinear, low_rank: int) -> None:
    """Undo :func:`grow_by_low_rank`: keep the first ``num_terms · low_rank`` columns/rows."""
    if not 1 <= low_rank <= layer.low_rank:
        raise ValueError(f"low_rank must be in [1, {layer.low_rank}], got {low_rank}")
    width = layer.num_terms * low_rank
    factors = (layer.S1[:, :width], layer.U1[:width], layer.U2[:, :width], layer.S2[:width])
    _set_factors(layer, tuple(factor.detach().clone() for factor in factors), low_rank)


def _set_factors(layer: SKLinear, factors: Tuple[Tensor, Tensor, Tensor, Tensor], low_rank: int) -> None:
    decode = uses_decode_layout(layer)
    s1, u1, u2, s2 = factors
    layer.S1 = nn.Parameter(s1, requires_grad=layer.S1.requires_grad)
    layer.S2 = nn.Parameter(s2, requires_grad=layer.S2.requires_grad)
    layer.U1, layer.U2 = u1, u2
    layer.low_rank = low_rank
    layer._drop_weight_cache()
    use_decode_layout(layer, decode)  # the new factors in the layer's layout


class SKLinearLora(LoraLinear):
    """PEFT's LoRA ``Linear`` around an :class:`~panther_lite.nn.SKLinear` (forward, training and
    saving are PEFT's: ``base(x) + s·B(A(x))``); merging grows the sketched layer
    (:func:`grow_by_low_rank`) instead of writing into a dense ``weight`` it does not have.
    DoRA and ``lora_bias`` adapters cannot be merged into it (ValueError)."""

    def _get_in_out_features(self, module: nn.Module) -> Tuple[int, int]:
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names: Optional[List[str]] = None) -> None:
        base = self.get_base_layer()
        for name in check_adapters_to_merge(self, adapter_names):
            if name not in self.lora_A:
                continue
            if name in getattr(self, "lora_variant", {}) or self.lora_bias[name]:
                raise ValueError(f"adapter {name!r}: DoRA or lora_bias adapters cannot be merged into an SKLinear")
            down = self.lora_A[name].weight.float()
            up = self.lora_B[name].weight.float() * self.scaling[name]
            if safe_merge and not (torch.isfinite(down).all() and torch.isfinite(up).all()):
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")
            self._low_rank_before.append(base.low_rank)
            grow_by_low_rank(base, down, up)
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        while self.merged_adapters:
            self.merged_adapters.pop()
            cut_to_low_rank(self.get_base_layer(), self._low_rank_before.pop())

    @property
    def _low_rank_before(self) -> List[int]:
        """``low_rank`` of the base layer before each merge still in place (last merged last)."""
        return self.__dict__.setdefault("_merge_ranks", [])


def sketched_lora(config: LoraConfig) -> LoraConfig:
    """``config`` with :class:`SKLinearLora` registered for ``SKLinear`` (PEFT's custom-module
    mapping), so ``get_peft_model`` / ``PeftModel.from_pretrained`` put LoRA on sketched layers.

    Example::

        get_peft_model(compressed, sketched_lora(LoraConfig(r=8, target_modules=["q_proj"])))
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module({SKLinear: SKLinearLora})
    return config
