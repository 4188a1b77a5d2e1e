"""Teacher outputs cached for distillation: :func:`teacher_outputs` runs the teacher (a model, or a
checkpoint directory streamed block by block) once over the batches and keeps what
:func:`~panther_lite.distill` compares (a language model's logits as their top ``k`` log-probabilities
at the real tokens), so the student later trains without the teacher in memory.

Memory: for logits of shape (batch, tokens, vocabulary) under the ``"kl"`` loss, ``8·k + 4`` bytes
per real token (float32 log-probabilities, int32 token ids, the float32 log of the mass left),
instead of ``4·vocabulary`` (SmolLM2's 49,152-token vocabulary: 516 bytes against 196,608 at
``k = 64``); padding (``attention_mask`` 0) is never stored. Any other compared output (hidden
states under ``"mse"``, a callable loss) is kept whole, on the CPU.

Temperature: the top-``k`` log-probabilities are those of ``softmax(t/T)`` at the ``temperature``
the cache is built with (over the whole vocabulary), so a cache serves that ``T`` only; a
distillation at another ``T`` (or with other ``outputs`` or ``loss``) is refused.

Random tokens: with ``random_tokens=N`` the random-token batches are drawn once, here (seed
``seed``), and their teacher outputs cached with the rest; :func:`~panther_lite.distill` adds
them to its data and keeps them for every pass (a live teacher draws the training ones afresh
each pass instead).

Across processes (``torchrun``): each process caches its own share, batch ``i`` on process
``i % world`` (the batches :func:`~panther_lite.distill` runs there), so the teacher's passes split
over the processes and each holds about ``1/world`` of the cache.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from ..pipelines.streamed_model import streamed_model
from ..calibration.batches import add_to_digest, evaluation_run, run_batch
from ..calibration.tokens import batch_token_mask
from ..config import configured
from ..pipelines.blocks import without_kv_cache
from ..process_groups.distillation import batch_owner, share_of
from ..process_groups.run import resolve_run
from ..progress import progress_bar
from .config import DistillConfig
from .objective import TopKLogProbs, at_real_tokens, select_output, top_k_log_probs
from .run import RandomTokens, data_batches, device_of, on_device

__all__ = ["TeacherOutputs", "teacher_outputs"]

Target = Union[Tensor, TopKLogProbs]
_MATCHED = ("outputs", "loss", "temperature")  # the settings a cache is built for


def _digest(batch) -> str:
    digest = hashlib.sha256()
    add_to_digest(digest, batch)
    return digest.hexdigest()


@dataclass(frozen=True)
class TeacherOutputs:
    """The teacher's outputs on a list of batches, made by :func:`teacher_outputs`; pass it as
    ``teacher`` to :func:`~panther_lite.distill` with the same batches.

    ``targets``: one per batch (the data's, then the random-token ones), on the CPU: a
    :class:`~panther_lite.conversion.distilling.objective.TopKLogProbs` of the logits at the real
    tokens (log-probabilities (rows, k) float32, token ids (rows, k) int32, tail (rows,) float32)
    under the ``"kl"`` loss, else the compared output whole; ``digests``: the sha256 of each data
    batch (what :meth:`check` compares); ``random_batches``: the random-token batches (dicts on
    the CPU); ``settings``: the :class:`~panther_lite.DistillConfig` it was built with;
    ``share``: ``(rank, world)`` of the process that cached it (``(0, 1)``: every batch; else the
    targets of batches ``i`` with ``i % world != rank`` are None, cached by the other processes).
    """

    targets: Tuple[Optional[Target], ...]
    digests: Tuple[str, ...]
    random_batches: Tuple[dict, ...]
    settings: DistillConfig
    share: Tuple[int, int] = (0, 1)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def nbytes(self) -> int:
        """The bytes the cached outputs hold."""
        tensors = [t for target in self.targets for t in (target if isinstance(target, tuple) else (target,))]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def target(self, index: int, batch) -> Target:
        """The cached output of batch ``index`` (a :data:`~.run.Targets`)."""
        return self.targets[index]

    def check(self, settings: DistillConfig, batches: list) -> None:
        """ValueError unless ``settings`` compare what was cached (the same ``outputs``, ``loss``
        and ``temperature``; ``random_tokens`` 0 or the number cached) and ``batches`` are the
        data batches it was built on (the same count, each with the same tensors)."""
        for name in _MATCHED:
            given, cached = getattr(settings, name), getattr(self.settings, name)
            if given != cached:
                raise ValueError(f"distill: {name}={given!r}, but the teacher's outputs were cached with {name}="
                                 f"{cached!r}; build them again with teacher_outputs(..., {name}={given!r})")
        count = self.settings.random_tokens
        if settings.random_tokens not in (0, count):
            raise ValueError(f"distill: random_tokens={settings.random_tokens}, but the teacher's outputs hold {count} "
                             f"random-token sequences (drawn once, when cached); build them with "
                             f"teacher_outputs(..., random_tokens={settings.random_tokens}, tokenizer=...)")
        if len(batches) != len(self.digests):
            raise ValueError(f"distill: data holds {len(batches)} batches, but the teacher's outputs were cached for "
                             f"{len(self.digests)}; pass the batches given to teacher_outputs")
        for index, (batch, digest) in enumerate(zip(batches, self.digests)):
            if _digest(batch) != digest:
                raise ValueError(f"distill: data batch {index} is not the batch teacher_outputs ran (its tensors' "
                                 "dtypes, shapes or values differ); pass the batches given to teacher_outputs")


def _kept(batch, output, name: Optional[str], settings: DistillConfig) -> Target:
    """What is cached of the teacher's selected ``output`` on ``batch``, on the CPU."""
    if settings.loss == "kl" or (settings.loss == "auto" and name == "logits"):
        rows = at_real_tokens(batch, output).reshape(-1, output.shape[-1])
        return top_k_log_probs(rows, settings.top_k, settings.temperature).stored()
    return output.detach().cpu()


def _checked_known(known, batches: list, settings: DistillConfig) -> list:
    """``known`` (None, or a target or None per data batch) as a list as long as ``batches``, each
    target the top-``k`` log-probabilities of its batch's real tokens (ValueError naming ``known``)."""
    if known is None:
        return [None] * len(batches)
    known = list(known)
    if len(known) != len(batches):
        raise ValueError(f"teacher_outputs: known holds {len(known)} targets for {len(batches)} data batches; "
                         "give one per batch (None where the teacher is to run)")
    for index, (target, batch) in enumerate(zip(known, batches)):
        if target is None:
            continue
        tokens = _real_token_count(batch)
        if tokens is None:
            raise ValueError(f"teacher_outputs: known[{index}] is given, but data batch {index} is not a dict with "
                             "input_ids (known targets are a causal LM's, kept while it samples)")
        if not isinstance(target, TopKLogProbs) or target.log_probs.shape != (tokens, target.log_probs.shape[-1]):
            raise ValueError(f"teacher_outputs: known[{index}] must be the TopKLogProbs of the {tokens} real tokens of "
                             f"data batch {index} (as sampled_with_outputs makes), got {_described(target)}")
        kept = target.log_probs.shape[-1]
        whole_vocabulary = target.tail is None and kept < settings.top_k
        if not settings.compares_top_k_logits or not (kept == settings.top_k or whole_vocabulary):
            raise ValueError(f"teacher_outputs: known[{index}] keeps the top {kept} log-probabilities of logits, but "
                             f"outputs={settings.outputs!r}, loss={settings.loss!r}, top_k={settings.top_k} are asked for")
    return known


def _real_token_count(batch) -> Optional[int]:
    """The real tokens of a dict batch (its ``attention_mask``'s ones, else all its ``input_ids``); None for another batch."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
        return None
    mask = batch_token_mask(batch)
    return batch["input_ids"].numel() if mask is None else int(mask.sum())


def _described(target) -> str:
    """What ``target`` is, for an error message."""
    if isinstance(target, TopKLogProbs):
        return f"TopKLogProbs of shape {tuple(target.log_probs.shape)}"
    return type(target).__name__


def _run(model: nn.Module, batches: list, settings: DistillConfig, owned: Callable[[int], bool], known: list) -> list:
    """The cached output of each ``owned`` batch (its ``known`` one where given; None for the batches not
    owned): ``model`` in eval mode, no grad, no key/value cache."""
    targets = []
    with evaluation_run(model), without_kv_cache(model):
        for index, batch in enumerate(progress_bar(batches, "caching the teacher's outputs", "batch", settings.progress)):
            if not owned(index) or known[index] is not None:
                targets.append(known[index] if owned(index) else None)
                continue
            output, name = select_output(run_batch(model, batch, index), settings.outputs, "teacher")
            targets.append(_kept(batch, output, name, settings))
    return targets


def teacher_outputs(teacher, data, config: Optional[DistillConfig] = None, *, dtype: Optional[torch.dtype] = None,
                    process_group=None, known: Optional[Sequence[Optional[Target]]] = None,
                    **overrides) -> TeacherOutputs:
    """Run ``teacher`` once over ``data`` and keep what :func:`~panther_lite.distill` compares, so
    it can train the student against the result (``distill(model, cached, data, ...)``) without
    the teacher in memory (memory, temperature and random tokens: see
    :mod:`panther_lite.conversion.distilling.teacher_cache`).

    Args:
        teacher: the original model (run in eval mode under ``no_grad``; left as it was), or a
            transformers checkpoint directory (``save_pretrained``), run streamed block by block
            (:func:`~panther_lite.conversion.pipelines.streamed_model.streamed_model`), never whole in memory.
        data: the batches ``distill`` will get (a list, as for ``distill``), on the teacher's
            device (the CPU for a directory).
        config: a :class:`~panther_lite.DistillConfig` (None: its defaults), the one ``distill``
            will get: its ``outputs``, ``loss``, ``temperature``, ``top_k``, ``random_tokens``
            (with ``tokenizer``, ``random_token_length`` and ``seed``) and ``progress`` apply.
        dtype: the dtype a directory is loaded in (None: the checkpoint's).
        process_group: as for ``distill`` (None: the default group when ``torch.distributed`` is
            initialised): every process passes all the batches and caches its share.
        known: per data batch, its target already computed (the teacher's top-``k``
            log-probabilities at every real token, as
            :func:`~panther_lite.conversion.distilling.sampled_with_outputs` keeps them while it
            samples), or None where the teacher is to run; None: it runs on every batch.
        **overrides: :class:`~panther_lite.DistillConfig` fields replacing the ``config``'s.

    Returns:
        :class:`TeacherOutputs`: per batch, shapes (rows, top_k) for logits at the ``rows`` real
        tokens, else the output's own shape.

    Examples:
        >>> import copy, torch, transformers, panther_lite
        >>> config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> teacher = transformers.LlamaForCausalLM(config).eval()
        >>> batches = [dict(input_ids=torch.randint(0, 100, (2, 8))) for _ in range(4)]
        >>> cached = panther_lite.teacher_outputs(teacher, batches, top_k=8, progress=False)
        >>> tuple(cached.targets[0].indices.shape), cached.nbytes  # 8·8 + 4 bytes for each of 64 tokens
        ((16, 8), 4352)
        >>> model = copy.deepcopy(teacher)
        >>> _ = panther_lite.convert(model, param_ratio=0.5, calibration_data=batches, progress=False)
        >>> result = panther_lite.distill(model, cached, batches, max_steps=4, progress=False)
        >>> result.loss_after <= result.loss_before
        True

    Raises:
        TypeError / ValueError naming the argument: a teacher that is neither an ``nn.Module`` nor
        a directory, ``dtype`` with a module, bad batches or settings, a directory that cannot be
        streamed.
    """
    settings = configured(DistillConfig, config, overrides, caller="teacher_outputs")
    batches, run = data_batches(data), resolve_run(process_group)
    known = _checked_known(known, batches, settings)
    if isinstance(teacher, (str, os.PathLike)):
        running = streamed_model(teacher, dtype)
    elif isinstance(teacher, nn.Module):
        if dtype is not None:
            raise TypeError("teacher_outputs: dtype= is for a checkpoint directory; convert a module with .to(dtype)")
        running = contextlib.nullcontext(teacher)
    else:
        raise TypeError(f"teacher_outputs: teacher must be an nn.Module or a checkpoint directory (str or os.PathLike), "
                        f"got {type(teacher).__name__}")
    with running as model:
        random = RandomTokens(settings.tokenizer, settings.random_tokens, settings.random_token_length, settings.seed,
                              device_of(model)).draw(0)
        owned = batch_owner(run, batches + random, "teacher_outputs")
        targets = _run(model, batches + random, settings, owned, known + [None] * len(random))
    cpu = torch.device("cpu")
    return TeacherOutputs(tuple(targets), tuple(_digest(batch) for batch in batches),
                          tuple(on_device(batch, cpu) for batch in random), settings, share_of(run))
