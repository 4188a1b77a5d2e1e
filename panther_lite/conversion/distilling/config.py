"""The options of a distillation: :class:`DistillConfig` (every option of
:func:`~panther_lite.distill` but the models and the data), validated once, when it is made."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from ...nn.validation import check_choice, check_int, check_positive_int
from ..config import check_holdout, check_lr
from ..fitting.autocast import check_autocast
from .objective import check_loss, check_outputs, check_temperature
from .step_budget import check_max_minutes

__all__ = ["DistillConfig", "TRAINABLE", "RANDOM_TOKEN_LENGTH", "SCHEDULES"]

TRAINABLE = ("factors", "biases", "norms")
SCHEDULES = ("cosine", "constant")
# chosen on validation text (benchmarks/validate_defaults.py): short random sequences teach each
# token's own mapping across the vocabulary, long ones a random-context mixing no text has
RANDOM_TOKEN_LENGTH = 4


def _check_train(train) -> Tuple[str, ...]:
    names = (train,) if isinstance(train, str) else train
    if not isinstance(names, Iterable):
        raise TypeError(f"distill: train must be a str or a sequence of some of {TRAINABLE}, got {train!r}")
    names = tuple(names)
    if not names or any(not isinstance(name, str) or name not in TRAINABLE for name in names):
        raise ValueError(f"distill: train must name one or more of {TRAINABLE}, got {train!r}")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class DistillConfig:
    """Every option of :func:`~panther_lite.distill` but the models and the data, validated once,
    here (TypeError / ValueError naming the option). Frozen: vary one with
    ``dataclasses.replace(config, max_steps=200)``.

    Args:
        train: what trains, one or more of ``"factors"`` (the sketched layers' ``S1``/``S2``,
            a convolution's ``S``), ``"biases"`` (their biases) and ``"norms"`` (parameters of
            modules whose class name contains ``Norm``). Everything else stays frozen.
        outputs: the output compared: None (a Tensor output, else ``logits``, else
            ``last_hidden_state``, else a tuple's first tensor), a key or attribute name, a
            tuple position, or a callable ``outputs(model_output) -> Tensor``.
        loss: ``"auto"`` (``"kl"`` for logits, ``"mse"`` otherwise), ``"kl"``
            (``T²·KL(softmax(t/T) ‖ softmax(s/T))`` per row), ``"mse"`` (``‖s − t‖²/‖t‖²`` per
            batch), or a callable ``loss(student, teacher) -> scalar Tensor``. With a 2-D
            ``attention_mask`` in a dict batch, outputs shaped ``(batch, tokens, …)`` are
            compared at the real tokens only, reduced to ``(real tokens, …)``.
        temperature: ``T`` of the ``"kl"`` loss.
        top_k: the logits kept per real token when the teacher's outputs are cached
            (:func:`~panther_lite.teacher_outputs`; a live teacher ignores it): the ``k`` most
            likely tokens' log-probabilities and the mass of the others, ``8·k + 4`` bytes a token
            instead of the whole vocabulary's ``4·vocab``.
        tokenizer: the model's tokenizer, needed with ``random_tokens``.
        random_tokens: how many sequences of ``random_token_length`` random ordinary tokens
            (:func:`~panther_lite.conversion.calibration.random_tokens.random_token_batches` with
            ``seed``, batches of 32) to add to the data, on the model's device. Those that train
            are drawn afresh for every pass over the training batches (seeds ``seed + 1``,
            ``seed + 2``, ...); those held back stay.
        random_token_length: tokens per random sequence (4 by default: on all-MiniLM-L6-v2 out
            of domain 0.765 against 0.755 with 16, in domain alike; ``benchmarks/validate_defaults.py``).
        max_steps: most optimizer steps, each on one training batch (reshuffled every pass).
        max_minutes: a time limit in minutes for the training loop, its held-back evaluations
            included (not the caching of the teacher's outputs before it); None: no limit. The
            steps are timed and only as many taken as fit (planned at the end of the warm-up and
            after every evaluation), so the schedule still ends at the last step taken; a machine
            fast enough takes all ``max_steps``. The steps taken then depend on the machine's
            speed (:mod:`~panther_lite.conversion.distilling.step_budget`).
        lr: Adam's peak learning rate, reached after a linear warm-up over the first 5% of
            ``max_steps`` (Adam's first steps move every entry by about ``lr``).
        schedule: after the warm-up, ``"cosine"`` decays the rate to 0 at ``max_steps`` (or the
            last step ``max_minutes`` leaves); ``"constant"`` keeps it.
        holdout: fraction in (0, 1) of the batches held back (at least one, at most all but one).
        patience: stop after this many evaluations without a better held-back loss, counted
            from the end of the warm-up.
        eval_every: steps between evaluations (None: one pass over the training batches).
        seed: the order of the training batches and the random tokens.
        autocast: the dtype the student's forwards and backwards run in, under ``torch.autocast``
            on its device: ``"bfloat16"``, ``"float16"`` (or the torch dtypes), ``"auto"``
            (bfloat16 where the device computes it natively: a GPU of compute capability 8.0 or
            later, a CPU with AVX512-BF16 or AMX; float32 elsewhere), or None (float32). The
            parameters, their gradients and Adam's state stay in float32 and the loss is taken
            in float32; float16 scales the loss (``torch.amp.GradScaler``) so that small
            gradients are not flushed to zero. On a CPU with AVX512-BF16, SmolLM2-135M's forward
            and backward run 2.4x faster in bfloat16, a whole distillation step 1.4x
            (:mod:`~panther_lite.conversion.fitting.autocast`).
        progress: a tqdm bar over the steps (None: on a terminal only).

    Examples:
        >>> config = DistillConfig(max_steps=200, train="factors")
        >>> config.train, config.lr
        (('factors',), 0.001)
    """

    train: Sequence[str] = ("factors", "biases")
    outputs: Any = None
    loss: Any = "auto"
    temperature: float = 1.0
    top_k: int = 64
    tokenizer: Any = None
    random_tokens: int = 0
    random_token_length: int = RANDOM_TOKEN_LENGTH
    max_steps: int = 1000
    max_minutes: Optional[float] = None
    lr: float = 1e-3
    schedule: str = "cosine"
    holdout: float = 0.25
    patience: int = 10
    eval_every: Optional[int] = None
    seed: int = 0
    autocast: Any = None
    progress: Optional[bool] = None

    def __post_init__(self) -> None:
        def set_field(name: str, value) -> None:
            object.__setattr__(self, name, value)  # the dataclass is frozen

        set_field("train", _check_train(self.train))
        set_field("outputs", check_outputs(self.outputs))
        set_field("loss", check_loss(self.loss))
        set_field("temperature", check_temperature(self.temperature))
        set_field("top_k", check_positive_int("top_k", self.top_k))
        set_field("random_tokens", check_int("random_tokens", self.random_tokens, minimum=0))
        set_field("random_token_length", check_positive_int("random_token_length", self.random_token_length))
        if self.random_tokens and self.tokenizer is None:
            raise ValueError(f"distill: random_tokens={self.random_tokens} needs tokenizer= (the model's tokenizer)")
        set_field("max_steps", check_positive_int("max_steps", self.max_steps))
        set_field("max_minutes", check_max_minutes(self.max_minutes))
        set_field("lr", check_lr(self.lr, "distill: "))
        set_field("schedule", check_choice("schedule", self.schedule, SCHEDULES))
        set_field("holdout", check_holdout(self.holdout, "distill: "))
        set_field("patience", check_positive_int("patience", self.patience))
        if self.eval_every is not None:
            set_field("eval_every", check_positive_int("eval_every", self.eval_every))
        set_field("seed", check_int("seed", self.seed, minimum=0))
        set_field("autocast", check_autocast(self.autocast, "distill"))

    @property
    def compares_top_k_logits(self) -> bool:
        """Whether a cache under these settings keeps a causal LM's logits as their top ``k``
        log-probabilities: ``outputs`` None or ``"logits"`` and ``loss`` ``"auto"`` or ``"kl"``."""
        return self.outputs in (None, "logits") and self.loss in ("auto", "kl")
