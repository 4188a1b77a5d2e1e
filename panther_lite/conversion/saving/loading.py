"""``from_pretrained``: a model saved by :func:`~panther_lite.save_pretrained` rebuilt.

``from_pretrained(model_class_or_factory, directory, **kwargs)`` builds the dense
architecture, swaps in sketched layers of the recorded sizes and loads the weights:

- transformers classes: through transformers' quantizer plugin (:mod:`.hf_quantizer`; outputs
  of earlier versions, which recorded the conversion under ``config.json``'s ``"panther_lite"``,
  get it passed in), so transformers' own loader (meta-device init, dtype, ``device_map``, tied
  weights) fills the sketched layers directly; the returned model is of the class asked for;
- sentence-transformers classes: sentence-transformers builds its modules itself, so the
  layers that were converted are built dense (initialised once), swapped, then loaded;
- any other factory: it runs with parameters on the meta device (no initialisation cost),
  then the state_dict is assigned.

After ``import panther_lite`` a plain ``AutoModel*.from_pretrained`` of such a directory
builds the sketched layers too (the same plugin).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Tuple

import torch
import torch.nn as nn

from ...extras import quiet_loggers, require
from .pretrained_format import (
    FORMAT, HF_CONFIG_KEY, PRETRAINED_CONFIG_NAME, SENTENCE_TRANSFORMERS, STATE_DICT, TRANSFORMERS, VERSION, PathLike,
    hf_submodels, pretrained_model_class, relative_config, sentence_transformer_classes,
)
from .hf_registration import transformers_plugin
from .rebuilding import apply_conversion_config
from .weight_files import WEIGHTS_NAME, check_weight_files, load_weights_file, read_json, read_weights

__all__ = ["from_pretrained", "parameters_on_meta"]


def _read_record(directory: PathLike) -> Tuple[Path, dict]:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"directory {str(directory)!r} does not exist or is not a directory")
    path = directory / PRETRAINED_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} has no {PRETRAINED_CONFIG_NAME}: it was not saved by panther_lite.save_pretrained"
        )
    record = read_json(path, "a panther_lite save record")
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a panther_lite save (expected format {FORMAT!r})")
    if record.get("version") != VERSION:
        raise ValueError(
            f"{str(path)!r} was written in save format version {record.get('version')!r}; "
            f"this panther_lite reads version {VERSION}"
        )
    if record.get("saved_with") not in (TRANSFORMERS, SENTENCE_TRANSFORMERS, STATE_DICT):
        raise ValueError(f"{str(path)!r}: unknown saved_with {record.get('saved_with')!r}")
    if not isinstance(record.get("conversion"), dict):
        raise ValueError(f"{str(path)!r} has no 'conversion' dict (the conversion config save_pretrained records)")
    return directory, record


def _concrete_transformers_class(model_class: type, directory: Path) -> type:
    """``model_class`` itself, or the class an ``AutoModel...`` class picks for ``directory``."""
    pretrained = pretrained_model_class()
    if pretrained is not None and issubclass(model_class, pretrained):
        return model_class
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        raise TypeError(
            f"{str(directory)!r} holds a transformers model: pass its class (a PreTrainedModel "
            f"subclass or an AutoModel class), got {model_class!r}"
        )
    AutoConfig = require("transformers", "from_pretrained of a transformers directory").AutoConfig

    return mapping[type(AutoConfig.from_pretrained(str(directory)))]


def _load_transformers(model_class, directory: Path, conversion: Mapping, kwargs: dict) -> nn.Module:
    if "output_loading_info" in kwargs:
        raise TypeError("from_pretrained does not take output_loading_info: it checks the loading itself")
    saved = read_json(directory / "config.json", "a transformers config")  # before transformers reads it
    base = _concrete_transformers_class(model_class, directory)
    saved_as = (saved.get("architectures") if isinstance(saved, dict) else None) or []
    if conversion["layers"] and saved_as and base.__name__ not in saved_as:
        # another head or base class names its layers differently: the conversion would not fit
        raise ValueError(
            f"{str(directory)!r} holds a {saved_as[0]} and {model_class.__name__} builds a {base.__name__}: "
            f"pass {saved_as[0]} (or the AutoModel class that builds it)"
        )

    config = base.config_class.from_pretrained(str(directory))
    config.__dict__.pop(HF_CONFIG_KEY, None)
    config.quantization_config = transformers_plugin().PantherLiteConfig(conversion=conversion).to_dict()
    check_weight_files(directory)
    model, info = base.from_pretrained(str(directory), config=config, output_loading_info=True, **kwargs)
    _check_sketched_keys_loaded(conversion, info["missing_keys"], directory)
    return model


def _in_layers(key: str, layer_names) -> bool:
    """Whether the state_dict ``key`` belongs to one of the layers (a frozen layer's keys are
    its children's, ``name.0.weight``)."""
    return any(key.startswith(f"{name}.") for name in layer_names)


def _check_sketched_keys_loaded(conversion: Mapping, missing_keys, directory: Path) -> None:
    layers = {entry["name"] for entry in conversion["layers"]}
    missing = sorted(key for key in missing_keys if _in_layers(key, layers))
    if missing:
        raise ValueError(f"{str(directory)!r} lacks the weights of sketched layers: {', '.join(missing[:5])}")


def _transformers_load_report_silenced() -> contextlib.AbstractContextManager:
    """Hide transformers' load report while sentence-transformers loads the dense layout: it
    would list every sketched tensor as unexpected and its dense weight as missing, which is
    expected here; :func:`_load_sketched_layers` checks the loading instead. transformers checks
    its tensor-parallel plan whenever its loader logs at WARNING or above, and would then list
    every layer of a model without one as "not sharded": that logger is quieted too."""
    return quiet_loggers("transformers.modeling_utils", "transformers.distributed.tensor_parallel")


def _load_sketched_layers(sub: nn.Module, relative: Mapping, directory: Path) -> None:
    """Swap in the sketched layers of one transformers model loaded dense, and load them from
    the weights file(s) it was loaded from; warn about any other weight the files lack."""
    apply_conversion_config(sub, relative)
    sub.config.__dict__.pop(HF_CONFIG_KEY, None)
    names = {entry["name"] for entry in relative["layers"]}
    weights = read_weights(Path(sub.name_or_path))
    sketched = {key: value for key, value in weights.items() if _in_layers(key, names)}
    sub.load_state_dict(sketched, strict=False)
    state = sub.state_dict(keep_vars=True)
    stored = {id(tensor) for key, tensor in state.items() if key in weights}  # tied tensors are saved once
    absent = sorted(key for key, tensor in state.items() if id(tensor) not in stored)
    _check_sketched_keys_loaded(relative, absent, directory)
    if absent:
        message = f"{str(directory)!r} lacks {', '.join(absent[:5])}: these keep their initial values"
        warnings.warn(message, stacklevel=3)


def _load_sentence_transformer(model_class, directory: Path, conversion: Mapping, kwargs: dict) -> nn.Module:
    classes = sentence_transformer_classes()
    if not (classes and issubclass(model_class, classes)):
        raise TypeError(
            f"{str(directory)!r} holds a sentence-transformers model: pass its class "
            f"(e.g. SentenceTransformer), got {model_class!r}"
        )
    with _transformers_load_report_silenced():
        model = model_class(str(directory), **kwargs)
    for prefix, sub in hf_submodels(model):
        relative = relative_config(conversion, prefix)
        if relative["layers"] and getattr(sub, "quantization_method", None) != "panther_lite":  # plugin built
            _load_sketched_layers(sub, relative, directory)
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create every parameter registered inside the block on the meta device (no memory, no
    initialisation cost); buffers stay real, so those computed in ``__init__`` and not saved
    (position ids, rotary frequencies) keep their values. Same trick as accelerate's
    ``init_empty_weights(include_buffers=False)``, and like it not thread-safe: modules that
    other threads build meanwhile get meta parameters too."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a meta one may be a tie: keep the object
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _tied_parameter_names(model: nn.Module) -> List[List[str]]:
    """Groups of names that share one Parameter object (tied weights), each of two or more."""
    groups: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _assign_state_dict(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Load ``state`` into a model built on the meta device (its tensors become the model's),
    keeping tied parameters tied: safetensors stores a tied tensor once, under one of its names."""
    ties = _tied_parameter_names(model)
    for names in ties:
        stored = next((name for name in names if name in state), None)
        for name in names if stored is not None else ():
            state.setdefault(name, state[stored])
    model.load_state_dict(state, strict=True, assign=True)
    for first, *others in ties:  # assign=True made one Parameter per name: share the first
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(first))


def _load_state_dict_file(factory: Callable[..., nn.Module], directory: Path, conversion: Mapping, kwargs: dict):
    if not callable(factory):
        raise TypeError(
            f"model_class_or_factory must be a class or a callable returning an nn.Module, got {factory!r}"
        )
    path = directory / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} has no {WEIGHTS_NAME}")
    with parameters_on_meta():
        model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"the factory must return an nn.Module, got {type(model).__name__}")
    apply_conversion_config(model, conversion)
    state = load_weights_file(path)
    try:
        _assign_state_dict(model, state)
    except RuntimeError as error:  # load_state_dict's missing/unexpected keys or size mismatches
        raise ValueError(
            f"{str(path)!r} does not fit the model the factory built (another architecture or other sizes "
            f"than the saved model's): {error}"
        ) from error
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise ValueError(f"{str(path)!r} does not hold {', '.join(left[:5])}: the factory built another model")
    return model


def from_pretrained(model_class_or_factory, directory: PathLike, **kwargs) -> nn.Module:
    """Rebuild a model saved by :func:`save_pretrained`: outputs equal the saved model's.

    Args:
        model_class_or_factory: for a transformers save, the model class (``LlamaForCausalLM``)
            or an ``AutoModel...`` class; for a sentence-transformers save, its class
            (``SentenceTransformer``); otherwise a class or callable ``factory(**kwargs)``
            returning the dense model (called with its parameters on the meta device).
        directory: the directory given to :func:`save_pretrained`.
        **kwargs: passed to ``from_pretrained`` (transformers, e.g. ``dtype``), to the class
            (sentence-transformers, e.g. ``device``) or to the factory.

        Examples:
        >>> import tempfile, torch, torch.nn as nn, panther_lite
        >>> factory = lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> model = factory()
        >>> _ = panther_lite.convert(model, num_terms=1, low_rank=2, progress=False)
        >>> directory = tempfile.mkdtemp()
        >>> panther_lite.save_pretrained(model, directory)
        >>> again = panther_lite.from_pretrained(factory, directory)
        >>> x = torch.randn(3, 16)
        >>> torch.equal(again(x), model(x))
        True

    Returns:
        the model, with the sketched layers of the saved one and all its weights.
    """
    directory, record = _read_record(directory)
    loaders = {
        TRANSFORMERS: _load_transformers,
        SENTENCE_TRANSFORMERS: _load_sentence_transformer,
        STATE_DICT: _load_state_dict_file,
    }
    saved_with = record["saved_with"]
    if saved_with != STATE_DICT and not isinstance(model_class_or_factory, type):
        raise TypeError(
            f"{str(directory)!r} holds a {saved_with} model: pass its class, got {model_class_or_factory!r}"
        )
    return loaders[saved_with](model_class_or_factory, directory, record["conversion"], kwargs)
