"""Checking that a converted model still runs, and naming the converted layer that broke
it: code around a layer may read its ``weight`` (T5's feed-forward reads
``wo.weight.dtype``), which only running the converted model reveals."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.nn as nn

from .calibration.batches import ModelRun, evaluation_run


class ConversionError(RuntimeError):
    """The converted model failed to run; ``layers`` names the converted layers involved
    (one when the failure is inside it or its parent has one converted child; empty when it
    could not be told) and ``__cause__`` is the original exception."""

    def __init__(self, message: str, layers: List[str]) -> None:
        super().__init__(message)
        self.layers = layers


def _layers_in_traceback(error: BaseException, model: nn.Module, converted: List[str]) -> List[str]:
    """The converted layers the innermost module frame of ``error``'s traceback points at:
    the layer itself when the frame's ``self`` is one (e.g. ``nn.Module.__getattr__`` asked
    for an attribute the sketched layer lacks), or its converted children when it is
    their parent (code reading a child instead of calling it)."""
    names: Dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)  # a shared module: its first name, as convert reports it
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        name = names.get(id(frame.f_locals.get("self")))
        if name is None:
            continue
        if name in converted:
            return [name]
        children = [layer for layer in converted if layer.rpartition(".")[0] == name]
        if children:
            return children
    return []


class _Tracker:
    """Forward hooks on the converted layers: which are running, and the last one entered."""

    def __init__(self, modules: Dict[str, nn.Module]) -> None:
        self.running: List[str] = []
        self.last: Optional[str] = None
        self.handles = []
        for name, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave(name), always_call=True))

    def _enter(self, name: str):
        def hook(module, args):
            self.running.append(name)
            self.last = name

        return hook

    def _leave(self, name: str):
        def hook(module, args, output):
            if self.running and self.running[-1] == name:
                self.running.pop()

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def check_converted_model_runs(model: nn.Module, run: ModelRun, modules: Dict[str, nn.Module], source: str) -> None:
    """Run ``run(model)`` once (eval mode, no_grad, training flags restored); on failure
    raise :class:`ConversionError` naming the converted layer involved, chained to the
    original exception. ``modules`` maps the converted layers' names to their new modules."""
    tracker = _Tracker(modules)
    try:
        with evaluation_run(model):
            run(model)
    except Exception as error:
        layers = _layers_in_traceback(error, model, list(modules)) or tracker.running[-1:]
        if len(layers) == 1:
            where = f"at converted layer {layers[0]!r}"
        elif layers:
            where = f"in the parent of converted layers {layers}"
        elif tracker.last is not None:
            where = f"after converted layer {tracker.last!r} ran (the failing code is outside the converted layers)"
        else:
            where = "before any converted layer ran"
        hint = f"; keep it dense with exclude_modules={layers!r}" if layers else ""
        raise ConversionError(
            f"convert: the converted model failed when run on {source} {where} "
            f"({type(error).__name__}: {error}); the model was rolled back to its dense layers{hint}",
            layers,
        ) from error
    finally:
        tracker.remove()
