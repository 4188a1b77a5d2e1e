"""Model surgery: swap ``nn.Linear`` / ``nn.Conv2d`` modules for sketched layers, and back.

:func:`convert` replaces selected layers of an existing model *in place* with
:class:`~panther_lite.nn.SKLinear` / :class:`~panther_lite.nn.SKConv2d` fitted to keep what
the model computes (the best rank-``2Lk`` fit of each weight, or with calibration data the
best fit of each layer's outputs), and returns a per-layer report. :func:`densify` turns
sketched layers back into dense ones. :func:`conversion_config` /
:func:`apply_conversion_config` rebuild a converted architecture so its ``state_dict``
loads into a fresh copy of the original model.

Sizes: a dense layer with ``fan_in`` inputs (``in_features``, or ``C_in·kh·kw`` for a
convolution) and ``fan_out`` outputs stores ``fan_in·fan_out`` (+ bias) parameters; its
sketched replacement stores ``2·L·k·(fan_in + fan_out)`` (+ bias), the fixed U sketch
buffers included. Every "stored" figure below counts those buffers.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from .nn.low_rank_fit import relative_error
from .nn.rank_selection import dense_size, select_config, sketch_size
from .nn.skconv2d import SKConv2d
from .nn.sklinear import INITS, SKLinear
from .sketch.random import check_seed

__all__ = [
    "convert",
    "densify",
    "conversion_summary",
    "conversion_config",
    "apply_conversion_config",
]

ModuleSelector = Union[str, Sequence[str], None]
RankSpec = Union[float, Tuple[int, int]]

CONFIG_FORMAT = "panther_lite.conversion"
CONFIG_VERSION = 1

REPORT_COLUMNS = [
    "name",
    "kind",
    "shape",
    "status",
    "reason",
    "init",
    "num_terms",
    "low_rank",
    "dense_params",
    "trainable_params",
    "stored_params",
    "stored_ratio",
    "weight_error",
    "output_error",
]

# Parents whose forward reads these children's ``.weight`` directly instead of calling them:
# nn.MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward, and the
# inference fast path of nn.TransformerEncoderLayer passes linear1/linear2 weights to a fused op.
_DIRECT_WEIGHT_READERS = {
    nn.MultiheadAttention: ("out_proj",),
    nn.TransformerEncoderLayer: ("linear1", "linear2"),
}

# Per-batch bound on the unfolded patches of a convolution's input (entries), so the
# Gram of a large feature map is accumulated in slices of the batch.
_MAX_PATCH_ENTRIES = 1 << 24


@dataclass
class _Layer:
    """One selected layer and what convert decided for it."""

    name: str
    module: nn.Module
    status: str = "converted"
    reason: str = ""
    num_terms: Optional[int] = None
    low_rank: Optional[int] = None

    @property
    def kind(self) -> str:
        return "Conv2d" if isinstance(self.module, nn.Conv2d) else "Linear"

    @property
    def has_bias(self) -> bool:
        return self.module.bias is not None

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.module.weight, nn.parameter.UninitializedParameter)

    @property
    def shape(self) -> Optional[tuple]:
        return None if self.is_lazy else tuple(self.module.weight.shape)

    @property
    def fan_in(self) -> int:
        return self.module.weight[0].numel()

    @property
    def fan_out(self) -> int:
        return self.module.weight.shape[0]

    @property
    def dense_params(self) -> int:
        """Parameters of the dense layer (0 while a lazy module is uninitialized)."""
        return 0 if self.is_lazy else dense_size(self.fan_in, self.fan_out, self.has_bias)

    def skip(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason


# --------------------------------------------------------------------------- selection


def _check_selector(name: str, spec: ModuleSelector) -> None:
    if spec is None or isinstance(spec, str):
        if isinstance(spec, str):
            _compile(name, spec)
        return
    if isinstance(spec, (list, tuple, set, frozenset)) and all(isinstance(entry, str) for entry in spec):
        return
    raise TypeError(f"{name} must be None, a regex string or a list of module names, got {spec!r}")


def _compile(name: str, pattern: str) -> "re.Pattern":
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{name} {pattern!r} is not a valid regular expression: {error}") from None


def _matches(spec: Union[str, Sequence[str]], fqn: str) -> bool:
    """PEFT's rule: a string is a regex full-matched against the dotted name; a list entry
    matches a name equal to it or ending in ``"." + entry``."""
    if isinstance(spec, str):
        return re.fullmatch(spec, fqn) is not None
    return any(fqn == entry or fqn.endswith("." + entry) for entry in spec)


def _is_target(module: nn.Module, fqn: str, target_modules: ModuleSelector) -> bool:
    if target_modules is None:
        return True
    if target_modules == "all-linear":
        return isinstance(module, nn.Linear)
    return _matches(target_modules, fqn)


def _select(
    model: nn.Module,
    target_modules: ModuleSelector,
    exclude_modules: ModuleSelector,
    filter_fn: Optional[Callable[[nn.Module, str], bool]],
) -> List[_Layer]:
    """The nn.Linear / nn.Conv2d modules picked by target/exclude/filter_fn, in model order."""
    candidates = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    selected = [
        _Layer(fqn, m)
        for fqn, m in candidates
        if _is_target(m, fqn, target_modules)
        and not (exclude_modules is not None and _matches(exclude_modules, fqn))
        and (filter_fn is None or filter_fn(m, fqn))
    ]
    if not selected:
        names = ", ".join(repr(fqn) for fqn, _ in candidates[:10]) or "none"
        more = f" (and {len(candidates) - 10} more)" if len(candidates) > 10 else ""
        raise ValueError(
            f"no nn.Linear or nn.Conv2d module matched target_modules={target_modules!r}, "
            f"exclude_modules={exclude_modules!r}, filter_fn={getattr(filter_fn, '__name__', filter_fn)!r}; "
            f"the model's nn.Linear/nn.Conv2d modules are: {names}{more}"
        )
    return selected


def _unconvertible_reason(model: nn.Module, layer: _Layer, owners: Dict[int, List[str]]) -> Optional[str]:
    """Why ``layer`` cannot be swapped without changing the model, or None."""
    module, fqn = layer.module, layer.name
    if fqn == "":
        return "the root module cannot be replaced in place; wrap it in a container (e.g. nn.Sequential)"
    if layer.is_lazy:
        return "its parameters are not initialized yet (lazy module); run a forward pass first"
    if module.weight.is_meta:
        return (
            "its weight is on the meta device (no values to fit); load the weights first, or rebuild "
            "a converted layout with apply_conversion_config"
        )
    base = nn.Conv2d if isinstance(module, nn.Conv2d) else nn.Linear
    for method in ("forward", "_conv_forward") if base is nn.Conv2d else ("forward",):
        if getattr(type(module), method) is not getattr(base, method):
            return (
                f"{type(module).__name__} overrides {base.__name__}.{method} (custom behaviour the sketched "
                "layer would drop)"
            )
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    for reader, children in _DIRECT_WEIGHT_READERS.items():
        if isinstance(parent, reader) and child in children:
            return f"its parent {type(parent).__name__} reads {child}.weight directly instead of calling it"
    for attr in ("weight", "bias"):
        tensor = getattr(module, attr)
        if tensor is None:
            continue
        others = [name for name in owners.get(id(tensor), []) if name != f"{fqn}.{attr}"]
        if others:
            return f"{attr} is tied to {', '.join(others)} (the same Parameter)"
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"SKConv2d supports only groups=1, this convolution has groups={module.groups}"
    return None


# --------------------------------------------------------------------------- sizes


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_ratio(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1] (stored size as a fraction of the dense layer), got {value!r}")
    return float(value)


def _check_rank_spec(name: str, value) -> RankSpec:
    """A ratio in (0, 1] or a ``(num_terms, low_rank)`` pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be a ratio or a (num_terms, low_rank) pair, got {value!r}")
        return (_check_count(f"{name} num_terms", value[0]), _check_count(f"{name} low_rank", value[1]))
    return _check_ratio(name, value)


