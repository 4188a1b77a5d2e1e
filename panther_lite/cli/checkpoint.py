"""Reading a command's inputs: a transformers checkpoint directory (checked, and its tokenizer)
and a calibration text file turned into tokenized batches."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.nn as nn

from ..conversion.calibration.random_tokens import model_positions
from ..conversion.saving.weight_files import read_json
from ..extras import require

__all__ = ["CommandError", "check_model_dir", "load_tokenizer", "read_samples", "calibration_batches", "real_tokens"]


class CommandError(Exception):
    """Bad input to a command: its message is printed on its own, without a traceback."""


def check_model_dir(model_dir: Path) -> None:
    """Raise :class:`CommandError` unless ``model_dir`` is a directory holding a transformers
    ``config.json`` with a ``model_type``."""
    if not model_dir.is_dir():
        raise CommandError(f"MODEL_DIR {str(model_dir)!r} does not exist or is not a directory")
    config = model_dir / "config.json"
    if not config.is_file():
        raise CommandError(
            f"MODEL_DIR {str(model_dir)!r} has no config.json: not a transformers model directory "
            "(one written by save_pretrained)"
        )
    try:
        model_type = read_json(config, "a transformers config").get("model_type")
    except (ValueError, AttributeError) as error:
        raise CommandError(f"{str(config)!r} is not a JSON object: {error}") from None
    if not model_type:
        raise CommandError(f"{str(config)!r} names no model_type: not a transformers model config")


def load_tokenizer(model_dir: Path):
    """MODEL_DIR's tokenizer; :class:`CommandError` when it has none with a vocabulary."""
    AutoTokenizer = require("transformers", "the compress command").AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CommandError(f"MODEL_DIR {str(model_dir)!r} has no usable tokenizer: {error}") from None
    if len(tokenizer) <= len(tokenizer.all_special_tokens):  # transformers builds empty ones without files
        raise CommandError(f"MODEL_DIR {str(model_dir)!r} has no usable tokenizer: its vocabulary is empty")
    return tokenizer


def read_samples(path: Path, max_samples: int) -> List[str]:
    """The first ``max_samples`` non-blank lines of the text file ``path``, stripped."""
    if not path.is_file():
        raise CommandError(f"calibration file {str(path)!r} does not exist or is not a file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise CommandError(f"calibration file {str(path)!r} is not UTF-8 text: {error}") from None
    samples = [line.strip() for line in lines if line.strip()]
    if not samples:
        raise CommandError(f"calibration file {str(path)!r} has no text: expected one sample per line")
    return samples[:max_samples]


def _max_tokens(model: nn.Module, seq_len: int) -> int:
    """``seq_len`` capped at the positions the model embeds (longer inputs would fail in it)."""
    positions = model_positions(model)
    return seq_len if positions is None else min(seq_len, positions)


def calibration_batches(
    samples: List[str], tokenizer, model: nn.Module, seq_len: int, batch_size: int
) -> List[Dict[str, torch.Tensor]]:
    """Tokenized batches for ``model(**batch)``: ``input_ids`` and ``attention_mask`` of up to
    ``batch_size`` samples, each truncated to ``seq_len`` tokens (at most the model's
    positions). Samples are grouped by length, so little padding enters the calibration
    statistics; padding uses the tokenizer's pad token, else its end-of-text token, and the
    tokenizer itself is left unchanged (it is saved as it was read)."""
    max_tokens = _max_tokens(model, seq_len)
    encoded = [tokenizer(text, truncation=True, max_length=max_tokens)["input_ids"] for text in samples]
    encoded = sorted((ids for ids in encoded if ids), key=len)
    if not encoded:
        raise CommandError("the calibration text tokenizes to no tokens")
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    batches = []
    for start in range(0, len(encoded), batch_size):
        group = encoded[start:start + batch_size]
        width = max(len(ids) for ids in group)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, ids in enumerate(group):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention_mask[row, :len(ids)] = 1
        batches.append(dict(input_ids=input_ids, attention_mask=attention_mask))
    return batches


def real_tokens(batches: List[Dict[str, torch.Tensor]]) -> int:
    """The real (unpadded) tokens of ``batches``: the sum of their ``attention_mask``."""
    return sum(int(batch["attention_mask"].sum()) for batch in batches)
