"""The by-blocks pipeline's capture, and every rule for when replaying the blocks one by one
would not give the whole-model result: :func:`chain_problem` (what the model's structure rules
out) and :func:`capture_calls` (one run of every calibration batch through the model, recording
each block's own call (and each batch's real-token mask) while checking that the blocks form a chain, else :class:`BrokenChain`).

A chain, checked on every batch: each block is called once, in order, on the hidden states the
previous block returned (the first tensor of its output), untouched in between; no block
changes its inputs in place; no block has forward hooks (a replay would run them again) and no
layer to convert is shared between blocks or with the rest of the model, nor called across the
blocks' boundary. The other arguments are each block's own, so they may differ from block to
block and batch to batch (sliding-window masks). With ``sequential=True``, where converted
blocks feed the next, two more rules: no layer to convert runs before the first block (the
whole-model fit converts it first, so the blocks would see its converted outputs), and no block
receives, beside its hidden states, a tensor made after the first block was called (T5's
position bias, returned by its first block: a replay on converted inputs would take it from the
dense model).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, MutableMapping, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..calibration.batches import evaluation_run, run_batch
from ..calibration.tokens import MaskedCall, batch_token_mask, with_masks
from ..records import LayerRecord
from ..progress import progress_bar
from .blocks import (
    BlockCall, BlockList, block_device, hidden_states, move_call, output_hidden, with_hidden, without_kv_cache,
)

__all__ = ["BlockCalls", "BrokenChain", "chain_problem", "capture_calls"]

Materialise = Callable[[int, nn.Module], ContextManager]


class BrokenChain(Exception):
    """Why replaying the blocks one by one would not compute what the model computes."""


@dataclass
class BlockCalls:
    """Each block's own call per calibration batch, as the model made it: ``calls[b][i]`` is
    block ``i``'s call ``(args, kwargs)`` for batch ``b`` (on the cache device). Only the first
    block's calls hold their hidden states; a later block's hold None in their place, filled
    from the previous block's outputs by :meth:`feed`. ``masks[b]``: batch ``b``'s real-token
    mask ``(batch, seq)`` (None: every position is data; :mod:`~panther_lite.conversion.calibration.tokens`)."""

    calls: List[List[BlockCall]]
    masks: List[Optional[Tensor]]

    def first(self) -> List[Tensor]:
        """The first block's hidden states, one tensor per batch."""
        return [hidden_states(batch[0]) for batch in self.calls]

    def feed(self, index: int, hidden: Sequence[Tensor]) -> List[BlockCall]:
        """Block ``index``'s calls, one per batch, each on ``hidden[b]``."""
        return [with_hidden(batch[index], states) for batch, states in zip(self.calls, hidden)]

    def masked(self, calls: Sequence[BlockCall]) -> List[MaskedCall]:
        """``calls`` (one per batch, as :meth:`feed` gives them), each with its batch's mask:
        calibration data whose statistics count real tokens only."""
        return with_masks(calls, self.masks)


def _block_of(name: str, block_list: BlockList) -> Optional[int]:
    """The index of the block holding module ``name``, None outside the blocks."""
    if not name.startswith(block_list.path + "."):
        return None
    return int(name[len(block_list.path) + 1:].split(".", 1)[0])


def _place(index: Optional[int], block_list: BlockList) -> str:
    return "outside the blocks" if index is None else f"in block {index}"


def chain_problem(model: nn.Module, block_list: BlockList, records: Sequence[LayerRecord]) -> Optional[str]:
    """Why the model's structure rules out an exact replay of its blocks (forward hooks on a
    block or on every module, a layer to convert shared across the blocks' boundary), or None."""
    path = block_list.path
    if module_hooks._global_forward_pre_hooks or module_hooks._global_forward_hooks:
        return "global module forward hooks are registered, which replaying the blocks would run again"
    for index, block in enumerate(block_list.blocks):
        if block._forward_pre_hooks or block._forward_hooks:
            return f"block {index} at {path} has forward hooks, which replaying it would run again"
    converting = {id(record.module): record.name for record in records if record.to_convert}
    places: Dict[int, set] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in converting:
            places.setdefault(id(module), set()).add(_block_of(name, block_list))
    for key, found in places.items():
        if len(found) > 1:
            where = " and ".join(sorted(_place(index, block_list) for index in found))
            return f"layer {converting[key]!r} is shared ({where} at {path}), so one fit would serve several places"
    return None


