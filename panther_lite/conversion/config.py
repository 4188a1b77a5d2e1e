"""The options of a conversion: :class:`ConvertConfig` (every option of ``convert`` but the model
and the data), :class:`RefineConfig` and the size request, each validated once, when the config
is made; and how ``convert``'s keyword overrides become a config."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..nn.layer_base import INITS
from ..nn.low_rank_fit import FIT_METHODS
from ..nn.rank_selection import resolve_rank_multiple
from ..nn.validation import check_bool, check_choice, check_positive_int
from ..sketch.random import check_seed
from .size_request import RankSpec, SizeRequest, compile_regex, parse_sizes

__all__ = ["ConvertConfig", "RefineConfig", "SizeRequest", "RankSpec", "ALLOCATIONS", "make_config", "device_problem"]

ModuleSelector = Union[str, Sequence[str], None]
ModuleFilter = Callable[[nn.Module, str], bool]
ALLOCATIONS = ("uniform", "global")
SENSITIVITY_METRICS = ("auto", "kl", "norm")


def cache_device(calibration_device: Optional[torch.device]) -> torch.device:
    """Where cached block inputs and outputs live: the calibration device, else the CPU."""
    return calibration_device or torch.device("cpu")


def check_selector(name: str, spec: ModuleSelector) -> None:
    """TypeError/ValueError unless ``spec`` is None, a valid regex or a list of names."""
    if spec is None:
        return
    if isinstance(spec, str):
        compile_regex(name, spec)
        return
    if isinstance(spec, (list, tuple, set, frozenset)) and all(isinstance(entry, str) for entry in spec):
        return
    raise TypeError(f"{name} must be None, a regex string or a list of module names, got {spec!r}")


def check_filter(filter_fn: Optional[ModuleFilter]) -> None:
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable (module, fqn) -> bool, got {filter_fn!r}")


def check_lr(lr, where: str = "refine_block: ") -> float:
    """``lr`` as a float when it is a positive finite real number (ValueError otherwise)."""
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"{where}lr must be a positive finite number, got {lr!r}")
    return float(lr)


def check_holdout(holdout, where: str = "refine_block: ") -> float:
    """``holdout`` as a float when it is a fraction in (0, 1) (ValueError otherwise)."""
    if isinstance(holdout, bool) or not isinstance(holdout, numbers.Real) or not 0 < holdout < 1:
        raise ValueError(f"{where}holdout must be a fraction in (0, 1) of the calls (or rows) held back, got {holdout!r}")
    return float(holdout)


@dataclass(frozen=True)
class RefineConfig:
    """Block-wise refinement's settings (:func:`~panther_lite.conversion.fitting.refinement.refine_block`),
    validated once, here.

    Args:
        max_steps: most Adam steps per block.
        lr: Adam's learning rate.
        holdout: the fraction in (0, 1) of the cached calls held back for early stopping.
        patience: stop after this many steps without a new best on the held-back calls.

    Examples:
        >>> RefineConfig(max_steps=20)
        RefineConfig(max_steps=20, lr=0.001, holdout=0.25, patience=10)
    """

    max_steps: int = 100
    lr: float = 1e-3
    holdout: float = 0.25
    patience: int = 10

    def __post_init__(self) -> None:
        for name in ("max_steps", "patience"):
            object.__setattr__(self, name, check_positive_int(f"refine[{name!r}]", getattr(self, name)))
        object.__setattr__(self, "lr", check_lr(self.lr, "refine: "))
        object.__setattr__(self, "holdout", check_holdout(self.holdout, "refine: "))

    @classmethod
    def from_option(cls, refine) -> Optional["RefineConfig"]:
        """``convert``'s ``refine`` option as a RefineConfig: None for off (False / None), the
        defaults for True or an empty dict, else the settings of the config or dict given."""
        if refine is None or refine is False:
            return None
        if refine is True:
            return cls()
        if isinstance(refine, cls):
            return refine
        if not isinstance(refine, Mapping):
            settings = tuple(field.name for field in dataclasses.fields(cls))
            raise TypeError(
                f"refine must be True, False or a dict of refine_block settings {settings} (or a RefineConfig), "
                f"got {type(refine).__name__}"
            )
        unknown = sorted(str(key) for key in refine if key not in {f.name for f in dataclasses.fields(cls)})
        if unknown:
            settings = tuple(field.name for field in dataclasses.fields(cls))
            raise ValueError(f"refine: unknown setting(s) {unknown}; expected some of {settings}")
        return cls(**refine)


def _device(device) -> Optional[torch.device]:
    """``calibration_device`` as a ``torch.device`` (None stays None); it must hold real values."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"calibration_device must be None, a str or a torch.device, got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"calibration_device {device!r} is not a valid device: {error}") from None
    if device.type == "meta":
        raise ValueError(
            "calibration_device='meta' holds no values, so no Gram could be accumulated; "
            "pass None (each layer's own device) or a real device such as 'cpu'"
        )
    problem = device_problem(device)
    if problem is not None:
        raise ValueError(f"calibration_device {str(device)!r}: {problem}")
    return device


