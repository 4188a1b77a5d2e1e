"""Model surgery: swap modules at every place a model holds them, all or nothing, with an
undo that puts the originals back; forward and backward hooks follow the swap; buffers the
model's own forward changed during a failed conversion are put back too."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Tuple, TypeVar

import torch
import torch.nn as nn

Replacement = Tuple[str, nn.Module]
Function = TypeVar("Function", bound=Callable)
# nn.Module's per-module hook registries (dicts keyed by handle id)
_HOOK_REGISTRIES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
# (parent, attribute name, module that was there)
SwapLog = List[Tuple[nn.Module, str, nn.Module]]


def undo_swaps(log: SwapLog) -> None:
    """Put back every module a :func:`swap_modules` call replaced, newest first."""
    for parent, child, old in reversed(log):
        setattr(parent, child, old)


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Make ``new`` run the forward and backward hooks registered on ``old`` (a user's
    feature-extraction hook keeps firing after conversion): the registries are shared, so a
    handle from ``old.register_forward_hook`` still removes its hook. State-dict hooks are
    not carried: they are written for ``old``'s parameter names."""
    for name in _HOOK_REGISTRIES:
        registry = getattr(old, name)
        registry.update(getattr(new, name))
        new.__dict__[name] = registry
    new._is_full_backward_hook = old._is_full_backward_hook


def swap_modules(model: nn.Module, replacements: List[Replacement]) -> SwapLog:
    """Replace the module at each dotted name with its new module, at every place the
    model holds that same module (a shared layer stays shared), carrying its hooks over
    (:func:`carry_hooks`); all or nothing. Returns the log :func:`undo_swaps` reverts."""
    aliases: Dict[int, List[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(fqn)
    log: SwapLog = []
    try:
        for fqn, new in replacements:
            old = model.get_submodule(fqn)
            carry_hooks(old, new)
            for alias in aliases.get(id(old), [fqn]):
                parent_name, _, child = alias.rpartition(".")
                parent = model.get_submodule(parent_name)
                log.append((parent, child, getattr(parent, child)))
                setattr(parent, child, new)
    except BaseException:
        undo_swaps(log)
        raise
    return log


def stored_numel(model: nn.Module) -> int:
    """Entries of the model's parameters and buffers (the U sketches included); those of
    lazy modules, not materialized yet, count 0."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() for t in tensors if not nn.parameter.is_lazy(t))


def _restore_buffers(saved: List[Tuple[nn.Module, str, torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for module, name, tensor, copy in saved:
            if tensor.is_inference():  # cannot be written outside inference mode: put the copy in
                module._buffers[name] = copy
                continue
            module._buffers[name] = tensor  # the very tensor (a forward may have rebound the name)
            tensor.copy_(copy)


def restores_buffers_on_error(function: Function) -> Function:
    """Decorate ``function(model, ...)`` so that, if it raises, every buffer ``model`` held
    when it was called has its value and identity back (BatchNorm running statistics moved
    by a forward that switches itself to training, a user's call counter, ...). Costs one copy
    of the buffers (not of the parameters) for the duration of the call."""

    @functools.wraps(function)
    def wrapper(model, *args, **kwargs):
        saved = [
            (module, name, tensor, tensor.clone())
            for module in (model.modules() if isinstance(model, nn.Module) else ())
            for name, tensor in module._buffers.items()
            if tensor is not None and not nn.parameter.is_lazy(tensor)
        ]
        try:
            return function(model, *args, **kwargs)
        except BaseException:
            _restore_buffers(saved)
            raise

    return wrapper