def _version(tensor: Tensor) -> Optional[int]:
    """The tensor's in-place version counter (None for inference tensors, which keep none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _tensors(tree) -> List[Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, Tensor)]


def _to(tree, device: torch.device):
    return tree_map(lambda value: value.to(device) if isinstance(value, Tensor) else value, tree)


class _Captured(Exception):
    """Raised once the last block has returned: the rest of the forward is not needed."""


class _Capture:
    """The hooks of one capture (see :func:`capture_calls`): per batch, each block's call,
    checked against the chain's rules as the model runs; ``fail`` raises :class:`BrokenChain`."""

    def __init__(self, block_list: BlockList, sequential: bool, cache_device, materialise: Materialise) -> None:
        self.block_list, self.sequential = block_list, sequential
        self.cache_device, self.materialise = cache_device, materialise
        self.opened = contextlib.ExitStack()
        self.begin(0)

    def begin(self, batch: int) -> None:
        self.batch, self.calls, self.memo, self.running, self.home = batch, [], {}, None, None
        self.inputs: Dict[int, tuple] = {}  # id -> (tensor, version): arguments so far, the first hidden states
        self.hidden_in: Optional[tuple] = None  # the running block's hidden states and their version
        self.made: MutableMapping[int, Tensor] = weakref.WeakValueDictionary()  # made since block 0 was called
        self.last: Optional[tuple] = None  # the previous block's hidden states and their version

    def fail(self, reason: str) -> None:
        raise BrokenChain(f"{reason} (calibration batch {self.batch})")

    def close(self) -> None:
        """Release the block being run, if the forward stopped inside it."""
        self.opened.close()
        self.running = None

    def _where(self, index: int) -> str:
        return f"block {index} at {self.block_list.path}"

    def _check_input(self, index: int, call: BlockCall) -> Tensor:
        if index != len(self.calls) or self.running is not None:
            self.fail(f"the blocks at {self.block_list.path} are not each called once, in order")
        hidden = hidden_states(call)
        if hidden is None:
            self.fail(
                f"{self._where(index)} is called without a hidden-states tensor as its first argument or hidden_states="
            )
        if index:
            previous, version = self.last
            if hidden is not previous:
                self.fail(f"{self._where(index)} is not called on the hidden states block {index - 1} returned")
            if _version(hidden) != version:
                where = self._where(index)
                self.fail(f"the hidden states block {index - 1} returned are changed in place before {where} runs")
        if any(self.made.get(id(leaf)) is leaf for leaf in _tensors(with_hidden(call, None))):
            self.fail(
                f"sequential=True feeds converted blocks to the next, but {self._where(index)} receives a tensor made "
                "after the first block was called (returned by a block, or computed from one), which a replay on "
                "converted inputs would take from the dense model"
            )
        return hidden

    def enter(self, index: int, block: nn.Module, args: tuple, kwargs: dict):
        """Block ``index``'s pre-hook: check and record its call, materialise the block, and
        move the call onto the block's device when it is elsewhere."""
        call = (args, kwargs)
        hidden = self._check_input(index, call)
        kept = call if index == 0 else with_hidden(call, None)  # later blocks' hidden states come from a replay
        for leaf in _tensors(kept):  # checked until the last block returns (a later hidden state: in its block)
            self.inputs.setdefault(id(leaf), (leaf, _version(leaf)))
        self.hidden_in = (hidden, _version(hidden))
        self.calls.append(move_call(kept, self.cache_device, self.memo))
        self.running = index
        self.opened.enter_context(self.materialise(index, block))
        device = block_device(block)
        self.home = hidden.device if device is not None and device != hidden.device else None
        return None if self.home is None else _to(call, device)

    def leave(self, index: int, output):
        """Block ``index``'s forward hook: release the block, check its output and inputs."""
        self.close()
        if self.home is not None:
            output = _to(output, self.home)
        hidden = output_hidden(output)
        if hidden is None:
            self.fail(
                f"{self._where(index)} returns a {type(output).__name__}, not hidden states (a tensor, or a tuple or "
                "list starting with one)"
            )
        inputs = [*self.inputs.values(), self.hidden_in]
        if any(_version(leaf) != version for leaf, version in inputs):
            where = self._where(index)
            self.fail(f"{where} changes its inputs (or an earlier block's) in place, which a replay would repeat")
        self.hidden_in = None
        self.last = (hidden, _version(hidden))
        if index == len(self.block_list.blocks) - 1:
            raise _Captured
        return None if self.home is None else output

    def layer_called(self, record: LayerRecord, block: Optional[int], module: nn.Module, args: tuple, kwargs: dict):
        """A layer to convert's pre-hook: its input fits it, and it runs where a replay runs it."""
        try:
            record.kind.read_input(record.name, module, args, kwargs)
        except ValueError as error:
            raise ValueError(f"{error} (calibration batch {self.batch})") from None
        name, path = record.name, self.block_list.path
        if block is not None and block != self.running:
            self.fail(f"layer {name!r} of block {block} at {path} is called outside it")
        if block is None and self.running is not None:
            self.fail(f"layer {name!r}, outside the blocks, is called from {self._where(self.running)}")
        if block is None and self.sequential and not self.calls:
            self.fail(
                f"sequential=True converts layer {name!r}, which runs before the blocks at {path}, first: the blocks "
                "would then see its converted outputs, not the captured ones"
            )


