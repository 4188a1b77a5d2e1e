"""Text the original causal LM writes itself, to distil on: continuations it samples from the first
tokens of the calibration samples (:func:`sampled_batches`), with its outputs on them kept from
the same forwards (:func:`sampled_with_outputs`).

Sixty-four calibration paragraphs are too few to distil a language model on: the student learns
those batches and the held-back loss stops falling long before the model is healed. The teacher's
own samples cost no data and follow its distribution, which is what the next-token KL compares
(measured on SmolLM2-135M at 0.8: ``docs/evaluation.rst``).
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ...nn.validation import check_int, check_positive_int
from ..progress import progress_bar
from .config import DistillConfig
from .objective import TopKLogProbs, top_k_log_probs

__all__ = ["InverseTransformDraw", "key_value_bytes", "sampled_batches", "sampled_together",
           "sampled_with_outputs"]

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
    """Draws each row's next token from ``softmax(scores)`` (the whole distribution, temperature 1):
    inverse transform sampling, one uniform from ``generator`` per row against the float64 cumulative
    probabilities (a token of probability 0 is never drawn).

    ``torch.multinomial`` (what ``generate(do_sample=True)`` draws with) spends one exponential variate
    per vocabulary entry and row: on SmolLM2-135M (49,152 words), 86 sequences sampled on 2 CPU cores
    in float32 took 24 s where this took 17 s (40 new tokens), 45.7 s against 38.7 s (80 new tokens).

    Example:
        >>> draw = InverseTransformDraw(torch.Generator().manual_seed(0))
        >>> draw(torch.tensor([[0.0, -math.inf, 0.0]])).item() != 1  # never the impossible token
        True
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, scores: Tensor) -> Tensor:
        """The token drawn for each row of ``scores`` (rows, vocabulary): ids (rows, 1)."""
        cumulative = torch.softmax(scores.float(), dim=-1).double().cumsum_(dim=-1)
        uniform = torch.rand(scores.shape[0], 1, generator=self.generator, dtype=torch.float64, device=scores.device)
        return torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).clamp_(max=scores.shape[-1] - 1)


def _end_of_text(teacher: nn.Module) -> List[int]:
    """The ids that end a text for ``teacher`` (its generation config's ``eos_token_id``, else its
    config's; an int or a list), which the sampled sequences never draw."""
    for config in (getattr(teacher, "generation_config", None), getattr(teacher, "config", None)):
        ids = getattr(config, "eos_token_id", None)
        if ids is not None:
            return [ids] if isinstance(ids, int) else list(ids)
    return []


def _cache_keyword(teacher: nn.Module) -> str:
    """The name ``teacher``'s forward takes its key/value cache by: ``cache`` (transformers 5.24 and
    later), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(teacher.forward).parameters else "past_key_values"


def _next_logits(teacher: nn.Module, step: Tensor, past, keyword: str):
    """The logits ``(n, tokens, vocabulary)`` (float32 at least) ``teacher`` gives ``step`` after
    the key/value cache ``past`` (passed as ``keyword``), and the cache grown by ``step``."""
    output = teacher(input_ids=step, use_cache=True, **{keyword: past})
    logits, grown = getattr(output, "logits", None), getattr(output, keyword, None)
    if not isinstance(logits, Tensor) or grown is None:
        raise TypeError(f"sampled_batches: teacher must return logits and a key/value cache (a causal LM), got "
                        f"{type(output).__name__}")
    return logits if logits.dtype == torch.float64 else logits.float(), grown


def _sampled(teacher: nn.Module, prompts: Tensor, length: int, seed: int,
             keep: Optional[Callable[[Tensor], TopKLogProbs]] = None) -> Tuple[Tensor, List[TopKLogProbs]]:
    """``prompts`` ``(n, prefix)`` continued to ``length`` tokens by ``teacher`` (one token a step,
    with its key/value cache), sampled at temperature 1 from its whole distribution
    (:class:`InverseTransformDraw`), end of text never drawn; seeded by a generator of its own
    (the global one untouched). With ``keep``, also ``keep(logits)`` of every forward, ``(n, tokens,
    …)``: together the teacher's logits at all ``length`` positions (one more step gives the last)."""
    draw = InverseTransformDraw(torch.Generator(device=prompts.device).manual_seed(seed))
    banned = torch.tensor(_end_of_text(teacher), dtype=torch.long, device=prompts.device)
    ids, step, past, kept, keyword = prompts, prompts, None, [], _cache_keyword(teacher)
    with torch.no_grad():
        for _ in range(length - prompts.shape[1] + (keep is not None)):
            logits, past = _next_logits(teacher, step, past, keyword)
            if keep is not None:
                kept.append(keep(logits))
            if ids.shape[1] < length:
                step = draw(logits[:, -1].index_fill(-1, banned[banned < logits.shape[-1]], -math.inf))
                ids = torch.cat([ids, step], dim=1)
    return ids, kept