def _size_arguments(
    num_terms, low_rank, param_ratio, rank_pattern
) -> Tuple[Optional[RankSpec], int, List[Tuple["re.Pattern", str, RankSpec]]]:
    """``(default spec, num_terms used with ratios, [(regex, key, spec)])`` from the size
    arguments, raising ValueError on bad or contradictory ones."""
    if param_ratio is not None:
        if low_rank is not None:
            raise ValueError(
                "param_ratio chooses low_rank: pass param_ratio (optionally with num_terms), "
                "or num_terms and low_rank, not both"
            )
        default = _check_ratio("param_ratio", param_ratio)
        ratio_terms = 1 if num_terms is None else _check_count("num_terms", num_terms)
    elif num_terms is not None or low_rank is not None:
        if num_terms is None or low_rank is None:
            raise ValueError(
                f"num_terms and low_rank go together (got num_terms={num_terms!r}, low_rank={low_rank!r}); "
                "or pass param_ratio to choose low_rank per layer"
            )
        default = (_check_count("num_terms", num_terms), _check_count("low_rank", low_rank))
        ratio_terms = num_terms
    else:
        default, ratio_terms = None, 1
    patterns = []
    if rank_pattern is not None:
        if not isinstance(rank_pattern, Mapping):
            raise TypeError(f"rank_pattern must be a dict {{regex: ratio or (num_terms, low_rank)}}, got {rank_pattern!r}")
        for key, value in rank_pattern.items():
            if not isinstance(key, str):
                raise TypeError(f"rank_pattern keys must be regex strings, got {key!r}")
            regex = _compile("rank_pattern key", rf"(?:.*\.)?(?:{key})")
            patterns.append((regex, key, _check_rank_spec(f"rank_pattern[{key!r}]", value)))
    if default is None and not patterns:
        raise ValueError("give a size: param_ratio=..., or num_terms=... and low_rank=..., or a rank_pattern")
    return default, ratio_terms, patterns


