"""Perplexity of a causal language model by the standard protocol: the data cut into
non-overlapping windows of ``seq_len`` tokens, each token after a window's first predicted from
the tokens before it in its window, and ``exp`` of the mean negative log-likelihood of every
predicted token (padding never counted). The model is in memory, or a checkpoint directory
streamed block by block (:mod:`.streamed`)."""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..conversion.calibration.batches import evaluation_run
from ..conversion.progress import progress_bar
from ..nn.validation import check_positive_int
from ..conversion.pipelines.streamed_model import streamed_model
from .windows import Windows, token_windows

__all__ = ["perplexity", "Perplexity", "DEFAULT_MAX_SEQ_LEN", "BATCH_TOKENS"]

DEFAULT_MAX_SEQ_LEN = 2048  # seq_len=None: the model's positions, at most this (the usual LLM protocol)
BATCH_TOKENS = 4096  # batch_size=None: windows per call making about this many tokens (logits stay small)
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


class Perplexity(float):
    """The perplexity (a float), with what it was measured on: ``nll`` (mean negative
    log-likelihood in nats), ``tokens`` (predicted tokens counted), ``windows`` and ``seq_len``."""

    nll: float
    tokens: int
    windows: int
    seq_len: int

    def __new__(cls, nll: float, tokens: int, windows: int, seq_len: int) -> "Perplexity":
        value = super().__new__(cls, math.exp(nll))
        value.nll, value.tokens, value.windows, value.seq_len = nll, tokens, windows, seq_len
        return value


def _config(model: nn.Module):
    return getattr(model, "config", None)


def _positions(model: nn.Module) -> Optional[int]:
    config = _config(model)
    return next((getattr(config, name) for name in _POSITION_FIELDS if isinstance(getattr(config, name, None), int)), None)


def _vocab_size(model: nn.Module) -> Optional[int]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "out_features"):
        return head.out_features
    size = getattr(_config(model), "vocab_size", None)
    return size if isinstance(size, int) else None


def _check_causal_lm(model: nn.Module) -> None:
    """ValueError for a transformers model that is not a causal language model (no head, an
    encoder, a masked or sequence-to-sequence model)."""
    config = _config(model)
    if config is None or not hasattr(model, "get_output_embeddings"):
        return  # a plain module: its output is checked when it runs
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = {name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
              for name in ((names,) if isinstance(names, str) else names)}
    if model.get_output_embeddings() is None or type(model).__name__ not in causal:
        raise ValueError(
            f"perplexity: {type(model).__name__} is not a causal language model (no next-token head); load the "
            "checkpoint with AutoModelForCausalLM"
        )


def _is_stream(data) -> bool:
    """Whether ``data`` is one token stream to cut into windows (text, a file, 1-D ids)."""
    texts = isinstance(data, (list, tuple)) and all(isinstance(item, str) for item in data)
    return isinstance(data, (str, os.PathLike)) or texts or isinstance(data, Tensor) and data.dim() == 1


def _seq_len(model: nn.Module, seq_len: Optional[int], data) -> Optional[int]:
    """The window length: ``seq_len`` checked against the model's positions, or by default the
    positions capped at :data:`DEFAULT_MAX_SEQ_LEN` (None for token rows used as given)."""
    positions = _positions(model)
    if seq_len is not None:
        seq_len = check_positive_int("seq_len", seq_len)
        if seq_len < 2:
            raise ValueError("perplexity: seq_len must be at least 2 (a window's first token is not predicted)")
        if positions is not None and seq_len > positions:
            raise ValueError(f"perplexity: seq_len={seq_len} is beyond the model's {positions} positions")
        return seq_len
    if not _is_stream(data):
        return None
    if positions is None:
        raise ValueError("perplexity: the model states no number of positions: pass seq_len")
    return min(positions, DEFAULT_MAX_SEQ_LEN)


def _logits(model: nn.Module, ids: Tensor, mask: Optional[Tensor]) -> Tensor:
    if _config(model) is not None:
        output = model(input_ids=ids, attention_mask=mask, use_cache=False)
    else:
        output = model(ids)
    logits = getattr(output, "logits", output)
    if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != ids.shape:
        raise ValueError(
            f"perplexity: {type(model).__name__} has no language-model head: expected logits of shape "
            f"(batch, seq, vocab) for input {tuple(ids.shape)}, got {_shape(logits)}"
        )
    return logits


