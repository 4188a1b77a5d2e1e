"""A transformers checkpoint directory read part by part: its config and the class that builds
it, the name, dtype and file of every tensor (one ``model.safetensors`` or shards with their
index) read from the files' headers alone and named as the model names it
(:mod:`.checkpoint_layout`), a skeleton of the model with its parameters on the meta device, the
tensors of one part read on demand, and a fingerprint of the whole."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from ...extras import require
from .checkpoint_layout import model_sources
from .loading import parameters_on_meta
from .weight_files import SAFETENSORS_DTYPES, SHARD_INDEX_NAME, WEIGHTS_NAME, read_header, shard_paths

__all__ = ["CheckpointFiles", "auto_class_for", "SAFETENSORS_DTYPES"]

_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16  # content sampled per file for the fingerprint


def _auto_classes() -> List[type]:
    """``AutoModel`` first, then every ``AutoModelFor...`` class of the installed transformers."""
    transformers = require("transformers", "reading a transformers checkpoint")
    names = ["AutoModel"] + sorted(name for name in dir(transformers) if name.startswith("AutoModelFor"))
    return [getattr(transformers, name) for name in names]


def _builds(auto_class: type, config, architecture: str) -> bool:
    try:
        built = auto_class._model_mapping[type(config)]
    except (KeyError, ValueError):
        return False
    return architecture in {cls.__name__ for cls in (built if isinstance(built, tuple) else (built,))}


def auto_class_for(config) -> type:
    """The transformers Auto class that builds ``config.architectures[0]`` for this config
    (``AutoModelForCausalLM`` for a ``GPT2LMHeadModel``, say); ``AutoModel`` when the config
    names no architecture; the architecture's own class when no Auto class builds it."""
    transformers = require("transformers", "reading a transformers checkpoint")
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        return transformers.AutoModel
    architecture = architectures[0]
    found = next((auto for auto in _auto_classes() if _builds(auto, config, architecture)), None)
    if found is not None:
        return found
    own = getattr(transformers, architecture, None)
    if own is None:
        raise ValueError(f"config.json names architecture {architecture!r}, which this transformers cannot build")
    return own


def _weight_files(directory: Path) -> List[Path]:
    """The safetensors files holding the checkpoint's tensors (one file, or the shards its index
    names; none when it has neither, e.g. weights in PyTorch's pickle format only)."""
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME]
    index = directory / SHARD_INDEX_NAME
    if not index.is_file():
        if not any(directory.glob("pytorch_model*.bin*")):
            raise ValueError(
                f"MODEL_DIR {str(directory)!r} has no weights: neither {WEIGHTS_NAME}, {SHARD_INDEX_NAME} nor "
                "pytorch_model.bin"
            )
        return []
    return shard_paths(directory)