def _choose_size(layer: _Layer, spec: RankSpec, ratio_terms: int) -> None:
    """Set ``layer``'s (num_terms, low_rank), or mark it kept dense when nothing beats dense."""
    dense = layer.dense_params
    if isinstance(spec, tuple):
        num_terms, low_rank = spec
        stored = sketch_size(layer.fan_in, layer.fan_out, num_terms, low_rank, layer.has_bias).stored
        if stored >= dense:
            layer.skip(
                "kept dense",
                f"num_terms={num_terms}, low_rank={low_rank} would store {stored:,} parameters, "
                f"not fewer than the dense layer's {dense:,}",
            )
            return
    else:
        config = select_config(
            layer.fan_in,
            layer.fan_out,
            spec,
            num_terms=ratio_terms,
            dtype=layer.module.weight.dtype,
            bias=layer.has_bias,
        )
        stored = None if config is None else sketch_size(layer.fan_in, layer.fan_out, *config, layer.has_bias).stored
        if config is None or stored >= dense:
            layer.skip(
                "kept dense",
                f"no configuration with num_terms={ratio_terms} stores at most {spec:g} of the dense "
                f"layer's {dense:,} parameters and fewer than dense",
            )
            return
        num_terms, low_rank = config
    layer.num_terms, layer.low_rank = num_terms, low_rank


def _plan_sizes(layers: List[_Layer], default, ratio_terms: int, patterns) -> None:
    used = set()
    uncovered = []
    for layer in layers:
        spec = default
        for regex, key, pattern_spec in patterns:
            if regex.fullmatch(layer.name):
                spec = pattern_spec
                used.add(key)
                break
        if layer.status != "converted":
            continue
        if spec is None:
            uncovered.append(layer.name)
            continue
        _choose_size(layer, spec, ratio_terms)
    unused = [key for _, key, _ in patterns if key not in used]
    if unused:
        raise ValueError(
            f"rank_pattern keys {unused} matched no selected layer (selected: {[layer.name for layer in layers]})"
        )
    if uncovered:
        raise ValueError(
            f"layers {uncovered} match no rank_pattern key and no default size was given: "
            "pass param_ratio=..., or num_terms=... and low_rank=..."
        )


# --------------------------------------------------------------------------- calibration


