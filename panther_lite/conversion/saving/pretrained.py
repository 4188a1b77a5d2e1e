"""Saving and loading converted models: the model's own files plus its conversion config.

``save_pretrained(model, directory)`` writes what the model's own library writes (Hugging Face
``save_pretrained`` with safetensors, sentence-transformers' ``save``, or a safetensors
``state_dict`` for any other module) and ``panther_lite_config.json`` with the conversion
config; for Hugging Face models also in each ``config.json`` as its ``quantization_config``
(``"quant_method": "panther_lite"``, :mod:`.hf_quantizer`), so that after ``import panther_lite``
a plain ``AutoModel*.from_pretrained`` builds the sketched layers too.

``from_pretrained(model_class_or_factory, directory, **kwargs)`` builds the dense
architecture, swaps in sketched layers of the recorded sizes and loads the weights:

- transformers classes: through the same quantizer plugin (outputs of earlier versions, which
  recorded the conversion under ``config.json``'s ``"panther_lite"``, get it passed in), so
  transformers' own loader (meta-device init, dtype, ``device_map``, tied weights) fills the
  sketched layers directly; the returned model is of the class asked for;
- sentence-transformers classes: sentence-transformers builds its modules itself, so the
  layers that were converted are built dense (initialised once), swapped, then loaded;
- any other factory: it runs with parameters on the meta device (no initialisation cost),
  then the state_dict is assigned.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Tuple, Union

import torch
import torch.nn as nn

from ...extras import require
from ..deploy.quantized import check_storable, warn_if_quantized_beside
from .hf_guard import guard_saved_configs
from .hf_registration import transformers_plugin
from .serialization import apply_conversion_config, conversion_config
from .weight_files import WEIGHTS_NAME, load_weights_file, read_weights

__all__ = ["save_pretrained", "from_pretrained", "PRETRAINED_CONFIG_NAME", "save_transformers_config"]

PRETRAINED_CONFIG_NAME = "panther_lite_config.json"
_QUANTIZATION_KEY = "quantization_config"
_FORMAT, _VERSION = "panther_lite.pretrained", 1
# where config.json recorded its conversion before the quantizer plugin (read, never written)
HF_CONFIG_KEY = "panther_lite"

_TRANSFORMERS, _SENTENCE_TRANSFORMERS, _STATE_DICT = "transformers", "sentence-transformers", "state_dict"
PathLike = Union[str, "os.PathLike[str]"]


def _loaded_class(module: str, name: str):
    """A class of an optional dependency if it has been imported, else None (never imports)."""
    return getattr(sys.modules.get(module), name, None)


def _pretrained_model_class():
    return _loaded_class("transformers.modeling_utils", "PreTrainedModel")


def _sentence_transformer_classes() -> tuple:
    base = _loaded_class("sentence_transformers.base.model", "BaseModel")
    if base is not None:
        return (base,)
    legacy = _loaded_class("sentence_transformers", "SentenceTransformer")
    return () if legacy is None else (legacy,)


def _saved_with(model: nn.Module) -> str:
    pretrained = _pretrained_model_class()
    if pretrained is not None and isinstance(model, pretrained):
        return _TRANSFORMERS
    classes = _sentence_transformer_classes()
    if classes and isinstance(model, classes):
        return _SENTENCE_TRANSFORMERS
    # everything else, PEFT models included (PEFT's own save_pretrained keeps only the adapters)
    return _STATE_DICT


def _hf_submodels(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The outermost transformers models inside ``model`` (itself included), with their names."""
    pretrained = _pretrained_model_class()
    if pretrained is None:
        return []
    found: List[Tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        inside_found = any(outer == "" or fqn.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(module, pretrained) and not inside_found:
            found.append((fqn, module))
    return found


def _relative_config(conversion: Mapping, prefix: str) -> dict:
    """The part of a conversion config under submodule ``prefix``, with names relative to it."""
    start = f"{prefix}." if prefix else ""
    inside = [entry for entry in conversion["layers"] if entry["name"].startswith(start)]
    layers = [dict(entry, name=entry["name"][len(start):]) for entry in inside]
    return dict(conversion, layers=layers)


@contextlib.contextmanager
def _recorded_in_configs(model: nn.Module, conversion: Mapping) -> Iterator[None]:
    """Set ``config.quantization_config`` (panther_lite's, :mod:`.hf_quantizer`) on each
    transformers model inside ``model`` for as long as it is being saved, then put the configs
    back as they were."""
    configs = [(sub.config, _relative_config(conversion, prefix)) for prefix, sub in _hf_submodels(model)]
    previous = [config.__dict__.get(_QUANTIZATION_KEY) for config, _ in configs]
    try:
        for config, relative in configs:
            config.quantization_config = transformers_plugin().PantherLiteConfig(conversion=relative)
        yield
    finally:
        for (config, _), old in zip(configs, previous):
            if old is None:
                config.__dict__.pop(_QUANTIZATION_KEY, None)
            else:
                config.quantization_config = old


def _check_layers_reloadable(model: nn.Module, conversion: Mapping) -> None:
    """sentence-transformers rebuilds its own modules (a ``Dense`` head, say) as dense ones, so
    only sketched layers inside its transformers model can be loaded back."""
    prefixes = [f"{prefix}." for prefix, _ in _hf_submodels(model)]
    outside = [entry["name"] for entry in conversion["layers"] if not entry["name"].startswith(tuple(prefixes))]
    if outside:
        raise ValueError(
            f"sketched layers {outside[:5]} are outside the transformers model of this sentence-transformers "
            "model and could not be loaded back: densify them first (panther_lite.densify) or exclude them"
        )


def _write_model_files(model: nn.Module, saved_with: str, directory: Path, conversion: Mapping) -> None:
    if saved_with == _STATE_DICT:
        require("safetensors.torch", "save_pretrained").save_model(model, str(directory / WEIGHTS_NAME))
        return
    save = model.save_pretrained if saved_with == _TRANSFORMERS else model.save
    with _recorded_in_configs(model, conversion):
        save(str(directory))
    guard_saved_configs(directory)


def _move_into(source: Path, target: Path) -> None:
    """Move every file under ``source`` into ``target``, replacing files of the same name and
    leaving the other files of ``target`` (a tokenizer saved there, say) in place."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        destination = target / entry.name
        if entry.is_dir():
            _move_into(entry, destination)
        else:
            os.replace(entry, destination)


def write_pretrained_record(directory: Path, saved_with: str, conversion: Mapping) -> None:
    """``panther_lite_config.json``: how the files were written and the ``conversion`` config."""
    record = dict(format=_FORMAT, version=_VERSION, saved_with=saved_with, conversion=conversion)
    (directory / PRETRAINED_CONFIG_NAME).write_text(json.dumps(record, indent=2) + "\n")


def save_transformers_config(model: nn.Module, directory: Path, conversion: Mapping) -> None:
    """:func:`save_pretrained`'s files but the weights (written apart): ``config.json`` recording
    ``conversion``, and ``panther_lite_config.json``."""
    with _recorded_in_configs(model, conversion):
        model.config.save_pretrained(str(directory))
    guard_saved_configs(directory)
    write_pretrained_record(directory, _TRANSFORMERS, conversion)


def save_pretrained(model: nn.Module, directory: PathLike) -> None:
    """Save a (converted) model so :func:`from_pretrained` rebuilds it exactly.

    Writes the model's own files (transformers ``save_pretrained`` with safetensors,
    sentence-transformers ``save``, or ``model.safetensors`` with the ``state_dict``) and
    ``panther_lite_config.json`` (the :func:`~panther_lite.conversion_config`). Everything is
    written to a temporary directory inside ``directory`` first (so nothing is written next
    to it: its parent may be read-only) and then moved into place (``directory`` is created
    if needed; files already there under other names stay), so a failure while writing
    leaves it unchanged (a directory this call created is removed again).
    Frozen layers (:func:`~panther_lite.freeze`) are recorded and rebuilt frozen. A model
    holding quantized modules beside sketched layers gets a warning: the quantizer skipped
    them (freeze before quantizing). A ``state_dict`` holding what safetensors cannot store
    (quantized modules' packed weights) is a ValueError before anything is written.

    Args:
        model: any ``nn.Module``; a PEFT model is saved whole (base and adapters) as a state_dict.
        directory: where to save.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
    directory = Path(directory)
    blocking = next((path for path in (directory, *directory.parents) if path.exists() and not path.is_dir()), None)
    if blocking is not None:
        where = "exists and is not a directory" if blocking == directory else f"is inside {str(blocking)!r}, a file"
        raise ValueError(f"directory {str(directory)!r} {where}")
    saved_with = _saved_with(model)
    conversion = conversion_config(model)
    unfrozen = [entry["name"] for entry in conversion["layers"] if not entry.get("frozen", False)]
    warn_if_quantized_beside(model, unfrozen, "save_pretrained")
    check_storable(model, "save_pretrained")
    if saved_with == _SENTENCE_TRANSFORMERS:
        _check_layers_reloadable(model, conversion)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    # staged inside the target (same filesystem for the renames; its parent may be read-only)
    staging = Path(tempfile.mkdtemp(prefix=".panther_lite_staging.", dir=directory))
    try:
        _write_model_files(model, saved_with, staging, conversion)
        write_pretrained_record(staging, saved_with, conversion)
        _move_into(staging, directory)
    except BaseException:
        if created:  # nothing of this call is left behind
            shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise ValueError(f"{str(path)!r} is not a panther_lite save (expected format {_FORMAT!r})")
    if record.get("version") != _VERSION:
        raise ValueError(
            f"{str(path)!r} was written in save format version {record.get('version')!r}; "
            f"this panther_lite reads version {_VERSION}"
        )
    if record.get("saved_with") not in (_TRANSFORMERS, _SENTENCE_TRANSFORMERS, _STATE_DICT):
        raise ValueError(f"{str(path)!r}: unknown saved_with {record.get('saved_with')!r}")
    if not isinstance(record.get("conversion"), dict):
        raise ValueError(f"{str(path)!r} has no 'conversion' dict (the conversion config save_pretrained records)")
    return directory, record


def _concrete_transformers_class(model_class: type, directory: Path) -> type:
    """``model_class`` itself, or the class an ``AutoModel...`` class picks for ``directory``."""
    pretrained = _pretrained_model_class()
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
    base = _concrete_transformers_class(model_class, directory)
    saved_as = json.loads((directory / "config.json").read_text()).get("architectures") or []
    if conversion["layers"] and saved_as and base.__name__ not in saved_as:
        # another head or base class names its layers differently: the conversion would not fit
        raise ValueError(
            f"{str(directory)!r} holds a {saved_as[0]} and {model_class.__name__} builds a {base.__name__}: "
            f"pass {saved_as[0]} (or the AutoModel class that builds it)"
        )

    config = base.config_class.from_pretrained(str(directory))
    config.__dict__.pop(HF_CONFIG_KEY, None)
    config.quantization_config = transformers_plugin().PantherLiteConfig(conversion=conversion).to_dict()
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


@contextlib.contextmanager
def _transformers_load_report_silenced() -> Iterator[None]:
    """Hide transformers' load report while sentence-transformers loads the dense layout: it
    would list every sketched tensor as unexpected and its dense weight as missing, which is
    expected here; :func:`_load_sketched_layers` checks the loading instead."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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
    classes = _sentence_transformer_classes()
    if not (classes and issubclass(model_class, classes)):
        raise TypeError(
            f"{str(directory)!r} holds a sentence-transformers model: pass its class "
            f"(e.g. SentenceTransformer), got {model_class!r}"
        )
    with _transformers_load_report_silenced():
        model = model_class(str(directory), **kwargs)
    for prefix, sub in _hf_submodels(model):
        relative = _relative_config(conversion, prefix)
        if relative["layers"] and getattr(sub, "quantization_method", None) != "panther_lite":  # plugin built
            _load_sketched_layers(sub, relative, directory)
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
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
    with _parameters_on_meta():
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

    Returns:
        the model, with the sketched layers of the saved one and all its weights.
    """
    directory, record = _read_record(directory)
    loaders = {
        _TRANSFORMERS: _load_transformers,
        _SENTENCE_TRANSFORMERS: _load_sentence_transformer,
        _STATE_DICT: _load_state_dict_file,
    }
    saved_with = record["saved_with"]
    if saved_with != _STATE_DICT and not isinstance(model_class_or_factory, type):
        raise TypeError(
            f"{str(directory)!r} holds a {saved_with} model: pass its class, got {model_class_or_factory!r}"
        )
    return loaders[saved_with](model_class_or_factory, directory, record["conversion"], kwargs)
