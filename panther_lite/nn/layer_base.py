"""SketchedLayer: the pipeline every sketched layer shares, so each layer states only what differs.

Shared here: the ``1/(2L)`` scale, seeds, the default initialisation (dense draw, represent,
rescale), fitting from a dense weight (``init="svd"``/``"sketch"``, optional calibration
Gram) with its validation, parameter accounting and the size warning, the dense twin
(:meth:`~SketchedLayer.to_dense`, :meth:`~SketchedLayer.from_dense`) and the read-only
``weight`` that code written for dense layers reads.

A subclass defines its factors (``_factor_names``, ``_trainable_names``), its sizes
(``fan_in``, ``fan_out``, ``dense_weight_shape``, ``_weight_layout``), how a dense matrix
``(fan_out, fan_in)`` becomes factors (``_svd_factors``, ``_sketch_factors``),
``effective_weight``, ``parameter_counts``, ``_dense_options`` (the dense layer's
constructor options) and ``_options_from_dense`` (the reverse).
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..sketch.random import check_seed, resolve_generator
from .change_detection import tensor_signature
from .default_init import draw_dense_default, fill_bias_default_, rescale_to_default_
from .low_rank_fit import FIT_METHODS, decomposition_dtype
from .rank_selection import SketchSize, dense_size
from .validation import check_choice, check_finite, check_gram, check_materialized, check_positive_int, check_tensor

__all__ = ["INITS", "SketchedLayer"]

INITS = ("sketch", "svd")


class SketchedLayer(nn.Module):
    """Base class of the sketched layers (see the module docstring for what a subclass states).

    ``weight`` is read-only: the effective weight in the dense layer's layout (see
    :attr:`weight`). Writing it raises AttributeError; ``state_dict`` holds only the factors.
    """

    _factor_names: Tuple[str, ...] = ()
    _trainable_names: Tuple[str, ...] = ()
    _dense_class: type = nn.Module
    _weight_layout: str = ""
    _fan_in_name: str = "fan_in"
    # attributes computed from the factors, dropped on .to()/.half()/... and never pickled or copied
    _derived_state: Tuple[str, ...] = ("_weight_cache",)

    def __init__(self, num_terms: int, low_rank: int, init: str, seed: Optional[int]) -> None:
        super().__init__()
        self.num_terms = check_positive_int("num_terms", num_terms)
        self.low_rank = check_positive_int("low_rank", low_rank)
        self.init = check_choice("init", init, INITS)
        self.seed = check_seed(seed)

    # ------------------------------------------------------------------ what subclasses state

    @property
    def fan_in(self) -> int:
        raise NotImplementedError

    @property
    def fan_out(self) -> int:
        raise NotImplementedError

    @property
    def dense_weight_shape(self) -> Tuple[int, ...]:
        """The dense layer's weight shape (``nn.Linear``: ``(out, in)``; convs: ``(C_out, C_in, *k)``)."""
        raise NotImplementedError

    def _svd_factors(
        self, matrix: Tensor, gram: Optional[Tensor], fit: str, output_gram: Optional[Tensor] = None
    ) -> Tuple[Tensor, ...]:
        raise NotImplementedError

    def _sketch_factors(self, matrix: Tensor, generator: Optional[torch.Generator]) -> Tuple[Tensor, ...]:
        raise NotImplementedError

    def effective_weight(self) -> Tensor:
        raise NotImplementedError

    def parameter_counts(self) -> SketchSize:
        raise NotImplementedError

    def _dense_options(self) -> Dict[str, object]:
        raise NotImplementedError

    @classmethod
    def _options_from_dense(cls, dense: nn.Module) -> Dict[str, object]:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared pipeline

    @property
    def scale(self) -> float:
        """``1 / (2L)``."""
        return 0.5 / self.num_terms

    def _factors(self) -> Tuple[Tensor, ...]:
        return tuple(getattr(self, name) for name in self._factor_names)

    def _check_dense_weight(self, name: str, weight, values: bool = True) -> Tensor:
        """Validate a dense weight argument: a Tensor of :attr:`dense_weight_shape` and, with
        ``values``, materialised and finite."""
        check_tensor(name, weight, self.dense_weight_shape, self._weight_layout)
        if values:
            check_materialized(name, weight)
            check_finite(name, weight)
        return weight

    def _initialize(self, name: str, weight: Optional[Tensor], bias: Optional[Tensor]) -> None:
        """The constructor's last step: warn if larger than dense, then fit ``weight`` (argument
        ``name``, shape already checked; None: the default init) and copy ``bias`` (None: draw
        it). A layer built on the meta device is left unfitted."""
        self._warn_if_larger_than_dense()
        if weight is None:
            self.reset_parameters()
            return
        if self._factors()[0].is_meta:
            return
        self._check_dense_weight(name, weight)
        generator = resolve_generator(self.seed)
        self._fit(weight, self.init, None, generator, "auto")
        if bias is None:
            fill_bias_default_(self.bias, self.fan_in, generator)
        else:
            with torch.no_grad():
                self.bias.copy_(bias)

    def _warn_if_larger_than_dense(self) -> None:
        size, dense = self.parameter_counts(), self._dense_size()
        if size.stored > dense:
            warnings.warn(
                f"{type(self).__name__}({self.extra_repr()}) stores {size.stored:,} parameters (U buffers "
                f"included), {size.stored - dense:,} more than the dense layer's {dense:,} "
                f"({size.stored / dense:.2f}x); lower num_terms * low_rank to save memory",
                UserWarning,
                stacklevel=4,
            )

    def _dense_size(self) -> int:
        return dense_size(self.fan_in, self.fan_out, self.bias is not None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw a dense weight and bias with the dense layer's init (U(±1/√fan_in)), from
        ``seed`` when set; represent the weight with ``self.init``; then rescale the
        trainable factors so the effective weight has the dense init's scale (see
        :mod:`panther_lite.nn.default_init`)."""
        if self._factors()[0].is_meta:
            return
        generator = resolve_generator(self.seed)
        weight = draw_dense_default(self.dense_weight_shape, self.fan_in, generator)
        self._fit(weight, self.init, None, generator, "auto")
        fill_bias_default_(self.bias, self.fan_in, generator)
        rescale_to_default_(
            self.effective_weight(), self.fan_in, tuple(getattr(self, name) for name in self._trainable_names)
        )

    @torch.no_grad()
    def initialize_from_weight(
        self, weight: Tensor, init: str = "svd", gram: Optional[Tensor] = None, *, fit: str = "auto",
        output_gram: Optional[Tensor] = None,
    ) -> None:
        """Set the factors to represent the dense ``weight``; the bias is kept.

        Args:
            weight: the dense layer's weight, :attr:`dense_weight_shape`; its unfolding is
                ``weight.reshape(fan_out, fan_in)``.
            init: ``"svd"`` (the best rank-``2Lk`` fit) or ``"sketch"`` (random sign sketches).
            gram: with ``"svd"``, an optional ``(fan_in, fan_in)`` Gram ``XᵀX`` of calibration
                inputs (rows in the unfolding's column order): the fit then minimises the
                error of the outputs instead of the weight's. Must be symmetric positive
                semi-definite.
            fit: with ``"svd"``, how the singular basis is found: ``"exact"`` (a full
                decomposition), ``"randomized"`` (a range finder, much faster for large
                layers at low rank, seeded by ``seed``) or ``"auto"`` (randomized where it
                pays off); see :func:`panther_lite.nn.low_rank_fit.output_subspace`.
            output_gram: with ``"svd"``, an optional metric on the outputs, ``(fan_out, fan_out)``
                or its diagonal ``(fan_out,)`` (e.g. the model's output Fisher at this layer,
                :mod:`panther_lite.conversion.planning.output_fisher`): the fit then minimises
                ``tr(F (W−Ŵ) G (W−Ŵ)ᵀ)``; see
                :func:`panther_lite.nn.low_rank_fit.sketch_factors_from_weight`.

        Raises ValueError (nothing changed) for a wrong shape, a NaN/Inf entry, a meta-device
        weight, a gram that is not a valid Gram matrix, or an output_gram with ``init="sketch"``
        or of a wrong shape.
        """
        init = check_choice("init", init, INITS)
        fit = check_choice("fit", fit, FIT_METHODS)
        self._check_dense_weight("weight", weight)
        self._check_gram(gram, init)
        if output_gram is not None and init != "svd":
            raise ValueError("output_gram: only used by init='svd'")
        self._fit(weight, init, gram, resolve_generator(self.seed), fit, output_gram)

    def _check_gram(self, gram: Optional[Tensor], init: str) -> None:
        if gram is None:
            return
        if init != "svd":
            raise ValueError("a calibration gram is only used by init='svd'")
        check_gram(gram, self.fan_in, self._fan_in_name)

    @torch.no_grad()
    def _fit(
        self, weight: Tensor, init: str, gram: Optional[Tensor], generator: Optional[torch.Generator], fit: str,
        output_gram: Optional[Tensor] = None,
    ) -> None:
        """Represent the (validated) dense ``weight``: every factor is computed before any is set."""
        values = self._factor_values(weight, init, gram, generator, fit, output_gram)
        for target, value in zip(self._factors(), values):
            target.copy_(value.view_as(target))
        self.init = init

    def _factor_values(
        self, weight: Tensor, init: str, gram: Optional[Tensor], generator: Optional[torch.Generator], fit: str,
        output_gram: Optional[Tensor] = None,
    ) -> Tuple[Tensor, ...]:
        """The factors representing ``weight`` as one ``(fan_out, fan_in)`` matrix, computed in
        the decomposition dtype on the factors' device."""
        device = self._factors()[0].device
        work_dtype = decomposition_dtype(weight)
        matrix = weight.detach().to(device=device, dtype=work_dtype).reshape(self.fan_out, self.fan_in)
        if init == "svd":
            g = None if gram is None else gram.detach().to(device=device, dtype=work_dtype)
            metric = None if output_gram is None else output_gram.detach().to(device=device, dtype=work_dtype)
            return self._svd_factors(matrix, g, fit, metric)
        return self._sketch_factors(matrix, generator)

    # ------------------------------------------------------------------ the dense twin

    def to_dense(self) -> nn.Module:
        """The dense layer (same options, dtype and device) computing the same function."""
        reference = self._factors()[0]
        dense = nn.utils.skip_init(
            self._dense_class, **self._dense_options(), device=reference.device, dtype=reference.dtype
        )
        with torch.no_grad():
            dense.weight.copy_(self.effective_weight())
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    @classmethod
    def from_dense(
        cls,
        dense: nn.Module,
        num_terms: int,
        low_rank: int,
        *,
        init: str = "svd",
        seed: Optional[int] = None,
        gram: Optional[Tensor] = None,
        fit: str = "auto",
    ) -> "SketchedLayer":
        """A sketched layer (same options, device and dtype) approximating ``dense``.

        ``init="svd"`` (default) gives the best rank-``2Lk`` fit of its weight, or with
        ``gram`` (``XᵀX`` of the layer's calibration inputs, ``(fan_in, fan_in)``) the best
        fit of its outputs; ``init="sketch"`` the random-sketch (anchor) representation.
        ``fit`` picks the decomposition (see :meth:`initialize_from_weight`).
        """
        if not isinstance(dense, cls._dense_class):
            raise TypeError(f"{cls.__name__} converts an nn.{cls._dense_class.__name__}, got {type(dense).__name__}")
        check_materialized("weight", dense.weight)
        options = cls._options_from_dense(dense)
        layer = nn.utils.skip_init(
            cls,
            **options,
            num_terms=num_terms,
            low_rank=low_rank,
            dtype=dense.weight.dtype,
            device=dense.weight.device,
            init=init,
            seed=seed,
        )
        layer.initialize_from_weight(dense.weight, init=init, gram=gram, fit=fit)
        if dense.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(dense.bias)
        return layer

    # ------------------------------------------------------------------ read-only weight

    @property
    def weight(self) -> Tensor:
        """The effective weight in the dense layer's layout (read-only), for code written
        against dense layers (T5 reads ``self.wo.weight.dtype``; ``nn.MultiheadAttention``
        passes ``out_proj.weight`` to a functional call).

        Cost: each computation is one product of the factors, ``2·fan_out·fan_in·2Lk``
        FLOPs, and holds a dense weight (``fan_out·fan_in`` entries).

        - When autograd needs it (grad mode on and a factor requires grad) or under
          ``torch.compile`` it is :meth:`effective_weight`, differentiable, recomputed on
          every read (compile drops it when only ``.dtype``/``.shape`` are used).
        - Otherwise the product is computed once and kept while the factors are unchanged
          (version counters, storage, dtype, device, and optimizer steps, fused ones
          included; see :mod:`panther_lite.nn.change_detection`); each read returns a
          detached copy of it (a memory copy, not a product), so writing into what a read
          returned, even through ``.data``, changes neither the layer nor later reads. The
          layer's own forward drops the kept product, so memory is held only between a read
          and the next call; a layer whose forward is never run (``nn.MultiheadAttention``'s
          ``out_proj``) keeps one dense weight. ``.to()``/``.half()``, deepcopy and pickling
          drop it too. A write into the *factors* through ``param.data`` outside an optimizer
          is not detected: read ``effective_weight()`` after such writes.

        Like ``nn.Linear.weight``, it has the factors' dtype under autocast too (it is
        computed with autocast off), so a read under autocast equals a read outside it.
        Assigning ``weight`` raises AttributeError (use :meth:`initialize_from_weight`).
        """
        factors = self._factors()
        if (
            torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and any(f.requires_grad for f in factors))
            or any(f.is_inference() for f in factors)
        ):
            return self._effective_weight_without_autocast()
        signature = tensor_signature(factors)
        cached = self.__dict__.get("_weight_cache")
        if cached is None or cached[0] != signature:
            with torch.no_grad():
                weight = self._effective_weight_without_autocast()
            if weight.is_inference():  # computed under inference_mode: nothing to keep it for
                return weight
            cached = self.__dict__["_weight_cache"] = (signature, weight)
        return cached[1].clone()

    def _effective_weight_without_autocast(self) -> Tensor:
        """:meth:`effective_weight` in the factors' dtype, whatever the autocast state."""
        device_type = self._factors()[0].device.type
        if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return self.effective_weight()
        return self.effective_weight()

    def _drop_weight_cache(self) -> None:
        """Free the cached ``weight`` (called by the layers' forward; a no-op under compile)."""
        if not torch.compiler.is_compiling():
            self.__dict__.pop("_weight_cache", None)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            raise AttributeError(
                f"{type(self).__name__}.weight is read-only: it is the effective weight computed from the factors "
                f"{self._factor_names}. To set it, call initialize_from_weight(weight); to get a dense layer, "
                "call to_dense()"
            )
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):
        for name in self._derived_state:
            self.__dict__.pop(name, None)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = super().__getstate__()
        for name in self._derived_state:
            state.pop(name, None)
        return state

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"torch.jit.script does not support {type(self).__name__} (TorchScript is deprecated and cannot "
            "compile its custom op or properties); use torch.compile(model) for speed or "
            "torch.export.export(model, args) for a deployable graph"
        )
