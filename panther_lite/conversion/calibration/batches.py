"""Calibration data: its accepted forms (an iterable of batches or a callable ``fn(model)``),
checked once; running one batch through a model; the eval, no-grad run every stage uses; and
the input a layer's call receives; a batch's digest (its contents hashed)."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, List, Mapping, Optional

import torch
import torch.nn as nn
from torch import Tensor

from torch.utils._pytree import tree_flatten

from .tokens import MaskedCall, batch_token_mask, token_mask

__all__ = [
    "CalibrationData", "ModelRun", "add_to_digest", "run_batch", "run_batch_or_callable", "evaluation_run", "layer_input",
]

ModelRun = Callable[[nn.Module], object]


def layer_input(args: tuple, kwargs: dict) -> Tensor:
    """The input of a call to a stock linear/convolution forward (a forward pre-hook's
    ``args``/``kwargs``): the positional argument or the ``input=`` keyword."""
    return args[0] if args else kwargs["input"]


def add_to_digest(digest, batch) -> None:
    """Feed ``batch`` to ``digest`` (a ``hashlib`` object): each tensor's dtype, shape and bytes,
    other values' repr (a function's qualified name), in the batch's order."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, Tensor):
            data = leaf.detach().cpu().contiguous()
            digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        else:
            digest.update(repr(getattr(leaf, "__qualname__", leaf)).encode())


def run_batch(model: nn.Module, batch, index: Optional[int] = None) -> object:
    """``model(b)`` for a Tensor, ``model(*b)`` for a tuple/list, ``model(**b)`` for a dict
    (a :class:`~panther_lite.conversion.calibration.tokens.MaskedCall`: its batch), with the
    batch's real-token mask current for the duration (:mod:`.tokens`); ``index`` (the batch's
    position, when known) goes into the error for any other batch."""
    with token_mask(batch_token_mask(batch)):
        try:
            return _call(model, batch.batch if isinstance(batch, MaskedCall) else batch, index)
        except IndexError as error:  # an embedding's "index out of range in self"
            raise _token_error(model, batch.batch if isinstance(batch, MaskedCall) else batch, index, error) from error


def _token_error(model: nn.Module, batch, index: Optional[int], error: IndexError) -> Exception:
    """An IndexError from running ``batch``, saying which batch holds token ids past the
    model's vocabulary (its input embedding's rows) when that is why; else ``error`` itself."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    rows = getattr(embeddings, "num_embeddings", None)
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [batch]
    ids = [t for t in values if isinstance(t, Tensor) and not t.is_floating_point() and t.numel() and not t.is_meta]
    largest = max((int(t.max()) for t in ids), default=None)
    if rows is None or largest is None or largest < rows:
        return error
    where = "a calibration batch" if index is None else f"calibration batch {index}"
    return ValueError(
        f"{where} holds token id {largest}, past the model's vocabulary of {rows} tokens (its input embedding's rows): "
        "tokenize the calibration data with the model's own tokenizer"
    )


def _call(model: nn.Module, batch, index: Optional[int]) -> object:
    if batch is None:
        where = "" if index is None else f" {index}"
        raise TypeError(
            f"calibration batch{where} is None; calibration_data must hold only batches (Tensor, tuple or dict)"
        )
    if isinstance(batch, Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    raise TypeError(
        f"calibration batches must be a Tensor (model(b)), a tuple/list (model(*b)) or a dict (model(**b)), "
        f"got {type(batch).__name__}"
    )


def run_batch_or_callable(model: nn.Module, batch_or_fn, index: Optional[int] = None) -> object:
    """``fn(model)`` for a callable calibration ``fn``, else :func:`run_batch`."""
    return batch_or_fn(model) if callable(batch_or_fn) else run_batch(model, batch_or_fn, index)


@contextlib.contextmanager
def evaluation_run(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode under ``torch.no_grad()``; every module's training flag is
    restored afterwards, also on error."""
    training = {module: module.training for module in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, flag in training.items():
            module.training = flag


class CalibrationData:
    """``convert``'s ``calibration_data``, checked once: None, a callable ``fn(model)`` or an
    iterable of batches (TypeError otherwise). ``source`` is what was given; ``reiterable``
    says whether the batches can be run again (a list, a DataLoader; not a callable or a
    one-shot iterator)."""

    def __init__(self, source) -> None:
        if isinstance(source, Tensor):
            raise TypeError(
                "calibration_data must be an iterable of batches or a callable fn(model), got a single Tensor; "
                "pass e.g. [x] or x.split(256)"
            )
        if source is not None and not callable(source):
            if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
                raise TypeError(f"calibration_data must be an iterable of batches or a callable fn(model), got {source!r}")
        self.source = source
        self.reiterable = source is not None and not callable(source) and iter(source) is not source

    @property
    def given(self) -> bool:
        return self.source is not None

    def first_batch(self):
        """The first batch of re-iterable data (None when there is none)."""
        return next(iter(self.source), None)

    def check_sequential(self) -> None:
        """ValueError without calibration data; TypeError unless it is a callable or can be
        iterated more than once (what ``sequential=True`` needs)."""
        if self.source is None:
            raise ValueError("sequential=True fits each layer to calibration statistics: pass calibration_data")
        if not callable(self.source) and not self.reiterable:
            raise TypeError(
                "sequential=True runs the calibration batches twice per layer group, pairing them batch by batch: "
                "pass calibration_data as a list of batches, a DataLoader or a deterministic callable fn(model) "
                "(not a one-shot iterator)"
            )

    def runs(self) -> List[ModelRun]:
        """Each batch as a run of a model (the callable itself for a callable, one run)."""
        if callable(self.source):
            return [self.source]
        return [lambda model, batch=batch, index=index: run_batch(model, batch, index)
                for index, batch in enumerate(self.source)]

    def replay(self) -> Optional[ModelRun]:
        """What runs a model once on this data: the callable itself, or the first batch of
        re-iterable batches (None for no data, a one-shot iterator or no batch)."""
        if callable(self.source):
            return self.source
        if not self.reiterable:
            return None
        first = self.first_batch()
        return None if first is None else (lambda model: run_batch(model, first))