def _listed(names: List[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def check_placed(directory: Path, unplaced: List[str]) -> None:
    """ValueError naming the tensors of the checkpoint in ``directory`` that the model its
    config builds has no place for (``config.json`` says fewer layers or other names than the
    weights hold): converting would drop them without a word."""
    if unplaced:
        raise ValueError(
            f"MODEL_DIR {str(directory)!r} holds {len(unplaced)} tensor(s) the model its config.json builds has no "
            f"place for ({_listed(unplaced)}): they would be dropped. Check that config.json (num_hidden_layers, "
            "architectures) describes these weights, or remove those tensors"
        )


def reported_unexpected(model: nn.Module, names: Iterable[str]) -> List[str]:
    """``names`` less those transformers ignores when they are unexpected in a checkpoint
    (the model's ``_keys_to_ignore_on_load_unexpected``, rotary ``inv_freq``, ``position_ids``)."""
    patterns = {*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()), r"rotary_emb\.inv_freq",
                r"(^|\.)position_ids$"}
    ignored = re.compile("|".join(f"({pattern})" for pattern in patterns))
    return [name for name in names if ignored.search(name) is None]


class CheckpointFiles:
    """A transformers checkpoint directory: ``config`` (read with ``AutoConfig``),
    ``auto_class`` (:func:`auto_class_for`), ``files`` (its safetensors files, none when it has
    other weights), ``stored``: ``{name: (file, dtype, shape)}`` for every tensor in them, read
    from their headers, and ``tensors``: the same under the model's names (transformers' layout
    for this model type read, e.g. Mixtral's per-expert tensors as the fused experts: each
    entry then its first file tensor's; :mod:`.checkpoint_layout`); nothing else is read until
    :meth:`read` asks for some tensors. ValueError naming the file for anything unreadable."""

    def __init__(self, directory: Path) -> None:
        transformers = require("transformers", "reading a transformers checkpoint")
        self.directory = Path(directory)
        try:
            self.config = transformers.AutoConfig.from_pretrained(str(self.directory))
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"MODEL_DIR {str(self.directory)!r}: its config.json could not be read: {error}") from None
        self.auto_class = auto_class_for(self.config)
        self.files = _weight_files(self.directory)
        self.stored: Dict[str, Tuple[Path, str, Tuple[int, ...]]] = {}
        for path in self.files:
            header, _ = read_header(path)
            for name, entry in header.items():
                self.stored[name] = (path, entry.get("dtype"), tuple(entry.get("shape", ())))
        self.sources = model_sources(getattr(self.config, "model_type", ""), self.stored)
        self.tensors = {name: self.stored[source.names()[0]] for name, source in self.sources.items()}

    def default_dtype(self) -> torch.dtype:
        """The dtype ``from_pretrained(dtype="auto")`` picks: the config's, else the first
        floating-point tensor's."""
        dtype = getattr(self.config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype):
            return dtype
        floating = (SAFETENSORS_DTYPES.get(code) for _, code, _ in self.tensors.values())
        return next((d for d in floating if d is not None and d.is_floating_point), torch.get_default_dtype())

    def skeleton(self, dtype: Optional[torch.dtype] = None) -> nn.Module:
        """The model the checkpoint holds, in eval mode, built in ``dtype`` (None: :meth:`default_dtype`)
        with its parameters on the meta device (buffers its ``__init__`` computes stay real)."""
        with parameters_on_meta():
            model = self.auto_class.from_config(self.config, dtype=dtype or self.default_dtype())
        return model.eval()

    def load_whole(self, dtype: Optional[torch.dtype] = None, allow_missing: bool = False) -> Tuple[nn.Module, List[str]]:
        """``(model, random)``: the whole model, loaded by transformers in ``dtype`` (None:
        :meth:`default_dtype`), in eval mode, and the names of the tensors it initialised at
        random because the checkpoint lacks them: a ValueError naming them unless
        ``allow_missing``; tensors the model does not place are always one (:func:`check_placed`)."""
        try:
            model, info = self.auto_class.from_pretrained(str(self.directory), dtype=dtype or self.default_dtype(),
                                                          output_loading_info=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"MODEL_DIR {str(self.directory)!r}: the model could not be loaded: {error}") from None
        check_placed(self.directory, sorted(info["unexpected_keys"]))
        missing = sorted(info["missing_keys"])
        if missing and not allow_missing:
            raise ValueError(
                f"MODEL_DIR {str(self.directory)!r} lacks {len(missing)} tensor(s) the model its config.json builds "
                f"needs ({_listed(missing)}): they would be initialised at random. Check that config.json "
                "(num_hidden_layers, sizes) describes these weights and that no file is missing; or pass "
                "allow_missing_weights=True (--allow-missing-weights) to fill them at random (the report lists them)"
            )
        return model.eval(), missing

    def read(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """The tensors ``names`` (model names, all in :attr:`tensors`), each file opened once and
        closed again (its pages leave the process's memory with it)."""
        sources = {name: self.sources[name] for name in names}
        stored = self._read_stored(name for source in sources.values() for name in source.names())
        return {name: source.build(stored) for name, source in sources.items()}

    def _read_stored(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """The file tensors ``names`` (all in :attr:`stored`)."""
        safetensors = require("safetensors", "reading a transformers checkpoint")
        by_file: Dict[Path, List[str]] = {}
        for name in names:
            by_file.setdefault(self.stored[name][0], []).append(name)
        tensors = {}
        for path, wanted in by_file.items():
            try:
                with safetensors.safe_open(str(path), framework="pt", device="cpu") as file:
                    tensors.update({name: file.get_tensor(name) for name in wanted})
            except (safetensors.SafetensorError, OSError, RuntimeError, ValueError) as error:
                raise ValueError(
                    f"{str(path)!r} could not be read (changed, truncated or corrupt since it was opened?): {error}"
                ) from None
        return tensors

    def fingerprint(self) -> str:
        """A digest of the checkpoint: ``config.json``, and per weight file its size, header and
        ``16 × 64 KiB`` of its data spread over it (so two random initialisations of one
        architecture, which share their headers, differ), without reading the whole files."""
        digest = hashlib.sha256((self.directory / "config.json").read_bytes())
        for path in self.files:
            size = path.stat().st_size
            _, start = read_header(path)
            digest.update(f"{path.name}:{size}".encode())
            with open(path, "rb") as file:
                digest.update(file.read(start))
                for sample in range(_SAMPLES):
                    file.seek(start + (size - start) * sample // _SAMPLES)
                    digest.update(file.read(_SAMPLE_BYTES))
        return digest.hexdigest()
