"""Text the original causal LM writes itself, to distil on: continuations it samples from the first
tokens of the calibration samples (:func:`sampled_batches`).

Sixty-four calibration paragraphs are too few to distil a language model on: the student learns
those batches and the held-back loss stops falling long before the model is healed. The teacher's
own samples cost no data and follow its distribution, which is what the next-token KL compares
(measured on SmolLM2-135M at 0.8: ``docs/evaluation.rst``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import List, Optional

import torch
from torch import Tensor, nn

from ...nn.validation import check_int, check_positive_int
from ..progress import progress_bar

__all__ = ["InverseTransformDraw", "key_value_bytes", "sampled_batches", "sampled_together"]

# Sequences sampled together: decoding few rows at a time is per-call bound. SmolLM2-135M on 2 CPU
# cores samples 1.6 times as many sequences a second 128 at a time as 32 at a time (fp32, streamed),
# 256 at a time only 1.16 times more again; within KEY_VALUE_BYTES of cache, so a 7B model samples few.
MOST_TOGETHER = 128
KEY_VALUE_BYTES = 2**30
UNKNOWN_CACHE_TOGETHER = 32  # a config that does not say the cache's shape


def _prompts(batches: List[Mapping], prefix: int) -> List[Tensor]:
    """The first ``prefix`` real tokens of every sample in ``batches`` holding that many."""
    prompts = []
    for batch in batches:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids)).bool()
        prompts += [row[keep][:prefix] for row, keep in zip(ids, mask) if int(keep.sum()) >= prefix]
    if not prompts:
        raise ValueError(f"sampled_batches: no calibration sample holds prefix={prefix} tokens; lower prefix")
    return prompts


def key_value_bytes(teacher: nn.Module, length: int) -> Optional[int]:
    """Bytes of the key/value cache ``teacher`` holds for one sequence of ``length`` tokens, from its
    config (layers × keys and values × key/value heads × head width × the parameters' element size);
    None when the config does not name those (``num_hidden_layers``, ``num_attention_heads``, ``hidden_size``).

    Example:
        >>> import transformers
        >>> llama = transformers.LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        ...                                  num_key_value_heads=3)
        >>> with torch.device("meta"):
        ...     smollm2_shape = transformers.LlamaForCausalLM(llama)
        >>> key_value_bytes(smollm2_shape, 256)  # SmolLM2-135M in float32: 11.8 MB a sequence
        11796480
    """
    config = getattr(teacher, "config", None)
    layers, heads, width = (getattr(config, name, None) for name in ("num_hidden_layers", "num_attention_heads",
                                                                     "hidden_size"))
    if not all(isinstance(value, int) and value > 0 for value in (layers, heads, width)):
        return None
    key_value_heads = getattr(config, "num_key_value_heads", None) or heads
    head_width = getattr(config, "head_dim", None) or width // heads
    element = next(teacher.parameters()).element_size()
    return layers * 2 * key_value_heads * head_width * length * element


def sampled_together(teacher: nn.Module, length: int) -> int:
    """How many sequences of ``length`` tokens :func:`sampled_batches` samples in one ``generate``:
    as many as keep their key/value cache within :data:`KEY_VALUE_BYTES`, at most :data:`MOST_TOGETHER`
    and at least one (:data:`UNKNOWN_CACHE_TOGETHER` when :func:`key_value_bytes` cannot tell)."""
    per_sequence = key_value_bytes(teacher, length)
    if per_sequence is None:
        return UNKNOWN_CACHE_TOGETHER
    return max(1, min(MOST_TOGETHER, KEY_VALUE_BYTES // per_sequence))


class InverseTransformDraw:
    """A ``generate`` logits processor that draws each row's next token from ``softmax(scores)`` (the
    whole distribution, temperature 1) and leaves only that token finite, so greedy decoding takes
    the draw: inverse transform sampling, one uniform from ``generator`` per row against the float64
    cumulative probabilities (a token of probability 0 is never drawn).

    ``generate(do_sample=True)`` draws through ``torch.multinomial``, which spends one exponential
    variate per vocabulary entry and row: on SmolLM2-135M (49,152 words), 86 sequences sampled on
    2 CPU cores in float32 took 24 s where this took 17 s (40 new tokens), 45.7 s against 38.7 s
    (80 new tokens).

    Example:
        >>> draw = InverseTransformDraw(torch.Generator().manual_seed(0))
        >>> draw(None, torch.tensor([[0.0, -math.inf, 0.0]])).isfinite().sum().item()  # one token, never the second
        1
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, input_ids: Optional[Tensor], scores: Tensor) -> Tensor:
        cumulative = torch.softmax(scores.float(), dim=-1).double().cumsum_(dim=-1)
        uniform = torch.rand(scores.shape[0], 1, generator=self.generator, dtype=torch.float64, device=scores.device)
        drawn = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).clamp_(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(1, drawn, 0.0)


def _sampled(teacher: nn.Module, prompts: Tensor, length: int, seed: int) -> Tensor:
    """``prompts`` ``(n, prefix)`` continued to ``length`` tokens by ``teacher``, sampled at temperature
    1 from its whole distribution (:class:`InverseTransformDraw`), end-of-text suppressed; seeded by a
    generator of its own (the global one untouched)."""
    new = length - prompts.shape[1]
    draw = InverseTransformDraw(torch.Generator(device=prompts.device).manual_seed(seed))
    with torch.no_grad():
        return teacher.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                temperature=None, top_k=None, top_p=None, logits_processor=[draw],
                                max_new_tokens=new, min_new_tokens=new,
                                pad_token_id=0)  # never used: no sequence ends early


