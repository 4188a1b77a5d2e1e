"""Repeated blocks of a model, the by-blocks pipeline's steps: find its block list (a
transformers model's ``model.layers``, ``transformer.h``, ``encoder.layer``, ``encoder.block``,
a CNN's ``stages``, ...) and run one block alone on cached calls.

A cached *call* is ``(args, kwargs)``, what the model passed to a block for one batch (hidden
states, attention mask, position embeddings, ...), held on the cache device, key/value caches
dropped (:mod:`~panther_lite.conversion.pipelines.capture` records each block's own). A block
takes its hidden states as its first positional argument (or ``hidden_states=``) and returns
them first (a tensor, or a tuple or list starting with one).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_map

from ..calibration.batches import evaluation_run, run_batch
from ..kinds import kind_of
from ..records import LayerRecord

BlockCall = Tuple[tuple, dict]
BlocksOption = Union[None, bool, str]


@dataclass
class BlockList:
    """The model's repeated blocks: the module list at ``path`` and its children in order."""

    path: str
    blocks: List[nn.Module]

    def prefix(self, index: int) -> str:
        """Dotted-name prefix of the layers inside block ``index``."""
        return f"{self.path}.{index}."

    def records_in(self, index: int, records: Sequence[LayerRecord]) -> List[LayerRecord]:
        return [record for record in records if record.name.startswith(self.prefix(index))]

    def inside(self, record: LayerRecord) -> bool:
        return record.name.startswith(self.path + ".")


def _repeated_children(module: nn.Module) -> Optional[List[nn.Module]]:
    """The children of a ModuleList/Sequential when there are at least two, distinct, of one
    class that is not itself a convertible layer (a list of heads is not a block list)."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return None
    children = list(module.children())
    if len(children) < 2 or len({id(child) for child in children}) < len(children):
        return None
    if len({type(child) for child in children}) > 1 or kind_of(children[0]) is not None:
        return None
    return children


def _count_inside(path: str, records: Sequence[LayerRecord]) -> int:
    return sum(record.to_convert and record.name.startswith(path + ".") for record in records)


def _block_lists(model: nn.Module) -> Iterator[BlockList]:
    """Every list of two or more same-class blocks in the model (:func:`_repeated_children`)."""
    for path, module in model.named_modules():
        children = _repeated_children(module)
        if children is not None and path:
            yield BlockList(path, children)


def _longest(block_lists: Iterable[BlockList]) -> Optional[BlockList]:
    """The first of the longest block lists, None when there is none."""
    return max(block_lists, key=lambda found: len(found.blocks), default=None)


def _auto_blocks(model: nn.Module, records: Sequence[LayerRecord]) -> Tuple[Optional[BlockList], str]:
    best = _longest(found for found in _block_lists(model) if _count_inside(found.path, records))
    if best is None:
        return None, "no list of two or more same-class blocks holds a layer to convert"
    return best, f"{len(best.blocks)} blocks at {best.path}"


def repeated_block_list(model: nn.Module) -> Optional[BlockList]:
    """The model's longest list of two or more same-class blocks, whatever layers they hold
    (None when it has none)."""
    return _longest(_block_lists(model))


def _named_blocks(model: nn.Module, path: str, records: Sequence[LayerRecord]) -> BlockList:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"blocks={path!r}: the model has no submodule of that name") from None
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
        raise ValueError(
            f"blocks={path!r} is a {type(module).__name__}; expected a non-empty nn.ModuleList (or nn.Sequential) "
            "of the blocks the model runs one after the other"
        )
    if not _count_inside(path, records):
        raise ValueError(f"blocks={path!r} holds none of the layers to convert")
    return BlockList(path, list(module.children()))


def find_blocks(model: nn.Module, records: Sequence[LayerRecord], blocks: BlocksOption) -> Tuple[Optional[BlockList], str]:
    """``(block list, description)``, or ``(None, why not)`` for ``blocks=False``/no block list.

    ``blocks``: ``"auto"``/None (the longest list of two or more same-class children holding a
    layer to convert), a dotted path to such a list, or False (never)."""
    if blocks is False:
        return None, "blocks=False"
    if blocks is None or blocks == "auto":
        return _auto_blocks(model, records)
    found = _named_blocks(model, blocks, records)
    return found, f"{len(found.blocks)} blocks at {found.path}"


def _is_cache(value) -> bool:
    """Whether ``value`` is a transformers key/value cache (by its base class's name, so
    transformers need not be imported)."""
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def move_call(call: BlockCall, device: Optional[torch.device], memo: Optional[dict] = None) -> BlockCall:
    """``call`` with its tensors detached and on ``device`` (None: where they are) and any
    key/value cache replaced by None (a block run twice must not append to it). ``memo``
    (``id -> (tensor, moved)``) moves a tensor several calls share only once."""
    memo = {} if memo is None else memo

    def move(value):
        if not isinstance(value, Tensor):
            return None if _is_cache(value) else value
        if id(value) not in memo:
            moved = value.detach()
            memo[id(value)] = (value, moved if device is None else moved.to(device))
        return memo[id(value)][1]

    return tree_map(move, call)


def hidden_states(call: BlockCall) -> Optional[Tensor]:
    """The hidden states of a block call: its first positional argument, or ``hidden_states=``
    when it has none (None when that is not a tensor)."""
    args, kwargs = call
    hidden = args[0] if args else kwargs.get("hidden_states")
    return hidden if isinstance(hidden, Tensor) else None


def with_hidden(call: BlockCall, hidden: Optional[Tensor]) -> BlockCall:
    """``call`` with ``hidden`` in place of its hidden states."""
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def output_hidden(output) -> Optional[Tensor]:
    """The hidden states a block returns: the output itself, or the first item of a tuple/list."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, Tensor) else None


