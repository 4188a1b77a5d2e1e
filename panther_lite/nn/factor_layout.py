"""The decode layout of the linear factors: an opt-in storage for fast products of a few rows.

By default every factor ``(…, a, b)`` is row-major (contiguous). :func:`use_decode_layout`
re-lays them in place (same tensor objects, no lasting extra memory, values unchanged) as:

* the left factors ``S1``, ``U2`` ``(in, R)``: transposed, i.e. the ``.mT`` view of contiguous
  ``(R, in)`` storage, as ``nn.Linear`` stores its weight;
* the right factors ``U1``, ``S2`` ``(R, out)``: transposed, ``(out, R)``, in bfloat16 and
  float16; row-major in float32 and float64.

Why, measured at one row (decode) on a 2-core AMD EPYC, one thread, factors streamed from
memory: bfloat16 products (oneDNN) read the transposed storage at 5.5–7 GB/s against
3.5–5 GB/s row-major, on both sides; float32 products (MKL) read the left factors a little
faster transposed (8.6–9.2 against 7.7–8.5 GB/s) and the right ones, whose columns are only
``R`` long, much faster row-major (9–13 against 6–7.5 GB/s). Many rows (prefill, training)
run at the same speed in either layout, and outputs are equal (bit for bit on these kernels).

Opt-in because FSDP2's ``fully_shard`` (and ZeRO-style flattening) rejects non-contiguous
parameters: call ``use_decode_layout(model, False)`` before sharding a model that uses it.
Shapes and names never change. ``state_dict`` gives contiguous tensors
(:func:`contiguous_factors_hook`), so saved files are the same in either layout; ``.to()``,
``deepcopy``, pickling and ``load_state_dict`` keep the layout (the layers re-apply the dtype
rule after a dtype change); loading a saved model gives the default layout.
"""
from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["LEFT", "RIGHT", "concatenated_factors", "contiguous_factors_hook", "use_decode_layout", "uses_decode_layout"]

LEFT, RIGHT = "left", "right"
_TRANSPOSED_RIGHT_DTYPES = (torch.bfloat16, torch.float16)


def _stored_transposed(tensor: Tensor) -> bool:
    """Whether ``tensor`` ``(…, a, b)`` is the ``.mT`` view of contiguous storage (and not
    also row-major, as when a dimension is 1)."""
    return tensor.mT.is_contiguous() and not tensor.is_contiguous()


def _decode_transposed(side: str, dtype: torch.dtype) -> bool:
    """Whether the decode layout stores a factor of ``side`` in ``dtype`` transposed."""
    return side == LEFT or dtype in _TRANSPOSED_RIGHT_DTYPES


def concatenated_factors(first: Tensor, second: Tensor, side: str) -> Tensor:
    """``[first | second]`` (:data:`LEFT`, along the last dim) or ``[first; second]``
    (:data:`RIGHT`, along the second-to-last), written once, stored as ``first`` is."""
    dim = -1 if side == LEFT else -2
    if _stored_transposed(first):
        return torch.cat((first.mT, second.mT), dim=-3 - dim).mT
    return torch.cat((first, second), dim=dim)


@torch.no_grad()
def _relay_in_place(tensor: Tensor, transposed: bool) -> None:
    """Store ``tensor`` transposed or row-major keeping the object (tied parameters, optimizer
    references): a dense one is rearranged within its own storage through one transient copy
    of itself (no lasting extra memory); any other stride pattern gets new storage."""
    target = tensor.mT if transposed else tensor
    if tensor.is_meta or target.is_contiguous():
        return
    physical = target.contiguous()  # the values in the target storage order
    if tensor.is_contiguous() or tensor.mT.is_contiguous():
        span = tensor.data.as_strided((tensor.numel(),), (1,))  # the tensor's own storage
        span.copy_(physical.view(-1))
        physical = span.view(physical.shape)
    tensor.data = physical.mT if transposed else physical


def _factors_with_sides(model: nn.Module) -> Iterator[Tuple[nn.Module, Tensor, str]]:
    """``(module, factor, side)`` of every module declaring ``_factor_sides``, each storage
    once; tensor subclasses (DTensor, fake tensors) and inference tensors outside inference
    mode, which cannot be rewritten, are left out."""
    seen = set()
    for module in model.modules():
        for name, side in getattr(module, "_factor_sides", {}).items():
            tensor = getattr(module, name, None)
            if not isinstance(tensor, Tensor) or type(tensor.data) is not Tensor:
                continue
            if tensor.is_inference() and not torch.is_inference_mode_enabled():
                continue
            key = None if tensor.is_meta else tensor.data_ptr()
            if key is None or key not in seen:
                seen.add(key)
                yield module, tensor, side


def uses_decode_layout(module: nn.Module) -> bool:
    """Whether ``module`` (a layer declaring ``_factor_sides``) stores its factors in the decode
    layout (its first left factor is stored transposed)."""
    left = next((name for name, side in getattr(module, "_factor_sides", {}).items() if side == LEFT), None)
    tensor = getattr(module, left, None) if left else None
    return isinstance(tensor, Tensor) and _stored_transposed(tensor)


def use_decode_layout(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Store the factors of every sketched linear layer in ``model`` in the decode layout
    (``enabled``) or row-major (``False``), in place: same tensor objects, values unchanged, no
    lasting extra memory (one factor's copy at a time). Returns ``model``.

    Example::

        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        panther_lite.nn.use_decode_layout(model)      # faster generate() on CPU
        panther_lite.nn.use_decode_layout(model, False)  # before fully_shard (FSDP2)
    """
    for _, tensor, side in _factors_with_sides(model):
        _relay_in_place(tensor, enabled and _decode_transposed(side, tensor.dtype))
    return model


def contiguous_factors_hook(module: nn.Module, state_dict: Dict[str, Tensor], prefix: str, local_metadata) -> None:
    """A ``state_dict`` post-hook: the module's factors as contiguous tensors of their shapes, so
    saved files are the same in either layout. ``state_dict(keep_vars=True)`` (the tensors
    themselves: ``torch.export``, sharding tools) is left as it is. In the decode layout this
    costs one copy of each transposed factor while the state dict is held."""
    owned = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    for name in module._factor_sides:
        key = prefix + name
        value = state_dict.get(key)
        if value is None or value.is_contiguous() or any(value is t for t in owned):
            continue
        state_dict[key] = value.contiguous()