class _MadeAfterFirstBlock(TorchFunctionMode):
    """Notes (weakly) every tensor a torch function makes once the first block has been called."""

    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.capture.calls:
            for leaf in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(leaf, Tensor):
                    self.capture.made[id(leaf)] = leaf
        return result


def _hooks(capture: _Capture, block_list: BlockList, records: Sequence[LayerRecord]) -> list:
    """Register the capture's hooks on the blocks and on the layers to convert; their handles."""
    handles = []
    for index, block in enumerate(block_list.blocks):

        def enter(module, args, kwargs, index=index):
            return capture.enter(index, module, args, kwargs)

        def leave(module, args, kwargs, output, index=index):
            return capture.leave(index, output)

        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(leave, with_kwargs=True))
    for record in records:
        if record.to_convert:

            def called(module, args, kwargs, record=record, block=_block_of(record.name, block_list)):
                capture.layer_called(record, block, module, args, kwargs)

            handles.append(record.module.register_forward_pre_hook(called, with_kwargs=True))
    return handles


def capture_calls(
    model: nn.Module, block_list: BlockList, records: Sequence[LayerRecord], batches, *, sequential: bool,
    cache_device: Optional[torch.device], materialise: Materialise, progress: Optional[bool] = False,
) -> BlockCalls:
    """Run every calibration batch through ``model`` (eval, no_grad, no key/value cache) up to the
    end of its last block, recording each block's call on ``cache_device`` (tensors the blocks
    share are moved once per batch) and checking the chain's rules (module docstring); each
    block runs inside ``materialise(index, block)``, its call moved onto the block's device and
    its output back. Raises :class:`BrokenChain` with the reason when a rule fails (or there is
    no batch), ValueError naming the batch and layer when a batch does not fit a layer to convert."""
    capture = _Capture(block_list, sequential, cache_device, materialise)
    handles = _hooks(capture, block_list, records)
    captured: List[List[BlockCall]] = []
    masks: List[Optional[Tensor]] = []
    try:
        noting = _MadeAfterFirstBlock(capture) if sequential else contextlib.nullcontext()
        with evaluation_run(model), without_kv_cache(model), noting:
            for index, batch in enumerate(progress_bar(batches, "capturing block inputs", "batch", progress)):
                capture.begin(index)
                try:
                    run_batch(model, batch, index)
                except _Captured:
                    pass
                finally:
                    capture.close()
                if len(capture.calls) != len(block_list.blocks):
                    capture.fail(f"the model does not call every block at {block_list.path}")
                captured.append(capture.calls)
                masks.append(batch_token_mask(batch))
    finally:
        for handle in handles:
            handle.remove()
    if not captured:
        raise BrokenChain("calibration_data holds no batch")
    return BlockCalls(captured, masks)