def _shape(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def _batch_nll(model: nn.Module, ids: Tensor, mask: Optional[Tensor], first: int) -> Tuple[float, int]:
    """The summed negative log-likelihood (float64) of the batch's predicted real tokens and their count."""
    logits = _logits(model, ids, mask)
    counted = torch.ones_like(ids[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:] & mask[:, :-1]
    total, count = 0.0, 0
    for row in range(ids.shape[0]):  # one row at a time: float32 logits of a whole batch can be large
        nll = F.cross_entropy(logits[row, :-1].float(), ids[row, 1:].to(logits.device), reduction="none")
        nll = nll[counted[row].to(nll.device)]
        if not bool(torch.isfinite(nll).all()):
            raise ValueError(
                f"perplexity: the model's logits are NaN or infinite in window {first + row} (check the model's "
                "weights and dtype: float16 overflows are a common cause)"
            )
        total, count = total + float(nll.double().sum()), count + nll.numel()
    return total, count


@contextlib.contextmanager
def _model_of(model, dtype) -> Iterator[nn.Module]:
    """``model`` itself, or the checkpoint directory it names streamed block by block."""
    if isinstance(model, (str, os.PathLike)):
        if not Path(model).is_dir():
            raise FileNotFoundError(f"perplexity: model {str(model)!r} is neither an nn.Module nor a directory")
        with streamed_model(model, dtype) as streamed:
            yield streamed
    elif isinstance(model, nn.Module):
        yield model
    else:
        raise TypeError(f"perplexity: model must be an nn.Module or a checkpoint directory, got {type(model).__name__}")


def _tokenizer_for(model, tokenizer):
    """The tokenizer given, else a checkpoint directory's own (its text needs one)."""
    if tokenizer is None and isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model))
    return tokenizer


def _mean_nll(model: nn.Module, windows: Windows, batch_size: Optional[int], progress) -> Tuple[float, int]:
    """The mean negative log-likelihood of every predicted token of ``windows`` and their count."""
    total, count = 0.0, 0
    size = batch_size or max(1, BATCH_TOKENS // windows.length)
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    bar = progress_bar(windows.batches(size), "perplexity", "batch", progress, total=-(-len(windows) // size))
    with evaluation_run(model):
        for first, ids, mask in bar:
            nll, tokens = _batch_nll(model, ids.to(device), None if mask is None else mask.to(device), first)
            total, count = total + nll, count + tokens
    if count == 0:
        raise ValueError("perplexity: the data holds no token to predict (each window needs two real tokens)")
    return total / count, count


def perplexity(
    model, data, *, tokenizer=None, seq_len: Optional[int] = None, batch_size: Optional[int] = None,
    dtype: Optional[torch.dtype] = None, progress: Optional[bool] = None,
) -> Perplexity:
    """The perplexity of causal language model ``model`` on ``data``, by the standard protocol.

    Args:
        model: a causal LM (``AutoModelForCausalLM``, or any module returning logits
            ``(batch, seq, vocab)`` or an output with ``.logits``), or the directory of a
            transformers checkpoint or panther_lite output: then it is streamed, one block in
            memory at a time (never loaded whole), in ``dtype`` (None: the checkpoint's).
        data: text (a ``str``, or a list of documents joined by blank lines), a text file
            (``pathlib.Path``), token ids (1-D: one stream; 2-D: each row its own stream) or
            token batches (dicts with ``input_ids`` and ``attention_mask``, used as given:
            padded positions are never predicted nor counted).
        tokenizer: the model's tokenizer, for text (a directory's own by default); text is
            tokenized whole, with the tokenizer's own special tokens.
        seq_len: tokens per window; streams are cut into ``n // seq_len`` non-overlapping
            windows (a shorter tail is dropped). None: the model's positions, at most
            :data:`DEFAULT_MAX_SEQ_LEN` (2-D ids and token batches: their rows as given).
        batch_size: windows per forward call (None: as many as make about
            :data:`BATCH_TOKENS` tokens; a streamed model reads each block once per call).
        progress: a tqdm bar over the batches (None: on a terminal only).

    Returns:
        A :class:`Perplexity`: ``exp`` of the mean negative log-likelihood of every predicted
        token (a float), with ``nll``, ``tokens``, ``windows`` and ``seq_len``.

    Raises:
        ValueError naming the problem, the model untouched: empty text or shorter than one
        window, ``seq_len`` beyond the model's positions, a model without a language-model
        head, a tokenizer or token ids not of the model's vocabulary, NaN or infinite logits.

    Examples:
        >>> import torch, transformers, panther_lite
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> tokens = torch.randint(64, (1000,), generator=torch.Generator().manual_seed(0))
        >>> ppl = panther_lite.perplexity(model, tokens, seq_len=64, progress=False)
        >>> ppl.windows, ppl.tokens                 # 15 windows of 64, 63 predictions each
        (15, 945)
        >>> 40 < ppl < 90                           # random weights on random tokens: about the vocabulary
        True

        A directory is streamed (``panther_lite.perplexity("OUT_DIR", pathlib.Path("test.txt"))``),
        text needs the tokenizer (``tokenizer=``, a directory's own by default).
    """
    if batch_size is not None:
        batch_size = check_positive_int("batch_size", batch_size)
    tokenizer = _tokenizer_for(model, tokenizer)
    with _model_of(model, dtype) as module:
        _check_causal_lm(module)
        length = _seq_len(module, seq_len, data)
        windows = token_windows(data, tokenizer, length, _vocab_size(module))
        nll, tokens = _mean_nll(module, windows, batch_size, progress)
    return Perplexity(nll, tokens, len(windows), windows.length)