@contextlib.contextmanager
def without_kv_cache(model: nn.Module) -> Iterator[None]:
    """A transformers model's ``config.use_cache`` off for the duration (no key/value cache)."""
    config = getattr(model, "config", None)
    flag = getattr(config, "use_cache", None)
    if flag is not None:
        config.use_cache = False
    try:
        yield
    finally:
        if flag is not None:
            config.use_cache = flag


def block_device(block: nn.Module) -> Optional[torch.device]:
    """The device of ``block``'s first parameter or buffer (None if it has neither)."""
    tensor = next(iter([*block.parameters(), *block.buffers()]), None)
    return None if tensor is None else tensor.device


@contextlib.contextmanager
def block_on(block: nn.Module, device: Optional[torch.device]) -> Iterator[None]:
    """``block`` moved to ``device`` for the duration (None: left where it is), and back."""
    home = block_device(block)
    if device is None or home is None or home == device:
        yield
        return
    block.to(device)
    try:
        yield
    finally:
        block.to(home)


class BlockRunner(nn.Module):
    """The model seen through one block: the model's submodules keep their dotted names (so
    swaps and hooks by name apply to the model), but a forward runs only ``block`` on one
    cached call ``(args, kwargs)``, moved to ``device``. A list of cached calls is thus a list
    of calibration batches of this module (``run_batch`` passes a tuple as ``*batch``)."""

    def __init__(self, model: nn.Module, block: nn.Module, device: Optional[torch.device]) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        # not a child (it is already reachable by its name); names no model child will have
        self.__dict__["_running_block"] = block
        self.__dict__["_running_device"] = device if device is not None else block_device(block)

    def forward(self, args: tuple, kwargs: dict):
        args, kwargs = move_call((args, kwargs), self._running_device)
        return self._running_block(*args, **kwargs)


def run_block(runner: BlockRunner, calls: List[BlockCall], cache_device, where: str) -> List[Tensor]:
    """``runner``'s block run (eval, no_grad) on each cached call: the hidden states it returns
    for each (on ``cache_device``; None: the input's device), what feeds the next block."""
    outputs = []
    with evaluation_run(runner):
        for call in calls:
            output = output_hidden(run_batch(runner, call))
            if output is None:
                raise ValueError(f"block pipeline: block {where!r} returned no hidden states to feed the next block")
            outputs.append(output.to(hidden_states(call).device if cache_device is None else cache_device))
    return outputs