def _conv_patches(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """Unfolded input patches ``(N·H_out·W_out, C_in·kh·kw)`` of ``conv`` (F.unfold order,
    matching ``conv.weight.reshape(C_out, -1)``), padding included as the conv pads."""
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    columns = F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    return columns.transpose(1, 2).reshape(-1, columns.shape[1])


def _layer_input(args: tuple, kwargs: dict) -> Tensor:
    """The input of a call to ``nn.Linear.forward`` / ``nn.Conv2d.forward`` (the only
    forwards convert accepts): the positional argument or the ``input=`` keyword."""
    return args[0] if args else kwargs["input"]


class _GramRecorder:
    """Forward pre-hook (``with_kwargs=True``) accumulating ``XᵀX`` (float64) of one layer's
    inputs in a ``(fan_in, fan_in)`` matrix on ``device`` (None: the layer's device)."""

    def __init__(self, layer: _Layer, device: Optional[torch.device] = None) -> None:
        self.module = layer.module
        device = layer.module.weight.device if device is None else device
        self.gram = torch.zeros(layer.fan_in, layer.fan_in, dtype=torch.float64, device=device)
        self.rows = 0

    def _add(self, rows: Tensor) -> None:
        rows = rows.detach().to(torch.float64)
        if rows.device == self.gram.device:
            self.gram.addmm_(rows.t(), rows)
        else:  # the product runs where the activations are; only its result is moved
            self.gram.add_((rows.t() @ rows).to(self.gram.device))
        self.rows += rows.shape[0]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = _layer_input(args, kwargs)
        if isinstance(module, nn.Conv2d):
            if x.dim() == 3:
                x = x.unsqueeze(0)
            per_sample = max(1, x[:1].numel() * module.weight[0, 0].numel())
            step = max(1, _MAX_PATCH_ENTRIES // per_sample)
            for chunk in x.split(step):
                self._add(_conv_patches(module, chunk))
        else:
            self._add(x.reshape(-1, x.shape[-1]))


def _check_calibration_data(calibration_data) -> None:
    if calibration_data is None or callable(calibration_data):
        return
    if isinstance(calibration_data, Tensor):
        raise TypeError(
            "calibration_data must be an iterable of batches or a callable fn(model), got a single Tensor; "
            "pass e.g. [x] or x.split(256)"
        )
    if isinstance(calibration_data, (str, bytes)) or not isinstance(calibration_data, Iterable):
        raise TypeError(f"calibration_data must be an iterable of batches or a callable fn(model), got {calibration_data!r}")


def _run_batch(model: nn.Module, batch) -> None:
    if isinstance(batch, Tensor):
        model(batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    elif isinstance(batch, Mapping):
        model(**batch)
    else:
        raise TypeError(
            f"calibration batches must be a Tensor (model(b)), a tuple/list (model(*b)) or a dict (model(**b)), "
            f"got {type(batch).__name__}"
        )


@torch.no_grad()
def _collect_grams(
    model: nn.Module,
    layers: List[_Layer],
    calibration_data,
    progress: Optional[bool],
    device: Optional[torch.device] = None,
) -> Dict[str, _GramRecorder]:
    """Run the calibration data through ``model`` in eval mode and no_grad, recording each
    layer's input Gram on ``device`` (None: the layer's own); hooks and every module's
    training flag are restored afterwards."""
    recorders = {layer.name: _GramRecorder(layer, device) for layer in layers}
    training = {module: module.training for module in model.modules()}
    handles = [layer.module.register_forward_pre_hook(recorders[layer.name], with_kwargs=True) for layer in layers]
    try:
        model.eval()
        if callable(calibration_data):
            calibration_data(model)
        else:
            batches = tqdm(calibration_data, desc="calibrating", unit="batch", disable=_tqdm_disabled(progress))
            for batch in batches:
                _run_batch(model, batch)
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in training.items():
            module.training = flag
    return recorders


# --------------------------------------------------------------------------- fitting


def _tqdm_disabled(progress: Optional[bool]) -> Optional[bool]:
    """tqdm's ``disable``: None (show on a terminal only) when progress is None."""
    return None if progress is None else not progress


def _output_error(weight: Tensor, approx: Tensor, gram: Tensor) -> float:
    """``‖X(W−Ŵ)ᵀ‖_F / ‖XWᵀ‖_F`` from the Gram ``G = XᵀX``:
    ``sqrt(trace((W−Ŵ) G (W−Ŵ)ᵀ) / trace(W G Wᵀ))``, with W, Ŵ as (fan_out, fan_in)."""
    w = weight.detach().reshape(weight.shape[0], -1).to(gram)
    diff = w - approx.detach().reshape_as(w).to(gram)
    denominator = ((w @ gram) * w).sum()
    if denominator <= 0:
        return math.nan
    return math.sqrt(max(float(((diff @ gram) * diff).sum() / denominator), 0.0))


def _match_trainability(new: nn.Module, old: nn.Module) -> None:
    """Give ``new`` the training mode and requires_grad flags of ``old`` (factors follow the weight)."""
    new.train(old.training)
    for name, param in new.named_parameters():
        source = old.bias if name == "bias" else old.weight
        param.requires_grad_(source.requires_grad)


def _fit(layer: _Layer, init: str, gram: Optional[Tensor], seed: Optional[int]) -> nn.Module:
    build = SKConv2d.from_conv2d if isinstance(layer.module, nn.Conv2d) else SKLinear.from_linear
    fit_gram = gram if init == "svd" else None
    new = build(layer.module, layer.num_terms, layer.low_rank, init=init, seed=seed, gram=fit_gram)
    _match_trainability(new, layer.module)
    return new


def _swap(model: nn.Module, replacements: List[Tuple[str, nn.Module]]) -> None:
    """Replace the module at each dotted name with its new module, at every place the
    model holds that same module (a shared layer stays shared); all or nothing."""
    aliases: Dict[int, List[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(fqn)
    done = []
    try:
        for fqn, new in replacements:
            for alias in aliases.get(id(model.get_submodule(fqn)), [fqn]):
                parent_name, _, child = alias.rpartition(".")
                parent = model.get_submodule(parent_name)
                done.append((parent, child, getattr(parent, child)))
                setattr(parent, child, new)
    except BaseException:
        for parent, child, old in reversed(done):
            setattr(parent, child, old)
        raise


def _stored_numel(model: nn.Module) -> int:
    """Entries of the model's parameters and buffers (the U sketches included); those of
    lazy modules, not materialized yet, count 0."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() for t in tensors if not nn.parameter.is_lazy(t))


# --------------------------------------------------------------------------- public API


def convert(
    model: nn.Module,
    *,
    target_modules: ModuleSelector = None,
    exclude_modules: ModuleSelector = None,
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    num_terms: Optional[int] = None,
    low_rank: Optional[int] = None,
    param_ratio: Optional[float] = None,
    rank_pattern: Optional[Mapping[str, RankSpec]] = None,
    init: str = "svd",
    calibration_data=None,
    calibration_device: Union[str, torch.device, None] = None,
    seed: Optional[int] = None,
    progress: Optional[bool] = None,
) -> pd.DataFrame:
    """Replace ``nn.Linear`` / ``nn.Conv2d`` modules of ``model`` with sketched layers, in place.

    Every argument is validated and every replacement is fitted before the first swap, so
    on any error the model is left exactly as it was.

    Args:
        model: the model to convert (modified in place).
        target_modules: which modules to convert, with PEFT's semantics. ``None`` (default):
            every ``nn.Linear`` and ``nn.Conv2d``; ``"all-linear"``: every ``nn.Linear``;
            a string: a regex full-matched against the dotted module name; a list: names
            equal to an entry or ending in ``"." + entry``. Only ``nn.Linear`` and
            ``nn.Conv2d`` modules (and subclasses) are ever candidates; a subclass that
            overrides ``forward`` is reported as skipped.
        exclude_modules: same semantics; wins over ``target_modules``.
        filter_fn: optional ``(module, fqn) -> bool``; a module is converted only if it
            returns True (as torchao's ``module_filter_fn``).
        num_terms, low_rank: ``L`` and ``k`` for every layer. With ``param_ratio``,
            ``num_terms`` (default 1) fixes ``L`` and ``low_rank`` is chosen.
        param_ratio: stored size of each converted layer (U buffers included) as a
            fraction of the dense layer, in (0, 1]; ``low_rank`` is the largest that fits,
            rounded down to the tensor-core multiple of the layer's dtype when that still
            leaves a nonzero rank (:func:`~panther_lite.nn.select_config`).
        rank_pattern: ``{regex: ratio or (num_terms, low_rank)}`` per layer; a key matches
            a dotted name that it full-matches or that ends in ``"." + match`` (PEFT's
            rule). The first matching key wins over the default size; a key matching no
            selected layer is an error.
        init: ``"svd"`` (default) — the best rank-``2Lk`` fit of each weight, or with
            ``calibration_data`` of each layer's outputs on that data (activation-aware,
            whitened SVD); ``"sketch"`` — the anchor's random-sketch estimate of the
            weight (calibration data then only feeds the report's output error).
        calibration_data: an iterable of batches (Tensor → ``model(b)``, tuple/list →
            ``model(*b)``, dict → ``model(**b)``) or a callable ``fn(model)``. It runs once
            under ``torch.no_grad()`` in eval mode (every module's training flag is
            restored) while forward pre-hooks accumulate each target layer's input Gram
            ``XᵀX`` in float64 (unfolded patches for convolutions; a layer may get its
            ``input`` positionally or as a keyword). All Grams are alive together until
            the fits: ``8·Σ fan_in²`` bytes over the target layers (e.g. 32 layers of
            fan_in 4096: 4 GiB).
        calibration_device: where those Grams are held. None (default): on each
            layer's own device; e.g. ``"cpu"`` offloads them to host memory so a large
            model's accelerator holds only its activations, each batch's ``XᵀX`` (one
            ``fan_in²`` float64 matrix at a time, computed where the activations are)
            and, while a layer is fitted, that layer's Gram. The fits are the same
            wherever the Grams are held.
        seed: makes the random sketches of ``init="sketch"`` reproducible (layer ``i``
            uses ``seed + i``).
        progress: show tqdm progress bars; None (default) shows them on a terminal only.

    Returns:
        A DataFrame with one row per selected layer (:data:`REPORT_COLUMNS`): ``status`` is
        ``"converted"``, ``"kept dense"`` (no configuration within the budget beats
        dense) or ``"skipped"`` (cannot be swapped safely: weight tied to another module,
        read directly by its parent such as ``nn.MultiheadAttention.out_proj``, a subclass
        overriding ``forward``, grouped convolution, lazy, meta-device or root module), with the
        ``reason``. Sizes count parameters; ``stored_params`` includes the U buffers.
        ``weight_error`` is ``‖Ŵ − W‖_F/‖W‖_F``; ``output_error`` is
        ``‖X(W − Ŵ)ᵀ‖_F/‖XWᵀ‖_F`` on the calibration data (NaN without it). ``df.attrs["summary"]`` holds a printable
        one-line summary (:func:`conversion_summary`).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a selector, ``rank_pattern``,
            ``calibration_data`` or ``calibration_device`` has the wrong type.
        ValueError: nothing matched, bad or contradictory sizes, an unknown ``init``, an
            invalid ``calibration_device``.

    Replaced modules lose any hooks registered on them; training mode and
    ``requires_grad`` carry over, and each new module lands on the device and dtype of
    the one it replaces (decompositions run in float64, or float32 for huge weights).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_selector("target_modules", target_modules)
    _check_selector("exclude_modules", exclude_modules)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable (module, fqn) -> bool, got {filter_fn!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    seed = check_seed(seed)
    _check_calibration_data(calibration_data)
    if calibration_device is not None:
        if not isinstance(calibration_device, (str, torch.device)):
            raise TypeError(f"calibration_device must be None, a str or a torch.device, got {calibration_device!r}")
        try:
            calibration_device = torch.device(calibration_device)
        except RuntimeError as error:
            raise ValueError(f"calibration_device {calibration_device!r} is not a valid device: {error}") from None
    default, ratio_terms, patterns = _size_arguments(num_terms, low_rank, param_ratio, rank_pattern)

    layers = _select(model, target_modules, exclude_modules, filter_fn)
    owners: Dict[int, List[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(fqn)
    for layer in layers:
        reason = _unconvertible_reason(model, layer, owners)
        if reason is not None:
            layer.skip("skipped", reason)
    _plan_sizes(layers, default, ratio_terms, patterns)
    todo = [layer for layer in layers if layer.status == "converted"]

    grams: Dict[str, _GramRecorder] = {}
    if calibration_data is not None and todo:
        grams = _collect_grams(model, todo, calibration_data, progress, calibration_device)

    stored_before = _stored_numel(model)
    results = {}
    for index, layer in enumerate(tqdm(todo, desc="converting", unit="layer", disable=_tqdm_disabled(progress))):
        recorder = grams.get(layer.name)
        gram = recorder.gram if recorder is not None and recorder.rows > 0 else None
        layer_init = "calibrated" if init == "svd" and gram is not None else init
        if recorder is not None and gram is None:
            layer.reason = "calibration data never reached this layer; fitted to the weight alone"
            warnings.warn(f"convert: calibration data never reached {layer.name!r}; fitted to its weight alone", UserWarning, stacklevel=2)
        new = _fit(layer, init, gram, None if seed is None else seed + index)
        approx = new.effective_weight()
        counts = new.parameter_counts()
        results[layer.name] = dict(
            init=layer_init,
            trainable_params=counts.trainable,
            stored_params=counts.stored,
            weight_error=relative_error(approx.detach(), layer.module.weight.detach()),
            output_error=math.nan if gram is None else _output_error(layer.module.weight, approx, gram),
            module=new,
        )
    _swap(model, [(name, result.pop("module")) for name, result in results.items()])

    rows = []
    for layer in layers:
        row = dict(
            name=layer.name,
            kind=layer.kind,
            shape=layer.shape,
            status=layer.status,
            reason=layer.reason,
            init=None,
            num_terms=layer.num_terms,
            low_rank=layer.low_rank,
            dense_params=layer.dense_params,
            trainable_params=layer.dense_params,
            stored_params=layer.dense_params,
            weight_error=math.nan,
            output_error=math.nan,
        )
        row.update(results.get(layer.name, {}))
        row["stored_ratio"] = row["stored_params"] / row["dense_params"] if row["dense_params"] else math.nan
        rows.append(row)
    report = pd.DataFrame(rows, columns=REPORT_COLUMNS)
    for column in ("num_terms", "low_rank"):
        report[column] = report[column].astype("Int64")
    report.attrs["model_stored_before"] = stored_before
    report.attrs["model_stored_after"] = _stored_numel(model)
    report.attrs["summary"] = conversion_summary(report)
    return report


def conversion_summary(report: pd.DataFrame) -> str:
    """One printable line from a :func:`convert` report: layers converted, and stored
    parameters (U buffers included) before → after for the selected layers and, when the
    report carries them, the whole model."""
    counts = report["status"].value_counts()
    converted = int(counts.get("converted", 0))
    before, after = int(report["dense_params"].sum()), int(report["stored_params"].sum())
    text = (
        f"converted {converted} of {len(report)} selected layers "
        f"({int(counts.get('kept dense', 0))} kept dense, {int(counts.get('skipped', 0))} skipped); "
        f"their stored parameters (U buffers included) {before:,} → {after:,} ({after / max(before, 1):.3f}x)"
    )
    if "model_stored_before" in report.attrs and "model_stored_after" in report.attrs:
        model_before, model_after = report.attrs["model_stored_before"], report.attrs["model_stored_after"]
        text += f"; whole model {model_before:,} → {model_after:,} ({model_after / max(model_before, 1):.3f}x)"
    return text


def densify(model: nn.Module) -> nn.Module:
    """Replace every :class:`SKLinear` / :class:`SKConv2d` in ``model`` with its dense
    equivalent (``to_dense()``: same function, device, dtype, training mode and
    ``requires_grad``), in place. Returns ``model``, or the dense module itself when
    ``model`` is a sketched layer (a root cannot be replaced in place)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, (SKLinear, SKConv2d)):
        return _dense_twin(model)
    sketched = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (SKLinear, SKConv2d))]
    _swap(model, [(fqn, _dense_twin(m)) for fqn, m in sketched])
    return model


def _dense_twin(layer: Union[SKLinear, SKConv2d]) -> nn.Module:
    dense = layer.to_dense()
    dense.train(layer.training)
    factor = layer.S if isinstance(layer, SKConv2d) else layer.S1
    dense.weight.requires_grad_(factor.requires_grad)
    if layer.bias is not None:
        dense.bias.requires_grad_(layer.bias.requires_grad)
    return dense


def conversion_config(model: nn.Module) -> dict:
    """The JSON-serialisable layout of the sketched layers in ``model``.

    ``{"format": "panther_lite.conversion", "version": 1, "layers": [{"name", "kind",
    "shape", "num_terms", "low_rank", "bias"}, ...]}`` with ``kind`` ``"SKLinear"`` or
    ``"SKConv2d"`` and ``shape`` the dense weight's shape. Save it next to the
    ``state_dict``; :func:`apply_conversion_config` rebuilds the architecture from it.
    """
    layers = []
    for fqn, module in model.named_modules():
        if isinstance(module, (SKLinear, SKConv2d)):
            layers.append(
                dict(
                    name=fqn,
                    kind=type(module).__name__,
                    shape=_dense_shape(module),
                    num_terms=module.num_terms,
                    low_rank=module.low_rank,
                    bias=module.bias is not None,
                )
            )
    return dict(format=CONFIG_FORMAT, version=CONFIG_VERSION, layers=layers)


def _dense_shape(module: Union[SKLinear, SKConv2d]) -> List[int]:
    """Shape of the dense weight a sketched layer stands for."""
    if isinstance(module, SKConv2d):
        return [module.out_channels, module.in_channels, *module.kernel_size]
    return [module.out_features, module.in_features]


_DENSE_OF = {"SKLinear": nn.Linear, "SKConv2d": nn.Conv2d}


def apply_conversion_config(model: nn.Module, config: Mapping) -> nn.Module:
    """Swap the layers listed in ``config`` (from :func:`conversion_config`) for sketched
    layers of the recorded sizes, in place, so a converted model's ``state_dict`` loads
    into ``model`` (a fresh instance of the original architecture). No fitting happens:
    the new layers hold placeholder values until the state_dict is loaded. All or
    nothing: on a mismatch (ValueError) the model is unchanged. Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(config, Mapping) or config.get("format") != CONFIG_FORMAT:
        raise ValueError(f"config must be a dict from conversion_config() with format={CONFIG_FORMAT!r}")
    if config.get("version") != CONFIG_VERSION:
        raise ValueError(f"unsupported conversion config version {config.get('version')!r}, expected {CONFIG_VERSION}")
    replacements = []
    for entry in config.get("layers", []):
        fqn, kind = entry["name"], entry["kind"]
        if kind not in _DENSE_OF:
            raise ValueError(f"layer {fqn!r}: unknown kind {kind!r}, expected one of {list(_DENSE_OF)}")
        if fqn == "":
            raise ValueError("the root module cannot be replaced in place")
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise ValueError(f"layer {fqn!r} from the config does not exist in the model") from None
        expected = _DENSE_OF[kind]
        if not isinstance(module, expected):
            raise ValueError(f"layer {fqn!r} is a {type(module).__name__}, the config expects an {expected.__name__}")
        if list(module.weight.shape) != list(entry["shape"]) or (module.bias is not None) != bool(entry["bias"]):
            raise ValueError(
                f"layer {fqn!r} has weight shape {list(module.weight.shape)} and bias={module.bias is not None}, "
                f"the config expects {list(entry['shape'])} and bias={bool(entry['bias'])}"
            )
        build = SKConv2d.from_conv2d if kind == "SKConv2d" else SKLinear.from_linear
        new = build(module, entry["num_terms"], entry["low_rank"], init="sketch", seed=0)
        _match_trainability(new, module)
        replacements.append((fqn, new))
    _swap(model, replacements)
    return model
