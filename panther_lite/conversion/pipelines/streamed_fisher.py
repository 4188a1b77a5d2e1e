"""The output Fisher of the layers of a model streamed block by block: what
:func:`~panther_lite.conversion.planning.output_fisher.output_fishers` measures on a whole
model, with one block in memory at a time.

A forward pass over the blocks keeps each block's outputs on every calibration batch (``store``);
the head (:class:`~.head_replay.HeadRunner`) turns the last block's outputs into next-token
logits and draws one direction per batch; a reverse pass then carries its gradient back block by
block (each block loaded once, run again with autograd on each batch), reading the gradient at
every target layer's output on the way. So the sums equal those of a backward pass through the
whole model on each batch.
"""
from __future__ import annotations

from typing import Callable, ContextManager, Dict, List, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from ..calibration.batches import evaluation_run
from ..calibration.tokens import batch_token_mask
from ..planning.output_distance import probe_output
from ..planning.output_fisher import NO_LOGITS, add_fisher_terms, tap_gradients, tapped_outputs
from ..progress import progress_bar
from ..records import LayerRecord
from .blocks import BlockList, BlockRunner, run_block
from .capture import BlockCalls
from .head_replay import HeadRunner, vector_jacobian

__all__ = ["BlockStreams", "streamed_output_fishers"]


class BlockStreams:
    """How the streamed passes reach the blocks and their outputs: ``loaded(i)`` holds block
    ``i`` in memory for the duration, ``store(i, outputs)`` / ``fetch(i)`` keep and give back
    block ``i``'s outputs (one tensor per batch), ``keep(part, {name: F})`` takes the Fishers of
    a block (its index) or of the layers outside the blocks (``"outside"``) as soon as they are
    summed, ``device`` is where blocks run."""

    def __init__(self, loaded: Callable[[int], ContextManager], store: Callable[[int, List[Tensor]], None],
                 fetch: Callable[[int], List[Tensor]], keep: Callable[[object, Dict[str, Tensor]], None],
                 device=None, cache_device=None) -> None:
        self.loaded, self.store, self.fetch, self.keep = loaded, store, fetch, keep
        self.device, self.cache_device = device, cache_device


def _forward(model: nn.Module, block_list: BlockList, captured: BlockCalls, streams: BlockStreams, progress) -> None:
    """Each block's outputs on every batch, stored (one forward pass over the blocks)."""
    hidden = captured.first()
    for index in progress_bar(range(len(block_list.blocks)), "output Fisher: forward", "block", progress):
        block = block_list.blocks[index]
        with streams.loaded(index):
            runner = BlockRunner(model, block, streams.device)
            hidden = run_block(runner, captured.feed(index, hidden), streams.cache_device, block_list.prefix(index)[:-1])
        streams.store(index, hidden)


def _head_gradients(head: HeadRunner, batches: Sequence, last: List[Tensor], layers: dict, sums: dict, seed: int) -> List[Tensor]:
    """The gradient at the last block's output of one sampled next-token direction per batch
    (the Fisher terms of ``layers``, the target layers outside the blocks, added to ``sums``)."""
    generator, found = torch.Generator().manual_seed(seed), []
    for batch, hidden in zip(batches, last):
        leaf = hidden.detach().requires_grad_()
        taps: Dict[str, List[Tensor]] = {}
        handles = tapped_outputs(layers, taps)
        try:
            with evaluation_run(head), torch.enable_grad():
                probe = probe_output(head(batch, leaf), batch_token_mask(batch), "kl")
                if probe is None or not probe.kl:
                    raise ValueError(NO_LOGITS)
                leaves = [tap for name in taps for tap in taps[name]]
                grads = torch.autograd.grad(probe.tensor, [leaf, *leaves], probe.direction(generator), allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        add_fisher_terms(sums, tap_gradients(taps, grads[1:]))
        found.append(torch.zeros_like(hidden) if grads[0] is None else grads[0].detach())
    return found


def _block_backward(block, calls, inputs: List[Tensor], grads: List[Tensor], layers: dict, sums: dict, device) -> List[Tensor]:
    """The gradients at the block's inputs (one per batch) of ``<block output, grad>``, the
    Fisher terms of ``layers`` (its target layers) added to ``sums`` on the way."""
    found = []
    with evaluation_run(block), torch.enable_grad():
        for call, hidden, grad in zip(calls, inputs, grads):
            taps: Dict[str, List[Tensor]] = {}
            handles = tapped_outputs(layers, taps)
            try:
                leaves = lambda: [tap for name in taps for tap in taps[name]]  # noqa: E731 - made while the block runs
                result = vector_jacobian(block, call, hidden, grad, device, leaves)
            finally:
                for handle in handles:
                    handle.remove()
            add_fisher_terms(sums, tap_gradients(taps, result[1:]))
            found.append(torch.zeros_like(hidden) if result[0] is None else result[0].detach().to(hidden.device))
    return found


def streamed_output_fishers(
    model: nn.Module, head: HeadRunner, block_list: BlockList, captured: BlockCalls, batches: Sequence, targets: Sequence[LayerRecord],
    streams: BlockStreams, *, seed: int = 0, progress=None,
) -> None:
    """The next-token Fisher at the output of each of ``targets`` (float64, as
    :func:`~panther_lite.conversion.planning.output_fisher.output_fishers` gives it), summed over
    ``batches`` (the calibration batches ``captured`` recorded), ``model`` (``head`` its replay
    after the blocks) streamed as ``streams`` says, handed to ``streams.keep`` part by part
    (``"outside"``, then the blocks in reverse), so one block's Fishers are held at a time;
    ``targets`` before the blocks get none. Raises ValueError when the output holds no logits."""
    by_block: Dict[object, dict] = {None: {r.name: r.module for r in targets if not block_list.inside(r)}}
    for index in range(len(block_list.blocks)):
        by_block[index] = {r.name: r.module for r in block_list.records_in(index, targets)}
    _forward(model, block_list, captured, streams, progress)
    last = len(block_list.blocks) - 1
    outside: Dict[str, Tensor] = {}
    grads = _head_gradients(head, batches, streams.fetch(last), by_block[None], outside, seed)
    streams.keep("outside", outside)
    for index in progress_bar(range(last, -1, -1), "output Fisher: backward", "block", progress):
        if not any(by_block[i] for i in range(index + 1)):
            break  # no target at or before this block
        calls = [batch[index] for batch in captured.calls]
        inputs = captured.first() if index == 0 else streams.fetch(index - 1)
        sums: Dict[str, Tensor] = {}
        with streams.loaded(index):
            grads = _block_backward(block_list.blocks[index], calls, inputs, grads, by_block[index], sums,
                                    streams.device)
        streams.keep(index, sums)
