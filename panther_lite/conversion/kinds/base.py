"""The layer-kind description: everything conversion knows about one type of dense layer — how it
is recognised, how its weight and input rows are read, and how its sketched, frozen and dense
forms are built and saved — so no other stage switches on layer types. How its layers are
calibrated, sized and fitted is its strategy's (:mod:`~panther_lite.conversion.kinds.strategy`).

A kind is an instance of a :class:`LayerKind` subclass, registered with
:func:`~panther_lite.conversion.kinds.register_kind`. :class:`~panther_lite.conversion.kinds.LinearKind`
serves any layer computing ``x·Wᵀ + b`` (override :meth:`LayerKind.weight_matrix` and
:meth:`LayerKind.dense_twin` for another weight layout); the convolutions have their own.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ...nn.validation import check_sketch_rank
from ..calibration.batches import layer_input
from ..records import LayerRecord

__all__ = ["LayerKind", "balanced_pair", "pair_bias"]


def balanced_pair(first: Tensor, second: Tensor) -> Tuple[Tensor, Tensor]:
    """The weights of a frozen pair with intermediate channel ``j`` rescaled — row ``j`` of
    ``first`` ``(2Lk, ...)`` by ``d_j``, column ``j`` of ``second`` ``(out, 2Lk, ...)`` by
    ``1/d_j`` — so that both hold the same norm. The function is unchanged, but no channel is
    tiny in one layer and large in the other: the sketched factors are far from balanced (an
    orthonormal ``U2`` beside an ``S2`` holding the singular values), which per-channel int8
    weights represent badly."""
    first_norms = first.flatten(1).float().norm(dim=1)  # float32: a float16 sum of squares overflows
    second_norms = second.transpose(0, 1).flatten(1).float().norm(dim=1)
    usable = (first_norms > 0) & (second_norms > 0)
    scale = torch.where(usable, (second_norms / first_norms.where(usable, 1)).sqrt(), 1).to(first.dtype)
    first = first * scale.view(-1, *(1,) * (first.dim() - 1))
    return first, second / scale.view(1, -1, *(1,) * (second.dim() - 2))


def pair_bias(pair: nn.Module) -> Optional[Tensor]:
    """The bias of a frozen pair (its second layer's; through a quantizer's ``bias()`` method when
    one replaced that layer), so code reading a dense layer's ``bias`` reads the pair's."""
    bias = pair[1].bias
    return bias() if callable(bias) else bias


class LayerKind:
    """One type of dense layer convert can replace.

    Args:
        name: the report's ``kind`` and the conversion config's ``dense`` field (unique).
        dense_type: the dense class; its instances and subclasses' are recognised (see
            :meth:`base`).
        sketched_type: the public sketched class; its name is the config's ``kind``.
        built_type: the class actually built (a subclass of ``sketched_type`` keeping the
            dense layer's conventions), default ``sketched_type``. A converted layer's kind
            is found from it.
        frozen_type: the class of the frozen form (:func:`~panther_lite.freeze`).
        overridden: methods of the dense class a subclass must not override (the sketched
            layer would drop that custom behaviour).
        linear: whether ``target_modules="all-linear"`` targets it.
        row_group: layers of kinds with the same (non-None) ``row_group`` read the same rows
            from one input tensor, so layers fed that very tensor share one Gram (q/k/v).
    """

    def __init__(
        self,
        name: str,
        dense_type: type,
        sketched_type: type,
        *,
        built_type: Optional[type] = None,
        frozen_type: Optional[type] = None,
        overridden: Sequence[str] = ("forward",),
        linear: bool = False,
        row_group: Optional[str] = None,
    ) -> None:
        self.name, self.dense_type, self.sketched_type = name, dense_type, sketched_type
        self.built_type = sketched_type if built_type is None else built_type
        self.frozen_type, self.overridden = frozen_type, tuple(overridden)
        self.linear, self.row_group = linear, row_group

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ------------------------------------------------------------------ recognising
    def base(self, module_type: type) -> Optional[type]:
        """The class of this kind in ``module_type``'s MRO, or None when it is not of this kind."""
        return self.dense_type if issubclass(module_type, self.dense_type) else None

    def matches(self, module: nn.Module) -> bool:
        return self.base(type(module)) is not None

    def custom_behaviour(self, module: nn.Module) -> Optional[str]:
        """Why ``module`` computes something its sketched layer would not (an overridden
        method), or None."""
        base = self.base(type(module))
        for method in self.overridden:
            if getattr(type(module), method) is not getattr(base, method):
                return (
                    f"{type(module).__name__} overrides {base.__name__}.{method} (custom behaviour the sketched "
                    "layer would drop)"
                )
        return None

    def behaviour_note(self, module: nn.Module) -> str:
        """What the report says of a module that converts although its class changes the dense
        class's behaviour (a verified override), else ``""``."""
        return ""

    def unsupported(self, module: nn.Module) -> Optional[str]:
        """Why the sketched layer cannot stand for this module (an option it lacks), or None."""
        return None

    # ------------------------------------------------------------------ reading
    def weight(self, module: nn.Module) -> Tensor:
        """The dense weight parameter (its device and dtype are the layer's)."""
        return module.weight

    def bias(self, module: nn.Module) -> Optional[Tensor]:
        return module.bias

    def tensors(self, module: nn.Module) -> Dict[str, Tensor]:
        """The dense tensors the sketched layer replaces, by attribute name (checked finite and untied)."""
        found = {"weight": self.weight(module), "bias": self.bias(module)}
        return {name: tensor for name, tensor in found.items() if tensor is not None}

    def weight_matrix(self, module: nn.Module) -> Tensor:
        """The weight as a ``(fan_out, fan_in)`` matrix (a view): ``y = x·Wᵀ`` row by row."""
        raise NotImplementedError(f"layer kind {self.name!r} has no single weight matrix: read its records' parts")

    def input_dimension(self, module: nn.Module) -> Tuple[int, int, str]:
        """``(dim, size, what)``: the input dimension the layer reads, the size it must have,
        and its name for errors."""
        return -1, self.weight_matrix(module).shape[1], "last dimension (features)"

    def call_input(self, args: tuple, kwargs: dict) -> Tensor:
        """The input tensor of a call (a forward pre-hook's ``args``/``kwargs``):
        :func:`~panther_lite.conversion.calibration.batches.layer_input`."""
        return layer_input(args, kwargs)

    def read_input(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        """The input of one call of layer ``name`` (a forward pre-hook's ``args``/``kwargs``);
        ValueError naming the layer when its shape does not fit the layer, or its dtype is
        not the weight's (outside autocast, where the layer itself would fail)."""
        x = self.call_input(args, kwargs)
        dim, expected, what = self.input_dimension(module)
        if x.dim() < -dim or x.shape[dim] != expected:
            raise ValueError(
                f"calibration: layer {name!r} expects inputs with {what} {expected}, got a batch "
                f"whose input to it has shape {tuple(x.shape)}; check that calibration_data matches the model"
            )
        weight_dtype = self.weight(module).dtype
        autocast = x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
        if x.dtype != weight_dtype and not autocast:
            raise ValueError(
                f"calibration: layer {name!r} has {weight_dtype} weights, got a batch whose input to it is "
                f"{x.dtype}; convert the batches to the model's dtype (or run them under torch.autocast)"
            )
        return x

    def input_rows(self, module: nn.Module, x: Tensor) -> Iterator[Tuple[Tensor, int]]:
        """The rows ``(n, fan_in)`` the layer multiplies its weight with, in chunks, each with
        its rows per cluster (:mod:`~panther_lite.conversion.calibration.shrinkage`)."""
        raise NotImplementedError

    def token_rows(self, module: nn.Module, x: Tensor, mask: Tensor) -> Optional[Tuple[Tensor, int]]:
        """The rows of :meth:`input_rows` with those at padded tokens zeroed, and the rows per
        cluster, when they line up with the token ``mask`` ``(batch, seq)`` (bool, on ``x``'s
        device); None when they do not (the default: this kind's rows are not tokens), and
        then all rows are used (:mod:`~panther_lite.conversion.calibration.tokens`)."""
        return None

    # ------------------------------------------------------------------ building
    def build(self, module: nn.Module, num_terms: int, low_rank: int, **fit) -> nn.Module:
        """The fitted sketched layer of ``module`` (``fit``: ``init``, ``seed``, ``gram``,
        ``fit`` as the layer's ``from_*`` classmethod takes them)."""
        raise NotImplementedError

    def build_placeholder(self, module: nn.Module, num_terms: int, low_rank: int, device=None) -> nn.Module:
        """A sketched layer of ``module``'s shape and options, on its dtype and device (or
        ``device``), that is not fitted (placeholders for a state_dict; none on meta)."""
        raise NotImplementedError

    def match_trainability(self, new: nn.Module, old: nn.Module) -> None:
        """Give ``new`` the training mode and requires_grad flags of ``old`` (factors follow the weight)."""
        new.train(old.training)
        for name, param in new.named_parameters():
            source = self.bias(old) if name == "bias" else self.weight(old)
            param.requires_grad_(source.requires_grad)

    def dense_twin(self, layer: nn.Module) -> nn.Module:
        """The dense layer a sketched layer of this kind stands for (:func:`~panther_lite.densify`)."""
        return layer.to_dense()

    def densify(self, layer: nn.Module) -> nn.Module:
        """:meth:`dense_twin` with ``layer``'s training mode and requires_grad flags."""
        dense = self.dense_twin(layer)
        dense.train(layer.training)
        factor = next(param for name, param in layer.named_parameters() if name != "bias")
        self.weight(dense).requires_grad_(factor.requires_grad)
        if layer.bias is not None:
            self.bias(dense).requires_grad_(layer.bias.requires_grad)
        return dense

    def frozen_pair(self, layer: nn.Module) -> nn.Sequential:
        """The two standard layers computing ``layer`` (weights set; the bias is set by :meth:`frozen_twin`)."""
        raise NotImplementedError

    def frozen_twin(self, layer: nn.Module) -> nn.Module:
        """The frozen pair computing what the sketched ``layer`` computes (same dtype and device,
        trainability and training mode; on the meta device it holds no values)."""
        frozen = self.frozen_pair(layer)
        with torch.no_grad():
            if layer.bias is not None:
                frozen[1].bias.copy_(layer.bias)
        trainable = any(p.requires_grad for p in layer.parameters())
        frozen.requires_grad_(trainable).train(layer.training)
        return frozen

    def dense_shape(self, layer: nn.Module) -> List[int]:
        """The dense weight's shape, in the dense layer's own layout, of a sketched or frozen layer."""
        raise NotImplementedError

    # ------------------------------------------------------------------ records
    #: Whether ``sequential=True`` regresses the layer on the original outputs (one weight
    #: matrix); a kind that cannot is calibrated on the inputs the partly converted model gives it.
    sequential_regression = True

    #: The name of the strategy that calibrates, sizes and fits this kind's layers
    #: (:mod:`~panther_lite.conversion.kinds.strategy`): ``"matrix"`` for a kind holding one weight
    #: matrix, ``"experts"`` for stacks of experts' matrices.
    strategy = "matrix"

    #: Whether the layer's output holds its ``fan_out`` features in its last dimension, what
    #: :mod:`~panther_lite.conversion.planning.output_fisher` measures the Fisher of.
    output_features_last = False

    def record(self, name: str, module: nn.Module) -> LayerRecord:
        """The conversion record of candidate ``module`` named ``name`` (a kind holding several
        weight matrices gives a record with one part per matrix stack)."""
        return LayerRecord(name, module, self)

    # ------------------------------------------------------------------ conversion configs
    def config_entry(self, layer: nn.Module, frozen: bool) -> dict:
        """The conversion config's fields of a sketched (or frozen) ``layer`` of this kind, but its name."""
        bias = layer.has_bias if frozen else layer.bias is not None
        return dict(
            kind=self.sketched_type.__name__, dense=self.name, shape=self.dense_shape(layer),
            num_terms=layer.num_terms, low_rank=layer.low_rank, bias=bias,
        )

    def check_entry(self, module: nn.Module, entry: dict, name: str) -> dict:
        """ValueError naming layer ``name`` when the config ``entry``'s sizes do not fit the dense
        ``module``; returns the extra keyword arguments :meth:`build` and :meth:`build_placeholder` take."""
        fan_out, fan_in = self.weight_matrix(module).shape
        check_sketch_rank(entry["num_terms"], entry["low_rank"], fan_in, fan_out, layer=name)
        return {}
