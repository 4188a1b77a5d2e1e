"""Checkpoints for measuring the command at scale: a transformers checkpoint of random weights
written shard by shard (one shard per block, never the whole model in memory, so a 7B-shaped one
is written on a machine that could not hold it), with a word-level tokenizer over a text file."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List

import torch

from ..conversion.saving.shards import shard_name
from ..conversion.saving.weight_files import SHARD_INDEX_NAME
from ..extras import require

__all__ = ["write_random_checkpoint", "word_tokenizer"]

_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def word_tokenizer(text: str):
    """A word-level ``PreTrainedTokenizerFast`` over the words of ``text`` (lower-cased,
    punctuation split off), with ``<unk>``/``<s>``/``</s>``/``<pad>``."""
    transformers = require("transformers", "word_tokenizer")
    tokenizers = require("tokenizers", "word_tokenizer")
    words = sorted(set(re.findall(r"\w+|[^\w\s]", text.lower())))
    vocabulary = {token: index for index, token in enumerate(_SPECIAL + words)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.normalizer = tokenizers.normalizers.Lowercase()
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")


def _parts(names: List[str], blocks: str) -> List[List[str]]:
    """The tensor names grouped by shard: everything outside the block list, then each block."""
    outside = [name for name in names if not name.startswith(blocks + ".")]
    by_block: Dict[int, List[str]] = {}
    for name in names:
        if name.startswith(blocks + "."):
            by_block.setdefault(int(name[len(blocks) + 1:].split(".", 1)[0]), []).append(name)
    return [outside, *(by_block[index] for index in sorted(by_block))]


def write_random_checkpoint(directory: Path, config, text: str, *, blocks: str = "model.layers", seed: int = 0) -> int:
    """Write a causal LM of ``config`` (its ``dtype``) with random weights to ``directory``:
    ``config.json``, one safetensors shard for what lies outside ``blocks`` and one per block
    (matrices ``N(0, initializer_range²)``, vectors ones), their index, and
    :func:`word_tokenizer` of ``text``. Each shard is made, written and freed before the next.
    Returns the bytes of the weights."""
    transformers = require("transformers", "write_random_checkpoint")
    save_file = require("safetensors.torch", "write_random_checkpoint").save_file
    directory.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    shapes = {name: (param.shape, param.dtype) for name, param in model.named_parameters()}
    generator, std = torch.Generator().manual_seed(seed), getattr(config, "initializer_range", 0.02)
    parts, weight_map, total = _parts(list(shapes), blocks), {}, 0
    for index, names in enumerate(parts):
        tensors = {}
        for name in names:
            shape, dtype = shapes[name]
            values = torch.randn(shape, generator=generator) * std if len(shape) > 1 else torch.ones(shape)
            tensors[name] = values.to(dtype)
        shard = shard_name(index, len(parts))
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SHARD_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(directory))
    word_tokenizer(text).save_pretrained(str(directory))
    return total
