"""The data of a perplexity evaluation as batches of token windows: text, a text file, a token
stream or ready token batches, cut by the standard protocol (non-overlapping windows of
``seq_len`` tokens, a shorter tail dropped) and checked against the model's vocabulary."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["Windows", "token_windows"]


@dataclass
class Windows:
    """Token windows ``ids`` ``(count, length)`` (int64) and their real-token ``mask`` (bool, or
    None when every position is a token)."""

    ids: Tensor
    mask: Optional[Tensor]

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def batches(self, size: int) -> Iterator[tuple]:
        """``(first window index, ids, mask or None)`` of each batch of ``size`` windows."""
        for start in range(0, len(self), size):
            mask = None if self.mask is None else self.mask[start:start + size]
            yield start, self.ids[start:start + size], mask


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"perplexity: data {str(path)!r} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"perplexity: data {str(path)!r} is not UTF-8 text: {error}") from None


def _tokenize(text: str, tokenizer) -> Tensor:
    """The whole text as one token stream, with the tokenizer's own special tokens."""
    if tokenizer is None:
        raise ValueError("perplexity: data is text, so pass tokenizer= (the model's tokenizer)")
    if not text.strip():
        raise ValueError("perplexity: the text is empty")
    return torch.as_tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def _stream_windows(stream: Tensor, seq_len: int, what: str) -> Tensor:
    """``stream`` ``(n,)`` cut into ``n // seq_len`` windows ``(count, seq_len)``."""
    count = stream.numel() // seq_len
    if count == 0:
        hint = " (a file path? pass it as pathlib.Path)" if what == "the text" and stream.numel() < 64 else ""
        raise ValueError(
            f"perplexity: {what}{hint} has {stream.numel()} tokens, fewer than one window of seq_len={seq_len}; "
            "give more text or a smaller seq_len"
        )
    return stream[: count * seq_len].reshape(count, seq_len)


def _as_ids(tensor, what: str) -> Tensor:
    if not isinstance(tensor, Tensor) or tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"perplexity: {what} must be an integer tensor of token ids, got {_describe(tensor)}")
    return tensor.long()


def _describe(value) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__


def _dict_batches(batches: Sequence[Mapping], seq_len: Optional[int]) -> tuple:
    """Token batches ``{"input_ids": (b, t), "attention_mask": (b, t)}`` used as given, padding
    masked out; all of one length ``t`` (at most ``seq_len``)."""
    ids, masks = [], []
    for index, batch in enumerate(batches):
        if "input_ids" not in batch:
            raise ValueError(f"perplexity: data batch {index} has no 'input_ids'")
        rows = _as_ids(batch["input_ids"], f"batch {index}'s input_ids")
        rows = rows.unsqueeze(0) if rows.dim() == 1 else rows
        mask = batch.get("attention_mask")
        mask = torch.ones_like(rows, dtype=torch.bool) if mask is None else torch.as_tensor(mask).reshape(rows.shape).bool()
        ids.append(rows)
        masks.append(mask)
    lengths = {rows.shape[1] for rows in ids}
    if len(lengths) > 1:
        raise ValueError(f"perplexity: token batches of different lengths {sorted(lengths)}; pad them to one length")
    if seq_len is not None and lengths.pop() > seq_len:
        raise ValueError(f"perplexity: token batches hold {ids[0].shape[1]} tokens per row, more than seq_len={seq_len}")
    return torch.cat(ids), torch.cat(masks)


def _windows_of(data, tokenizer, seq_len: Optional[int]) -> tuple:
    """``(ids, mask or None)`` of every window the data holds (unchecked)."""
    if isinstance(data, os.PathLike):
        data = _read_text(Path(data))
    if isinstance(data, (list, tuple)) and data and all(isinstance(item, str) for item in data):
        data = "\n\n".join(data)  # documents joined as the WikiText-2 protocol joins its lines
    if isinstance(data, str):
        return _stream_windows(_tokenize(data, tokenizer), seq_len, "the text"), None
    if isinstance(data, Mapping):
        data = [data]
    if isinstance(data, (list, tuple)) and data and all(isinstance(item, Mapping) for item in data):
        ids, mask = _dict_batches(data, seq_len)
        return ids, None if bool(mask.all()) else mask
    if isinstance(data, Tensor):
        ids = _as_ids(data, "data")
        if ids.dim() == 1:
            return _stream_windows(ids, seq_len, "the token stream"), None
        if ids.dim() == 2:
            length = ids.shape[1] if seq_len is None else seq_len
            return torch.cat([_stream_windows(row, length, f"row {i} of data") for i, row in enumerate(ids)]), None
        raise ValueError(f"perplexity: token ids must be 1-D (one stream) or 2-D (rows), got shape {tuple(ids.shape)}")
    raise TypeError(
        "perplexity: data must be text (str or a list of str), a text file (pathlib.Path), token ids (a 1-D or 2-D "
        f"integer tensor) or token batches (dicts with input_ids and attention_mask), got {_describe(data)}"
    )


def token_windows(data, tokenizer, seq_len: Optional[int], vocab_size: Optional[int]) -> Windows:
    """The :class:`Windows` of ``data`` (see :func:`~panther_lite.evaluation.perplexity`), every
    token id checked to lie in ``[0, vocab_size)`` (ValueError naming the window), and the
    tokenizer's size checked against ``vocab_size`` (a tokenizer of another model)."""
    if tokenizer is not None and vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(
            f"perplexity: the tokenizer has {len(tokenizer)} tokens but the model predicts {vocab_size}: it is not "
            "this model's tokenizer"
        )
    ids, mask = _windows_of(data, tokenizer, seq_len)
    if vocab_size is not None:
        bad = ((ids < 0) | (ids >= vocab_size)) & (True if mask is None else mask)
        if bool(bad.any()):
            window = int(bad.any(dim=1).nonzero()[0])
            raise ValueError(
                f"perplexity: window {window} holds token id {int(ids[bad][0])}, outside the model's vocabulary of "
                f"{vocab_size}: the tokens were made by another tokenizer"
            )
    return Windows(ids, mask)
