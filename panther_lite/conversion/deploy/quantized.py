"""Quantized models and what saving them needs: spotting sketched layers that a quantizer skipped
(a model holding quantized modules next to sketched layers was quantized before
:func:`~panther_lite.freeze`, and its sketched layers stayed in float: quantizers replace
``nn.Linear``/``nn.ConvNd``, which they are not), and refusing state_dicts safetensors cannot store."""
from __future__ import annotations

import warnings
from typing import List, Sequence

import torch
import torch.nn as nn

__all__ = ["quantized_module_names", "warn_if_quantized_beside", "check_storable"]

# torch.ao's quantized modules (quantize_dynamic, static quantization) and their old alias
_QUANTIZED_MODULE_PREFIXES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")
# torchao's quantize_ keeps nn.Linear and swaps its weight for one of torchao's tensor subclasses
_QUANTIZED_TENSOR_PACKAGE = "torchao"


def _is_quantized(module: nn.Module) -> bool:
    if type(module).__module__.startswith(_QUANTIZED_MODULE_PREFIXES):
        return True
    own = (*module._parameters.values(), *module._buffers.values())
    return any(t is not None and type(t).__module__.split(".")[0] == _QUANTIZED_TENSOR_PACKAGE for t in own)


def quantized_module_names(model: nn.Module) -> List[str]:
    """Dotted names of the modules of ``model`` a quantizer has changed: torch.ao quantized
    modules, and modules whose own weights are torchao quantized tensors."""
    return [fqn for fqn, module in model.named_modules() if _is_quantized(module)]


def warn_if_quantized_beside(model: nn.Module, sketched_names: Sequence[str], action: str) -> None:
    """Warn when ``model`` holds quantized modules and the sketched layers ``sketched_names``,
    which the quantizer skipped, naming a few of each and pointing to ``freeze``; ``action``
    says what the user called."""
    if not sketched_names:
        return
    quantized = quantized_module_names(model)
    if not quantized:
        return
    warnings.warn(
        f"{action}: the model holds quantized modules ({', '.join(quantized[:3])}, {len(quantized)} in all) "
        f"and {len(sketched_names)} sketched layers ({', '.join(sketched_names[:3])}) that the quantizer "
        "skipped: they are still float. Quantizers replace nn.Linear/nn.ConvNd, which sketched layers are not: "
        "call panther_lite.freeze(model) before quantizing, so each sketched layer becomes two standard layers "
        "the quantizer handles",
        UserWarning,
        stacklevel=3,
    )


def check_storable(model: nn.Module, action: str) -> None:
    """ValueError when ``model``'s ``state_dict`` holds what safetensors cannot store (the packed
    weights of torch.ao quantized modules, torchao's quantized tensors); ``action`` says what
    the user called. Called before anything is written."""
    odd = [key for key, value in model.state_dict().items() if type(value) not in (torch.Tensor, nn.Parameter)]
    if odd:
        quantized = quantized_module_names(model)
        more = ", ..." if len(quantized) > 3 else ""
        held = f" (quantized modules: {', '.join(quantized[:3])}{more})" if quantized else ""
        raise ValueError(
            f"{action} stores plain tensors (safetensors), but the state_dict entries {odd[:3]}"
            f"{' and more' if len(odd) > 3 else ''} are not{held}: save the float model before quantizing, and "
            "quantize again after from_pretrained (or torch.save(model.state_dict()) for this form)"
        )