def device_problem(device: torch.device) -> Optional[str]:
    """Why this machine cannot use ``device`` (its backend is not available, or it has fewer
    devices than the index), or None. Backends torch does not describe pass."""
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps
    if device.type == "cpu" or not hasattr(backend, "is_available"):
        return None
    if not backend.is_available():
        return f"{device.type} is not available on this machine"
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        return f"this machine has {count} {device.type} device(s)"
    return None


def check_shrinkage(shrinkage) -> Union[str, float]:
    """``shrinkage`` as ``"auto"`` or a float in [0, 1] (None: 0.0, off); TypeError /
    ValueError naming the option otherwise."""
    if shrinkage is None or (isinstance(shrinkage, str) and shrinkage == "auto"):
        return 0.0 if shrinkage is None else shrinkage
    if isinstance(shrinkage, str):
        raise ValueError(f"shrinkage must be 'auto', a strength in [0, 1] or None (off), got {shrinkage!r}")
    if isinstance(shrinkage, bool) or not isinstance(shrinkage, numbers.Real):
        raise TypeError(
            f"shrinkage must be 'auto', a strength in [0, 1] or None (off), got {type(shrinkage).__name__} {shrinkage!r}"
        )
    if not (math.isfinite(shrinkage) and 0 <= shrinkage <= 1):
        raise ValueError(f"shrinkage must be 'auto', a strength in [0, 1] or None (off), got {shrinkage!r}")
    return float(shrinkage)


def _check_blocks(blocks) -> None:
    if blocks is None or blocks is False or (isinstance(blocks, str) and not isinstance(blocks, bool)):
        return
    raise TypeError(f"blocks must be 'auto', None, False or a dotted module path, got {blocks!r}")