def sampled_batches(teacher: nn.Module, batches: List[Mapping], count: int, length: int, *, prefix: int = 16,
                    batch_size: int = 8, seed: int = 0, progress: Optional[bool] = None) -> List[dict]:
    """``count`` sequences of ``length`` tokens sampled from ``teacher``, each continuing the first
    ``prefix`` real tokens of a calibration sample (the samples taken in turn), as batches for
    :func:`~panther_lite.distill` and :func:`~panther_lite.teacher_outputs`.

    Args:
        teacher: the original causal LM (a transformers model with ``generate``), in memory or
            streamed (:func:`~panther_lite.conversion.pipelines.streamed_model.streamed_model`:
            every new token then reads each block once).
        batches: the calibration batches, dicts with ``input_ids`` ``(batch, seq)`` and an optional
            ``attention_mask`` (right padding).
        count, length: how many sequences, and their tokens (``length > prefix``).
        prefix: the calibration tokens each sequence starts with.
        batch_size: the sequences per returned batch.
        seed: the ``i``-th group of sequences sampled together (:func:`sampled_together`: up to 128,
            within 1 GiB of key/value cache) is drawn with seed ``seed + i``: a run repeats.
        progress: a tqdm bar over those groups (None: on a terminal only).

    Returns:
        ``ceil(count / batch_size)`` dicts ``{"input_ids": (b, length), "attention_mask": ones}`` on
        the CPU.

    Example::

        text = calibration_batches(samples, tokenizer, model, 256, 8)
        data = text + sampled_batches(teacher, text, 128, 256)
        distill(student, teacher_outputs(teacher, data), data)
    """
    if not callable(getattr(teacher, "generate", None)):
        raise TypeError(f"sampled_batches: teacher must be a causal LM with generate(), got {type(teacher).__name__}")
    count, prefix = check_positive_int("count", count), check_positive_int("prefix", prefix)
    length, batch_size = check_int("length", length, minimum=prefix + 1), check_positive_int("batch_size", batch_size)
    prompts = _prompts(list(batches), prefix)
    device = next(teacher.parameters()).device
    together = sampled_together(teacher, length)
    sequences = []
    for group, start in enumerate(progress_bar(range(0, count, together), "sampling the original", "group",
                                               progress)):
        rows = [prompts[(start + i) % len(prompts)] for i in range(min(together, count - start))]
        sequences.append(_sampled(teacher, torch.stack(rows).to(device), length, seed + group).cpu())
    ids = torch.cat(sequences)
    return [{"input_ids": part, "attention_mask": torch.ones_like(part)} for part in ids.split(batch_size)]
