"""A model skeleton (parameters on the meta device) filled part by part from its checkpoint: a
part is one block of its block list, or everything outside the blocks (embeddings, final norm,
head). Load a part's tensors into the very modules the conversion's records point at, release
them again (back to the meta device, so their memory is freed), and read off the tensors of a
part its output keeps."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..kinds import sketched_types
from ..saving.checkpoint_files import CheckpointFiles
from .blocks import BlockList

Part = Optional[int]  # a block's index, or None for everything outside the blocks
# (dotted name, owning module, attribute, is a parameter, is saved in the state_dict)
Slot = Tuple[str, nn.Module, str, bool, bool]


def _tie_groups(model: nn.Module) -> List[List[str]]:
    """Groups of two or more names sharing one Parameter (tied weights)."""
    groups: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


class SkeletonParts:
    """``model`` (a skeleton from :meth:`~panther_lite.conversion.saving.checkpoint_files.CheckpointFiles.skeleton`)
    and its checkpoint ``files``, cut into parts by ``block_list``."""

    def __init__(self, model: nn.Module, files: CheckpointFiles, block_list: BlockList) -> None:
        self.model, self.files, self.block_list = model, files, block_list
        self.ties = _tie_groups(model)

    def part_of(self, name: str) -> Part:
        """The part holding the tensor ``name``."""
        inside = name.startswith(self.block_list.path + ".")
        return int(name[len(self.block_list.path) + 1:].split(".", 1)[0]) if inside else None

    def _root(self, part: Part) -> Tuple[nn.Module, str]:
        """``part``'s module and the dotted-name prefix of its tensors."""
        return (self.model, "") if part is None else (self.block_list.blocks[part], self.block_list.prefix(part))

    def sketched(self, part: Part) -> Set[str]:
        """The names of ``part``'s tensors that belong to a sketched layer (its submodules' too:
        the stacked factors of a sketched experts module)."""
        root, prefix = self._root(part)
        found: Set[str] = set()
        for module_name, module in root.named_modules():
            if isinstance(module, sketched_types()):
                tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
                found.update(f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}" for name, _ in tensors)
        return found

    def slots(self, part: Part) -> Iterator[Slot]:
        """Every parameter and buffer of ``part``, tied ones under each of their names."""
        root, prefix = self._root(part)
        for module_name, module in root.named_modules(remove_duplicate=False):
            path = f"{prefix}{module_name}." if module_name else prefix
            if part is None and path.startswith(self.block_list.path + "."):
                continue
            for attr, param in module._parameters.items():
                if param is not None:
                    yield f"{path}{attr}", module, attr, True, True
            for attr, buffer in module._buffers.items():
                if buffer is not None:
                    yield f"{path}{attr}", module, attr, False, attr not in module._non_persistent_buffers_set

    def missing(self) -> List[str]:
        """Names of the skeleton's meta tensors the checkpoint holds under no name they are tied to."""
        tied = {name: group for group in self.ties for name in group}
        return [
            name for part in [None, *range(len(self.block_list.blocks))] for name, module, attr, _, _ in self.slots(part)
            if getattr(module, attr).is_meta and not any(other in self.files.tensors for other in tied.get(name, [name]))
        ]

    def unplaced(self) -> List[str]:
        """Names of the checkpoint's tensors that no parameter or buffer of the skeleton has."""
        placed = {name for part in [None, *range(len(self.block_list.blocks))] for name, *_ in self.slots(part)}
        return sorted(name for name in self.files.tensors if name not in placed)

    def ties_across_parts(self) -> List[List[str]]:
        """The tie groups whose names lie in more than one part (these cannot be streamed)."""
        return [group for group in self.ties if len({self.part_of(name) for name in group}) > 1]

    def load(self, part: Part) -> None:
        """Read ``part``'s tensors from the checkpoint into the skeleton (each cast to the dtype
        the skeleton holds it in), tied parameters tied again."""
        slots = [slot for slot in self.slots(part) if slot[0] in self.files.tensors]
        tensors = self.files.read(name for name, *_ in slots)
        for name, module, attr, is_parameter, _ in slots:
            old, new = getattr(module, attr), tensors.pop(name)
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(
                    f"the checkpoint's {name} has shape {tuple(new.shape)}, the model built from its config expects "
                    f"{tuple(old.shape)}"
                )
            new = new.to(old.dtype) if old.is_floating_point() else new
            if is_parameter:
                module._parameters[attr] = nn.Parameter(new, requires_grad=old.requires_grad)
            else:
                module._buffers[attr] = new
        for group in self.ties:
            loaded = next((n for n in group if self.part_of(n) == part and n in self.files.tensors), None)
            for name in group if loaded is not None else ():
                owner, _, attr = name.rpartition(".")
                self.model.get_submodule(owner)._parameters[attr] = self.model.get_parameter(loaded)

    def release(self, part: Part) -> None:
        """Put ``part``'s tensors back on the meta device (its sketched layers' too), freeing
        them; buffers computed by the model's ``__init__`` and not saved stay, on the CPU."""
        sketched = self.sketched(part)
        for name, module, attr, is_parameter, saved in self.slots(part):
            tensor = getattr(module, attr)
            if is_parameter:
                module._parameters[attr] = nn.Parameter(tensor.to("meta"), requires_grad=tensor.requires_grad)
            elif saved and (name in self.files.tensors or name in sketched):
                module._buffers[attr] = tensor.to("meta")
            else:
                module._buffers[attr] = tensor.cpu()

    @contextlib.contextmanager
    def loaded(self, part: Part, device: Optional[torch.device] = None) -> Iterator[None]:
        """``part`` loaded (and moved to ``device``, None: the CPU) for the duration, released after."""
        try:
            self.load(part)
            if device is not None and part is not None:
                self.block_list.blocks[part].to(device)
            yield
        finally:
            self.release(part)

    def state(self, part: Part) -> Dict[str, Tensor]:
        """The tensors of ``part`` the output keeps, on the CPU: those the checkpoint holds (a
        tied duplicate it leaves out stays out) and every tensor of a sketched layer."""
        sketched = self.sketched(part)
        return {
            name: getattr(module, attr).detach().cpu().contiguous()
            for name, module, attr, _, saved in self.slots(part)
            if saved and (name in self.files.tensors or name in sketched)
        }
