"""Text the original causal LM writes itself, to distil on: continuations it samples from the first
tokens of the calibration samples (:func:`sampled_batches`).

Sixty-four calibration paragraphs are too few to distil a language model on: the student learns
those batches and the held-back loss stops falling long before the model is healed. The teacher's
own samples cost no data and follow its distribution, which is what the next-token KL compares
(measured on SmolLM2-135M at 0.8: ``docs/evaluation.rst``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import List, Optional

import torch
from torch import Tensor, nn

from ...nn.validation import check_int, check_positive_int
from ..progress import progress_bar

__all__ = ["sampled_batches"]

GENERATION_BATCH = 32  # sequences sampled together: decoding one row at a time is per-call bound


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


def _sampled(teacher: nn.Module, prompts: Tensor, length: int, seed: int) -> Tensor:
    """``prompts`` ``(n, prefix)`` continued to ``length`` tokens by ``teacher``, sampled at temperature
    1 from its whole distribution, end-of-text suppressed; seeded without touching the global RNG."""
    new = length - prompts.shape[1]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return teacher.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
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
        seed: sequences ``32·i …`` are drawn with seed ``seed + i``: a run repeats.
        progress: a tqdm bar over the groups of 32 sequences (None: on a terminal only).

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
    sequences = []
    for group, start in enumerate(progress_bar(range(0, count, GENERATION_BATCH), "sampling the original", "batch",
                                               progress)):
        rows = [prompts[(start + i) % len(prompts)] for i in range(min(GENERATION_BATCH, count - start))]
        sequences.append(_sampled(teacher, torch.stack(rows).to(device), length, seed + group).cpu())
    ids = torch.cat(sequences)
    return [{"input_ids": part, "attention_mask": torch.ones_like(part)} for part in ids.split(batch_size)]
