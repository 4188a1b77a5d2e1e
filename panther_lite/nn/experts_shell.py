"""The dense experts module without its expert weights (the *shell*) that sketched and frozen
experts layers keep for everything model-specific — activation, gate (``_apply_gate``), flags,
post-expert norm, the shared ``config`` — and how they hold it.

The shell is not a child module: a model's own weight init (transformers' ``_init_weights``)
walks the children and would find an instance of the dense experts class without its weights.
What the shell owns (a post-expert norm, its activation module, any other tensor) is registered
on the holder under the shell's own names instead (so ``post_expert_norm.weight`` keeps its key),
and device, dtype and state_dict changes reach the shell through those shared objects.
"""
from __future__ import annotations

import copy
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["copy_sharing_config", "weightless_copy", "expert_activation", "expert_finish", "ShellHolder"]


def copy_sharing_config(module: nn.Module, skip: Tuple[Tensor, ...] = ()) -> nn.Module:
    """A deep copy of ``module`` that shares its ``config`` (so implementation switches reach
    both) and holds None where ``module`` holds one of the ``skip`` tensors (never copied)."""
    memo: Dict[int, object] = {id(t): None for t in skip}
    config = getattr(module, "config", None)
    if config is not None:
        memo[id(config)] = config
    return copy.deepcopy(module, memo)


def weightless_copy(experts: nn.Module, projections) -> nn.Module:
    """``experts`` without its expert weights and biases (``projections``: ``[(name, weight, bias)]``)."""
    tensors = tuple(t for _, weight, bias in projections for t in (weight, bias) if t is not None)
    shell = copy_sharing_config(experts, tensors)
    for name, _, bias in projections:
        for key in (name, f"{name}_bias") if bias is not None else (name,):
            shell._parameters.pop(key, None)
            shell._buffers.pop(key, None)
    return shell


def expert_activation(experts: nn.Module, hidden: Tensor) -> Tensor:
    """What a transformers experts module applies between its projections, on up-projection
    outputs ``(S, out_up) -> (S, inter)``: its gate (``_apply_gate``, e.g. ``act(gate) * up``)
    or, without a gate projection (``has_gate=False``), its activation."""
    if not getattr(experts, "has_gate", True):
        return experts.act_fn(hidden)
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is not None:
        return apply_gate(hidden)
    gate, up = hidden.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def expert_finish(experts: nn.Module, hidden: Tensor) -> Tensor:
    """A transformers experts module's post-expert norm (``has_post_expert_norm``), where it has one."""
    return experts.post_expert_norm(hidden) if getattr(experts, "has_post_expert_norm", False) else hidden


class ShellHolder(nn.Module):
    """A module keeping a shell (see the module docstring): :meth:`hold_shell` once in
    ``__init__``, then ``self.shell``."""

    shell: nn.Module

    def hold_shell(self, shell: nn.Module, device: torch.device, dtype: Optional[torch.dtype]) -> None:
        """Keep ``shell`` (its tensors moved to ``device``/``dtype``) and register what it owns here."""
        _place_shell(shell, device, dtype)
        self.__dict__["shell"] = shell
        for name, child in shell.named_children():
            self.add_module(name, child)
        for name, param in shell._parameters.items():
            if param is not None:
                self.register_parameter(name, param)
        for name, buffer in shell._buffers.items():
            if buffer is not None:
                self.register_buffer(name, buffer, persistent=name not in shell._non_persistent_buffers_set)

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply``, then the shell's own tensors are the (possibly new) registered ones."""
        super()._apply(fn, recurse)
        for name in list(self.shell._parameters):
            if name in self._parameters:
                self.shell._parameters[name] = self._parameters[name]
        for name in list(self.shell._buffers):
            if name in self._buffers:
                self.shell._buffers[name] = self._buffers[name]
        return self


def _place_shell(shell: nn.Module, device: torch.device, dtype: Optional[torch.dtype]) -> None:
    """Move the shell's own tensors (e.g. a post-expert norm) to the factors' device (and dtype)."""
    tensors = list(shell.parameters()) + list(shell.buffers())
    if not tensors:
        return
    if any(t.is_meta for t in tensors) and device.type != "meta":
        raise ValueError(
            "the experts module's other parameters (e.g. post_expert_norm) are on the meta device: materialise them"
        )
    shell.to(device=device, dtype=dtype)
