"""Repeated blocks of a model, the by-blocks pipeline's steps: find its block list (a
transformers model's ``model.layers``, ``transformer.h``, ``encoder.layer``, ``encoder.block``,
...), capture the first block's inputs for every calibration batch, and run one block on
cached inputs.

A cached *call* is ``(args, kwargs)``, what the model passed to the first block for one batch
(hidden states, attention mask, position embeddings, ...), held on the cache device. The
blocks are assumed to run one after the other, each fed the previous one's hidden states (the
first tensor it returns) with the other arguments unchanged; key/value caches are dropped.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from ..calibration.batches import evaluation_run, run_batch
from ..kinds import kind_of
from ..records import LayerRecord
from ..rules import progress_bar

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


def _auto_blocks(model: nn.Module, records: Sequence[LayerRecord]) -> Tuple[Optional[BlockList], str]:
    best: Optional[BlockList] = None
    for path, module in model.named_modules():
        children = _repeated_children(module)
        if children is None or not path or not _count_inside(path, records):
            continue
        if best is None or len(children) > len(best.blocks):
            best = BlockList(path, children)
    if best is None:
        return None, "no list of two or more same-class blocks holds a layer to convert"
    return best, f"{len(best.blocks)} blocks at {best.path}"


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


def move_call(call: BlockCall, device: Optional[torch.device]) -> BlockCall:
    """``call`` with its tensors detached and on ``device`` (None: where they are) and any
    key/value cache replaced by None (a block run twice must not append to it)."""

    def move(value):
        if isinstance(value, Tensor):
            value = value.detach()
            return value if device is None else value.to(device)
        return None if _is_cache(value) else value

    return tree_map(move, call)


def hidden_states(call: BlockCall) -> Tensor:
    """The hidden states of a block call: its first positional argument or ``hidden_states=``."""
    args, kwargs = call
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, Tensor):
        raise ValueError(
            "block pipeline: the first block was called without a hidden-states tensor as its first argument "
            "or hidden_states=; pass blocks=False"
        )
    return hidden


def _with_hidden(call: BlockCall, hidden: Tensor) -> BlockCall:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class _Captured(Exception):
    """Raised by the first block's pre-hook: the rest of the forward is not needed."""


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


def _other_arguments(call: BlockCall) -> list:
    """The leaves of a call's arguments other than its hidden states (caches dropped)."""
    args, kwargs = move_call(call, None)
    rest = (args[1:], kwargs) if args else ((), {k: v for k, v in kwargs.items() if k != "hidden_states"})
    return tree_flatten(rest)[0]


def _same_leaves(first: list, other: list) -> bool:
    if len(first) != len(other):
        return False
    for a, b in zip(first, other):
        if isinstance(a, Tensor) or isinstance(b, Tensor):
            if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)):
                return False
        elif a is not b and a != b:
            return False
    return True


def chain_problem(model: nn.Module, block_list: BlockList, batch) -> Optional[str]:
    """Run ``batch`` through the model once and say why the blocks do not form a chain (each
    called once, in order, on the previous block's hidden states and the first block's other
    arguments, as the pipeline replays them), or None when they do. T5's blocks, for one,
    pass a position bias computed by the first block to the others."""
    calls: List[Tuple[int, BlockCall]] = []
    outputs: dict = {}

    def pre_hook(index):
        return lambda module, args, kwargs: calls.append((index, (args, kwargs)))

    def post_hook(index):
        return lambda module, args, kwargs, output: outputs.__setitem__(index, output)

    handles = [block.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, block in enumerate(block_list.blocks)]
    handles += [block.register_forward_hook(post_hook(i), with_kwargs=True) for i, block in enumerate(block_list.blocks)]
    try:
        with evaluation_run(model), without_kv_cache(model):
            run_batch(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    if [index for index, _ in calls] != list(range(len(block_list.blocks))):
        return f"the blocks at {block_list.path} are not each called once, in order"
    first = _other_arguments(calls[0][1])
    for index, call in calls[1:]:
        previous = outputs[index - 1]
        previous = previous if isinstance(previous, Tensor) else previous[0]
        if hidden_states(call) is not previous or not _same_leaves(first, _other_arguments(call)):
            return (
                f"block {index} at {block_list.path} is not called on the previous block's hidden states with the "
                "first block's other arguments"
            )
    return None


def capture_inputs(model: nn.Module, block_list: BlockList, batches, cache_device, progress) -> List[BlockCall]:
    """One cached call of the first block per calibration batch (each forward stops there);
    ValueError when a batch never reaches the first block."""
    calls: List[BlockCall] = []

    def pre_hook(module, args, kwargs):
        call = move_call((args, kwargs), cache_device)
        hidden_states(call)
        calls.append(call)
        raise _Captured

    handle = block_list.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with evaluation_run(model), without_kv_cache(model):
            for index, batch in enumerate(progress_bar(batches, "capturing block inputs", "batch", progress)):
                try:
                    run_batch(model, batch)
                except _Captured:
                    pass
                if len(calls) != index + 1:
                    raise ValueError(
                        f"block pipeline: calibration batch {index} never reached the first block "
                        f"{block_list.prefix(0)[:-1]!r}; pass blocks=False"
                    )
    finally:
        handle.remove()
    return calls


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


def _output_hidden(output, expected: Tensor, where: str) -> Tensor:
    hidden = output if isinstance(output, Tensor) else output[0] if isinstance(output, (tuple, list)) else None
    if not isinstance(hidden, Tensor) or hidden.shape != expected.shape:
        got = type(output).__name__ if hidden is None else f"shape {tuple(hidden.shape)}"
        raise ValueError(
            f"block pipeline: block {where!r} returned {got}, expected hidden states of shape "
            f"{tuple(expected.shape)} to feed the next block; pass blocks=False"
        )
    return hidden


def run_block(runner: BlockRunner, calls: List[BlockCall], cache_device, where: str) -> List[BlockCall]:
    """The next block's calls: ``runner``'s block run (eval, no_grad) on each cached call, its
    hidden states replaced by the block's output (on ``cache_device``, None: the input's)."""
    next_calls = []
    with evaluation_run(runner):
        for call in calls:
            hidden = hidden_states(call)
            output = _output_hidden(run_batch(runner, call), hidden, where)
            next_calls.append(_with_hidden(call, output.to(hidden.device if cache_device is None else cache_device)))
    return next_calls
