"""The model with its blocks replayed: what runs before and after a block list (embeddings, final
norm, head, pooler) on the blocks' cached outputs, without the blocks. A pipeline that never
holds the blocks together calibrates and fits the layers outside them on it, and measures the
blocks' gains to the model's output by a backward pass that streams the blocks in reverse.

:class:`HeadRunner` runs the model on a calibration batch with every block replaced by a
stand-in returning the hidden states the last block gave for that batch, so a list of
``(batch, hidden)`` pairs is a list of calibration batches of it.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, ContextManager, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_map

from ..calibration.batches import evaluation_run, run_batch
from ..calibration.tokens import batch_token_mask
from ..planning.output_distance import probe_output
from .blocks import BlockCall, BlockList, output_hidden, with_hidden

__all__ = ["HeadRunner", "output_template", "streamed_block_gains", "vector_jacobian"]


def output_template(block: nn.Module, call: BlockCall, run: Optional[Callable[[], object]] = None):
    """What ``block`` returns on ``call``, computed on the meta device (no values, no memory):
    a Tensor, or a tuple whose first item is the hidden states (other tensors become None).
    A block with a kernel the meta device cannot run (transformers' ``grouped_mm`` experts in
    float32) is run for real by ``run()`` instead, when given."""
    on_meta = tree_map(lambda value: value.to("meta") if isinstance(value, Tensor) else value, call)
    try:
        with torch.no_grad():
            output = copy.deepcopy(block).to("meta")(*on_meta[0], **on_meta[1])
    except (RuntimeError, NotImplementedError):
        if run is None:
            raise
        output = run()
    if isinstance(output, Tensor):
        return output
    return tuple(None if isinstance(item, Tensor) else item for item in output)


class _StandIn(nn.Module):
    """A block that returns ``hidden`` (in the structure of ``template``) whatever it is given."""

    def __init__(self, hidden: Tensor, template) -> None:
        super().__init__()
        self.hidden, self.template = hidden, template

    def forward(self, *args, **kwargs):
        return self.hidden if isinstance(self.template, Tensor) else (self.hidden, *self.template[1:])


class HeadRunner(nn.Module):
    """The model seen from after its blocks: the model's children keep their names (records and
    swaps by name apply, a swapped top-level layer runs in the model), but a forward
    ``(batch, hidden)`` runs the model on ``batch`` with each block a stand-in returning
    ``hidden`` (moved to the device of the model outside the blocks). ``template``: what a
    block returns (:func:`output_template`)."""

    def __init__(self, model: nn.Module, block_list: BlockList, template) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.__dict__["_model"] = model  # not a child: its children are already ours
        self.__dict__["_container"] = model.get_submodule(block_list.path)
        self.__dict__["_template"] = template
        self.__dict__["_home"] = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))

    @contextlib.contextmanager
    def _in_model(self, hidden: Tensor) -> Iterator[None]:
        model, container = self._model, self._container
        ours = {name: child for name, child in self.named_children() if model._modules.get(name) is not child}
        theirs = {name: model._modules[name] for name in ours}
        blocks = dict(container._modules)
        stand_in = _StandIn(hidden.to(self._home), self._template)
        try:
            model._modules.update(ours)
            container._modules.update({key: stand_in for key in blocks})
            yield
        finally:
            container._modules.update(blocks)
            model._modules.update(theirs)

    def forward(self, batch, hidden: Tensor):
        with self._in_model(hidden):
            return run_batch(self._model, batch)


def vector_jacobian(
    block: nn.Module, call: BlockCall, hidden: Tensor, grad: Tensor, device,
    more: Callable[[], Sequence[Tensor]] = tuple,
) -> Tuple[Optional[Tensor], ...]:
    """The gradient at ``block``'s input ``hidden`` (its call's other arguments unchanged) of
    ``<block output, grad>`` (None when the output does not depend on it), followed by those at
    the tensors ``more()`` gives once the block has run (leaves its hooks made on the way)."""
    move = (lambda value: value) if device is None else (lambda value: value.to(device))
    leaf = move(hidden).detach().requires_grad_()
    args, kwargs = with_hidden(tree_map(lambda value: move(value) if isinstance(value, Tensor) else value, call), leaf)
    output = output_hidden(block(*args, **kwargs))
    if output is None:
        raise ValueError("block pipeline: a block returned no hidden states to carry the gradient back through")
    return torch.autograd.grad(output, [leaf, *more()], grad.to(output), allow_unused=True)


def streamed_block_gains(
    head: HeadRunner, block_list: BlockList, count: int, batch, calls: Sequence[BlockCall],
    outputs: Callable[[int], Tensor], loaded: Callable[[int], ContextManager], device=None, metric: str = "auto",
) -> List[float]:
    """:func:`~panther_lite.conversion.planning.sensitivity.block_output_gains` of the first
    ``count`` blocks, streamed: ``outputs(b)`` is block ``b``'s output on the first batch
    (``batch``, on which block ``b`` is called with ``calls[b]``, its hidden states aside),
    ``loaded(b)`` loads block ``b`` for the duration. The model's output is taken from ``head`` on the last block's output, then the
    gradient of the same random direction is carried back block by block (each block loaded,
    in reverse, and run once more on its input with autograd), so the gains equal a backward
    pass through the whole model while one block is held at a time."""
    last = len(block_list.blocks) - 1
    leaf = outputs(last).detach().requires_grad_()
    with evaluation_run(head), torch.enable_grad():
        probe = probe_output(head(batch, leaf), batch_token_mask(batch), metric)
        if probe is None or not probe.tensor.requires_grad or not probe.moves():
            return [1.0] * count
        direction = probe.direction(torch.Generator().manual_seed(0))
        (grad,) = torch.autograd.grad(probe.tensor, leaf, direction, allow_unused=True)
    reference = probe.reference()
    gains = [1.0] * count
    for index in range(last, -1, -1):
        if grad is None:  # the output does not depend on this block's output, nor on any before
            break
        if index < count:
            x = outputs(index)
            gains[index] = float(x.double().norm() ** 2 * grad.double().norm() ** 2 / (x.numel() * reference))
        if index == 0:
            break
        block = block_list.blocks[index]
        with loaded(index), evaluation_run(block), torch.enable_grad():
            grad = vector_jacobian(block, calls[index], outputs(index - 1), grad, device)[0]
    return gains