class ReadOnlyDict(dict):
    """A dict that refuses changes (TypeError): a config's mapping, copied when the config is
    made, so what it shows is what its sizes were parsed from. Still a dict for JSON, pickling
    and copies."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a ConvertConfig's mappings are read-only: make a new config, e.g. "
                        "dataclasses.replace(config, rank_pattern={...})")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return ReadOnlyDict, (dict(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass(frozen=True)
class ConvertConfig:
    """Every option of :func:`~panther_lite.convert` but the model and the data, validated once,
    here (TypeError / ValueError naming the option). Frozen: vary one with
    ``dataclasses.replace(config, param_ratio=0.3)``. The conversion workflow in the docs
    (``docs/workflows.rst``) details each rule.

    Args:
        target_modules: which layers (PEFT's semantics): None (every candidate),
            ``"all-linear"``, a regex full-matched against the dotted name, or a list of names
            or dotted suffixes (an entry matching no candidate is a ValueError naming it).
        exclude_modules: same semantics; wins over ``target_modules``.
        filter_fn: ``(module, fqn) -> bool``; a module converts only if it returns True.
        num_terms, low_rank: ``L`` and ``k`` for every layer (with ``param_ratio``,
            ``num_terms`` fixes ``L``, default 1).
        param_ratio: stored size (U buffers included) as a fraction of the dense size, in
            (0, 1]: of each layer (``allocation="uniform"``: the largest ``low_rank`` that
            fits, so a layer stores at most it and, where a rank step allows, at least 90%)
            or of all the layers it sizes together (``"global"``).
        rank_pattern: ``{regex: ratio or (num_terms, low_rank)}`` per layer, first match wins.
        allocation: ``"uniform"`` (``param_ratio`` per layer) or ``"global"``: one budget
            for every layer the default ``param_ratio`` sizes, spent where it lowers the summed
            relative squared output error most, predicted from each layer's whitened singular
            spectrum (activation-aware with calibration data, the weight's own without; see
            :mod:`~panther_lite.conversion.planning.allocation`) and weighted, with calibration
            data, by the layer's measured gain to the model's output
            (:mod:`~panther_lite.conversion.planning.sensitivity`); a layer no sketch beats, or
            whose budget buys more elsewhere, stays dense with the reason.
        sensitivity: how the global allocation's gains compare the model's outputs
            (:mod:`~panther_lite.conversion.planning.output_distance`): ``"kl"``, the KL divergence
            of the next-token distributions its ``logits`` give (what perplexity feels), ``"norm"``,
            the relative squared change of its first floating-point tensor, ``"auto"``, ``"kl"``
            for an output holding ``logits`` (language models, classifiers), else ``"norm"``.
        align: ``low_rank`` rounding for tensor cores: ``"auto"`` rounds to the dtype's
            multiple (8 for fp16/bf16, 4 for TF32) only for CUDA layers in a tensor-core
            dtype; None never; an int to that multiple. Never where it would leave more than
            10% of a layer's budget unused.
        runtime_rows: the rows per call the model will run at (batch × tokens; batch ×
            output positions for convolutions). With it, a layer whose sketch a FLOP plus
            per-call-overhead model (:mod:`~panther_lite.conversion.planning.speed`) predicts
            slower than dense at that size stays dense with the modelled times as the reason.
        init: ``"svd"``: the best rank-``2Lk`` fit of each weight, or with calibration data
            of each layer's outputs (whitened SVD); ``"sketch"``: the anchor's estimate.
        decomposition: ``"auto"``, ``"exact"`` or ``"randomized"``: the fits' decomposition
            (:mod:`panther_lite.nn.low_rank_fit`; "auto" is randomized on wide layers). Its old
            name ``fit`` is a deprecated alias (a DeprecationWarning), removed in the next release.
        sequential: with calibration data given as a list of batches, a DataLoader or a
            deterministic callable (run again, layer calls paired by order), fit the layers
            in model order on the partly converted model, each to reproduce the original
            layer's outputs from the inputs it now receives (reduced-rank regression,
            :mod:`~panther_lite.conversion.fitting.sequential`): one group of layers'
            statistics alive at a time; the batches run twice per group.
        output_fisher: weigh each fitted layer's output channels by the Fisher information
            of the model's predicted distributions (a language model's next tokens, a
            classifier's classes) at that layer's output
            (:mod:`~panther_lite.conversion.planning.output_fisher`), so each fit keeps what
            the predictions feel rather than every channel alike: the best fit under the
            Kronecker-factored KL. With ``allocation="global"`` the plan reads the same
            metric (each layer's Fisher-weighted spectrum: the KL its fit at each rank
            costs). Needs calibration data (its batches, each run once more
            forward and backward) and an output holding ``logits``; applies to
            one-matrix layers whose outputs are feature-last (``nn.Linear``, transformers'
            ``Conv1D``; experts and convolutions are fitted as before).
        seed: makes ``init="sketch"`` and randomized fits reproducible (layer ``i`` of the
            plan uses ``seed + i``).
        shrinkage: how far the calibration Grams are shrunk towards their diagonal before a
            fit whitens by them (:mod:`~panther_lite.conversion.calibration.shrinkage`):
            ``"auto"`` (a multiple of the Ledoit–Wolf strength, possibly 0, chosen per layer
            at its rank on held-back calibration rows, so never worse than none there), a
            strength in [0, 1] for every layer, or 0 / None (off, stored as 0.0). The report's
            ``shrinkage`` column gives the strength each layer used.
        calibration_device: where the Grams and cached activations live (None: each layer's
            device for the Grams, the CPU for cached activations; not "meta").
        blocks: convert block by block (:mod:`~panther_lite.conversion.pipelines.by_blocks`):
            ``"auto"`` (or None) finds the repeated block list (the longest ``nn.ModuleList``
            of two or more same-class children holding a layer to convert: ``model.layers``,
            ``transformer.h``, ``encoder.layer``, ...), a dotted path names it, False never.
            It needs calibration data given as re-iterable batches and blocks that a replay
            reproduces exactly (checked on every batch; the rules:
            :mod:`~panther_lite.conversion.pipelines.capture`), so that it gives the whole-model
            result bit for bit; otherwise, or without a block list, the whole model is
            calibrated at once (a named path is then a ValueError). ``attrs["pipeline"]`` of the
            report says which ran and why (:func:`~panther_lite.conversion.pipelines.choose_pipeline`).
        refine: block-wise refinement (needs the block pipeline): after each block's
            closed-form fits, Adam on the factors and biases of the layers this call fitted in
            it (earlier conversions' sketched layers untouched) so the converted block
            reproduces the original block's outputs on the cached calibration inputs, stopping
            early on held-back calls and keeping the best parameters seen there (in float32 for
            a half-precision block). True (or ``{}``) for the defaults of :class:`RefineConfig`,
            a dict of some of its settings, or a RefineConfig; stored as a RefineConfig (None
            when off). ``attrs["refinement"]``: per block, the held-back output error before
            and after; a refined layer reads ``init="...+refined"``.
        progress: tqdm bars; None shows them on a terminal only.

    ``sizes`` (not an argument) is the validated :class:`SizeRequest`.
    """

    target_modules: ModuleSelector = None
    exclude_modules: ModuleSelector = None
    filter_fn: Optional[ModuleFilter] = None
    num_terms: Optional[int] = None
    low_rank: Optional[int] = None
    param_ratio: Optional[float] = None
    rank_pattern: Optional[Mapping[str, RankSpec]] = None
    allocation: str = "uniform"
    sensitivity: str = "auto"
    init: str = "svd"
    decomposition: str = "auto"
    align: Union[None, str, int] = "auto"
    runtime_rows: Optional[int] = None
    sequential: bool = False
    output_fisher: bool = False
    seed: Optional[int] = None
    shrinkage: Union[str, float, None] = "auto"
    calibration_device: Union[str, torch.device, None] = None
    blocks: Union[None, bool, str] = "auto"
    refine: Union[bool, Mapping[str, float], RefineConfig, None] = False
    progress: Optional[bool] = None
    fit: InitVar[Optional[str]] = None
    sizes: SizeRequest = field(init=False, repr=False, compare=False)

    #: Old option names still accepted, each with a DeprecationWarning: ``{old: new}``.
    deprecated_options = {"fit": "decomposition"}

    def __post_init__(self, fit: Optional[str] = None) -> None:
        if fit is not None:
            warnings.warn("ConvertConfig's option fit is deprecated: pass decomposition=... (the same values)",
                          DeprecationWarning, stacklevel=3)
            if self.decomposition not in ("auto", fit):
                raise ValueError(f"fit={fit!r} (deprecated) contradicts decomposition={self.decomposition!r}")
            object.__setattr__(self, "decomposition", fit)
        check_selector("target_modules", self.target_modules)
        check_selector("exclude_modules", self.exclude_modules)
        check_filter(self.filter_fn)
        check_choice("init", self.init, INITS)
        check_choice("allocation", self.allocation, ALLOCATIONS)
        check_choice("sensitivity", self.sensitivity, SENSITIVITY_METRICS)
        check_choice("decomposition", self.decomposition, FIT_METHODS)
        set_field = functools.partial(object.__setattr__, self)  # the dataclass is frozen
        set_field("sequential", check_bool("sequential", self.sequential))
        set_field("output_fisher", check_bool("output_fisher", self.output_fisher))
        if self.progress is not None:
            set_field("progress", check_bool("progress", self.progress))
        set_field("seed", check_seed(self.seed))
        set_field("shrinkage", check_shrinkage(self.shrinkage))
        set_field("calibration_device", _device(self.calibration_device))
        if self.sequential and self.init != "svd":
            raise ValueError("sequential=True fits each layer to the original outputs, which needs init='svd'")
        if self.output_fisher and self.init != "svd":
            raise ValueError("output_fisher=True weighs the fits' output errors, which needs init='svd'")
        resolve_rank_multiple(self.align, None, None)
        if self.runtime_rows is not None:
            set_field("runtime_rows", check_positive_int("runtime_rows", self.runtime_rows))
        set_field("refine", RefineConfig.from_option(self.refine))
        _check_blocks(self.blocks)
        sizes = parse_sizes(self.num_terms, self.low_rank, self.param_ratio, self.rank_pattern)
        if self.allocation == "global" and not isinstance(sizes.default, float):
            raise ValueError(
                "allocation='global' spreads one budget over the layers: pass param_ratio=... "
                f"(the budget as a fraction of their dense size), not num_terms/low_rank (got {sizes.default!r})"
            )
        if self.rank_pattern is not None:  # a read-only copy: what the sizes were parsed from stays what it shows
            set_field("rank_pattern", ReadOnlyDict(self.rank_pattern))
        set_field("sizes", sizes)

    @property
    def held_back(self) -> bool:
        """Whether calibration keeps held-back statistics (``shrinkage="auto"`` chooses its strength on them)."""
        return self.shrinkage == "auto"

    @property
    def cache_device(self) -> torch.device:
        """Where cached block inputs and outputs live (:func:`~panther_lite.conversion.config.cache_device`)."""
        return cache_device(self.calibration_device)


OPTIONS = tuple(f.name for f in dataclasses.fields(ConvertConfig) if f.init)


def _renamed(kind: type, overrides: Mapping[str, object], caller: str) -> Mapping[str, object]:
    """``overrides`` with the deprecated names of ``kind``'s options (``kind.deprecated_options``,
    ``{old: new}``) replaced by the new ones, each with a DeprecationWarning."""
    for old, new in getattr(kind, "deprecated_options", {}).items():
        if old in overrides:
            if new in overrides:
                raise TypeError(f"{caller}() got {old!r} (deprecated) and {new!r}: pass {new!r} alone")
            warnings.warn(f"{caller}(): the option {old} is deprecated, pass {new}=... (the same values)",
                          DeprecationWarning, stacklevel=4)
            overrides = {new if name == old else name: value for name, value in overrides.items()}
    return overrides


def configured(kind: type, config, overrides: Mapping[str, object], caller: str):
    """The config of dataclass ``kind`` a call runs with: ``config`` (None: the defaults) with
    ``overrides`` (field names of ``kind``) replaced. TypeError naming an unknown option and the
    closest valid one, or a ``config`` that is not a ``kind``."""
    overrides = _renamed(kind, overrides, caller)
    options = tuple(f.name for f in dataclasses.fields(kind) if f.init)
    for name in overrides:
        if name not in options:
            close = difflib.get_close_matches(name, options, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{caller}() got an unknown option {name!r}{hint} (the options are {kind.__name__}'s fields)")
    if config is None:
        return kind(**overrides)
    if not isinstance(config, kind):
        raise TypeError(f"config must be a panther_lite.{kind.__name__} (or None), got {type(config).__name__}")
    return dataclasses.replace(config, **overrides) if overrides else config


def make_config(config: Optional[ConvertConfig], overrides: Mapping[str, object], caller: str = "convert"):
    """:func:`configured` for a :class:`ConvertConfig`."""
    return configured(ConvertConfig, config, overrides, caller)
