"""The one registry of layer kinds: which kind a dense module is, which kind a sketched or
frozen layer stands for, and :func:`register_kind` for a user's own layer type."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.nn as nn

from ...nn.validation import check_bool
from .base import LayerKind

__all__ = ["register_kind", "unregister_kind", "registered_kinds", "kind_of", "kind_named", "converted_kind",
           "sketched_types", "frozen_types", "default_kind_for"]

_KINDS: Dict[str, LayerKind] = {}


def register_kind(kind: LayerKind, *, replace: bool = False) -> LayerKind:
    """Make ``convert`` (and densify, freeze, save/load) handle a layer type: ``kind`` says how
    it is recognised, read, sketched, frozen, densified and saved (see
    :class:`~panther_lite.conversion.kinds.LayerKind`; :class:`~panther_lite.conversion.kinds.LinearKind`
    serves any layer computing ``x·Wᵀ + b``). Kinds registered later are tried first, so a
    kind for a subclass of ``nn.Linear`` wins over the built-in one.

        Examples:
        >>> import torch.nn as nn
        >>> from panther_lite.conversion import LinearKind, register_kind
        >>> from panther_lite.conversion.kinds import unregister_kind
        >>> from panther_lite.nn import SKLinear
        >>> class MyLinear(nn.Linear):
        ...     pass
        >>> class SKMyLinear(SKLinear):  # its own built type: a sketched layer names its kind
        ...     pass
        >>> kind = register_kind(LinearKind("MyLinear", MyLinear, built_type=SKMyLinear))
        >>> _ = unregister_kind("MyLinear")

    Raises:
        TypeError: ``kind`` is not a LayerKind.
        ValueError: a kind of that name is registered already (pass ``replace=True``).

    Returns:
        ``kind``.
    """
    if not isinstance(kind, LayerKind):
        raise TypeError(f"register_kind expects a LayerKind instance, got {type(kind).__name__}")
    replace = check_bool("replace", replace)
    if not isinstance(kind.name, str) or not kind.name:
        raise ValueError(f"a layer kind needs a non-empty name, got {kind.name!r}")
    for attribute in ("dense_type", "sketched_type", "built_type", "frozen_type"):
        value = getattr(kind, attribute, None)
        if not (isinstance(value, type) or (attribute == "frozen_type" and value is None)):
            raise TypeError(
                f"layer kind {kind.name!r}: {attribute} must be a class{' (or None)' if attribute == 'frozen_type' else ''}"
                f", got {value!r}: pass the class itself, e.g. nn.Linear"
            )
    if kind.name in _KINDS and not replace:
        raise ValueError(f"a layer kind named {kind.name!r} is registered already; pass replace=True to replace it")
    owner = next((k for k in _KINDS.values() if k.built_type is kind.built_type and k.name != kind.name), None)
    if owner is not None:
        raise ValueError(
            f"layer kind {kind.name!r} builds {kind.built_type.__name__}, which kind {owner.name!r} builds already: "
            f"give it its own built_type (a subclass of {kind.built_type.__name__}), so that densify, freeze and "
            "conversion configs can tell which kind a sketched layer stands for"
        )
    _KINDS.pop(kind.name, None)
    _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> LayerKind:
    """Remove the kind registered as ``name`` and return it (KeyError when there is none)."""
    if name not in _KINDS:
        raise KeyError(f"no layer kind named {name!r} is registered (registered: {list(_KINDS)})")
    return _KINDS.pop(name)


def registered_kinds() -> Tuple[LayerKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS.values())


def kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind of the dense ``module`` (the latest registered that matches), or None when
    convert cannot replace it."""
    return next((kind for kind in reversed(_KINDS.values()) if kind.matches(module)), None)


def kind_named(name: str) -> Optional[LayerKind]:
    """The kind registered as ``name`` (a config's ``dense`` field), or None."""
    return _KINDS.get(name)


def _by_class(module: nn.Module, attribute: str) -> Optional[LayerKind]:
    """The first kind whose ``attribute`` class is the most derived one in ``module``'s MRO."""
    for cls in type(module).__mro__:
        for kind in _KINDS.values():
            if getattr(kind, attribute) is cls:
                return kind
    return None


def converted_kind(module: nn.Module) -> Optional[Tuple[LayerKind, bool]]:
    """``(kind, frozen)`` for a sketched layer (``frozen`` False) or a frozen pair (True): the
    kind of dense layer it stands for; None for any other module. A frozen class several kinds
    share (:class:`~panther_lite.conversion.FrozenLinear`) names its kind in ``dense``."""
    kind = _by_class(module, "built_type")
    if kind is not None:
        return kind, False
    kind = _by_class(module, "frozen_type")
    if kind is None:
        return None
    named = _KINDS.get(getattr(module, "dense", None))
    return (named if named is not None and isinstance(module, named.frozen_type) else kind), True


def sketched_types() -> Tuple[type, ...]:
    """The classes of every kind's sketched layers."""
    return tuple(dict.fromkeys(kind.built_type for kind in _KINDS.values()))


def frozen_types() -> Tuple[type, ...]:
    """The classes of every kind's frozen pairs."""
    return tuple(dict.fromkeys(kind.frozen_type for kind in _KINDS.values() if kind.frozen_type is not None))


def default_kind_for(sketched_name: str) -> Optional[LayerKind]:
    """The first registered kind whose sketched class is named ``sketched_name``: the dense kind
    of a config entry written before entries named their ``dense`` layer."""
    return next((kind for kind in _KINDS.values() if kind.sketched_type.__name__ == sketched_name), None)