def _sampled_groups(teacher: nn.Module, batches: List[Mapping], count: int, length: int, prefix: int, seed: int,
                    progress: Optional[bool], keep: Optional[Callable[[Tensor], TopKLogProbs]] = None,
                    ) -> Iterator[Tuple[Tensor, List[TopKLogProbs]]]:
    """:func:`_sampled` over the groups of :func:`sampled_together` sequences making ``count`` (the
    prompts taken in turn), group ``i`` with seed ``seed + i``: its ids and kept outputs, on the CPU."""
    if not callable(getattr(teacher, "generate", None)):
        raise TypeError(f"sampled_batches: teacher must be a causal LM with generate(), got {type(teacher).__name__}")
    count, prefix = check_positive_int("count", count), check_positive_int("prefix", prefix)
    length = check_int("length", length, minimum=prefix + 1)
    prompts = _prompts(list(batches), prefix)
    device = next(teacher.parameters()).device
    together = sampled_together(teacher, length)
    for group, start in enumerate(progress_bar(range(0, count, together), "sampling the original", "group",
                                               progress)):
        rows = [prompts[(start + i) % len(prompts)] for i in range(min(together, count - start))]
        ids, kept = _sampled(teacher, torch.stack(rows).to(device), length, seed + group, keep)
        yield ids.cpu(), kept


def _as_batches(ids: Tensor, batch_size: int) -> List[dict]:
    return [{"input_ids": part, "attention_mask": torch.ones_like(part)} for part in ids.split(batch_size)]


def sampled_batches(teacher: nn.Module, batches: List[Mapping], count: int, length: int, *, prefix: int = 16,
                    batch_size: int = 8, seed: int = 0, progress: Optional[bool] = None) -> List[dict]:
    """``count`` sequences of ``length`` tokens sampled from ``teacher``, each continuing the first
    ``prefix`` real tokens of a calibration sample (the samples taken in turn), as batches for
    :func:`~panther_lite.distill` and :func:`~panther_lite.teacher_outputs`.

    Args:
        teacher: the original causal LM (a transformers model with ``generate``, called with
            ``input_ids``, ``use_cache`` and its key/value cache), in memory or streamed
            (:func:`~panther_lite.conversion.pipelines.streamed_model.streamed_model`: every new
            token then reads each block once).
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
    batch_size = check_positive_int("batch_size", batch_size)
    groups = _sampled_groups(teacher, batches, count, length, prefix, seed, progress)
    return _as_batches(torch.cat([ids for ids, _ in groups]), batch_size)


def _joined(parts: Sequence[TopKLogProbs], dim: int) -> TopKLogProbs:
    """``parts`` concatenated along ``dim`` (their tails None together or tensors together)."""
    tails = [part.tail for part in parts]
    tail = None if tails[0] is None else torch.cat(tails, dim)
    return TopKLogProbs(torch.cat([part.log_probs for part in parts], dim),
                        torch.cat([part.indices for part in parts], dim), tail)


def _batch_targets(groups: List[TopKLogProbs], batch_size: int) -> List[TopKLogProbs]:
    """The ``(n, length, k)`` log-probabilities of the groups, as the targets of the batches of
    ``batch_size`` sequences: each ``(b · length, k)``, as a cache holds them."""
    every = _joined(groups, 0)
    starts = range(0, every.log_probs.shape[0], batch_size)
    return [TopKLogProbs(*(None if part is None else part[start:start + batch_size].flatten(0, 1) for part in every))
            for start in starts]


def sampled_with_outputs(teacher: nn.Module, batches: List[Mapping], count: int, length: int,
                         config: Optional[DistillConfig] = None, *, prefix: int = 16, batch_size: int = 8,
                         seed: int = 0) -> Tuple[List[dict], List[TopKLogProbs]]:
    """:func:`sampled_batches` that also keeps, from the very forwards that sample them, the
    teacher's outputs on the sequences as :func:`~panther_lite.teacher_outputs` caches them (its
    top ``config.top_k`` log-probabilities at every token, at ``config.temperature``): pass them
    as its ``known`` and the teacher runs only on the other batches (one more decoding step per
    group gives the last token's).

    The logits come from the decoding's key/value cache rather than one forward over each whole
    sequence: equal up to rounding (float32: within 1e-4 on the tested models).

    Args:
        config: a :class:`~panther_lite.DistillConfig` comparing a causal LM's logits
            (``outputs`` None or ``"logits"``, ``loss`` ``"auto"`` or ``"kl"``); its ``progress``
            shows the bar. The rest as for :func:`sampled_batches`.

    Returns:
        The batches of :func:`sampled_batches` and, for each, its
        :class:`~panther_lite.conversion.distilling.objective.TopKLogProbs` ``(b · length, k)``
        (float32 and int32 on the CPU).

    Example::

        sampled, known = sampled_with_outputs(teacher, text, 128, 256, config)
        cached = teacher_outputs(teacher, text + sampled, config, known=[None] * len(text) + known)
    """
    settings = config if config is not None else DistillConfig()
    if not isinstance(settings, DistillConfig):
        raise TypeError(f"sampled_with_outputs: config must be a DistillConfig, got {type(settings).__name__}")
    if not settings.compares_top_k_logits:
        raise ValueError("sampled_with_outputs: config must compare logits (outputs None or 'logits', loss 'auto' or "
                         f"'kl'), got outputs={settings.outputs!r}, loss={settings.loss!r}")
    batch_size = check_positive_int("batch_size", batch_size)

    def keep(logits: Tensor) -> TopKLogProbs:
        kept = top_k_log_probs(logits.flatten(0, 1), settings.top_k, settings.temperature).stored()
        return TopKLogProbs(*(None if part is None else part.unflatten(0, logits.shape[:2]) for part in kept))

    sequences, groups = [], []
    for ids, kept in _sampled_groups(teacher, batches, count, length, prefix, seed, settings.progress, keep):
        sequences.append(ids)
        groups.append(_joined(kept, 1))
    return _as_batches(torch.cat(sequences), batch_size), _batch_targets(groups, batch_size)
