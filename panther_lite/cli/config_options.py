"""Command-line options generated from the config dataclasses (:class:`~panther_lite.ConvertConfig`,
:class:`~panther_lite.RefineConfig`, :class:`~panther_lite.DistillConfig`): each option's name,
default and help come from its field and the field's entry in the class docstring's ``Args:``
section, so the command and the configs cannot drift; the command says only which fields it
offers and how a string becomes a value (its argument type)."""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

__all__ = ["Option", "field_docs", "add_config_options", "config_overrides"]

_ENTRY = re.compile(r"^ {8}(\w+(?:, \w+)*): (.*)$")
_ROLE = re.compile(r":\w+:`~?([\w.]+)`")


@dataclass(frozen=True)
class Option:
    """One config field offered on the command line: ``field``; ``parse``, its argument type
    (``bool``: a flag setting True and its ``--no-`` form setting False; a tuple: the choices); ``aliases``, older option strings
    kept working; ``metavar`` as argparse takes it."""

    field: str
    parse: object = str
    aliases: Tuple[str, ...] = ()
    metavar: Optional[str] = None


def _plain(text: str) -> str:
    """Docstring markup as plain text: ``:func:`~a.b``` → ``b``, double backquotes dropped."""
    text = _ROLE.sub(lambda match: match.group(1).rpartition(".")[2], text)
    return re.sub(r"\s+", " ", text.replace("``", "")).strip()


def field_docs(config_class: type) -> Dict[str, str]:
    """``{field: its first sentence}`` from the ``Args:`` section of ``config_class``'s docstring
    (an entry ``a, b: ...`` documents both).

    Examples:
        >>> from panther_lite import RefineConfig
        >>> field_docs(RefineConfig)["lr"]
        "Adam's learning rate"
    """
    docs: Dict[str, str] = {}
    names: Sequence[str] = ()
    lines = (config_class.__doc__ or "").split("\n")
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), len(lines))
    for line in lines[start + 1:]:
        entry = _ENTRY.match(line)
        if entry:
            names = entry.group(1).split(", ")
            docs.update((name, entry.group(2)) for name in names)
        elif line.startswith(" " * 12) and names:
            docs.update((name, f"{docs[name]} {line.strip()}") for name in names)
        elif line.strip() and not line.startswith(" " * 8):
            break
    return {name: re.split(r"(?<=[^.])\.(?: |$)", _plain(text), maxsplit=1)[0] for name, text in docs.items()}


def _flag(prefix: str, name: str) -> str:
    return f"--{prefix}{name}".replace("_", "-")


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}{name}".replace("-", "_")


def add_config_options(group, config_class: type, options: Sequence[Option], prefix: str = "") -> None:
    """Add to ``group`` an option ``--{prefix}{field}`` (underscores as dashes) for each of
    ``options``, its help the field's documentation with its default; unset, it leaves the
    config's default and is absent from the parsed namespace (``dest``: ``{prefix}{field}`` with
    underscores)."""
    docs = field_docs(config_class)
    defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
    for option in options:
        default = defaults[option.field]
        shown = "off" if default is False else "none" if default is None else default
        kwargs: Dict[str, object] = dict(dest=_dest(prefix, option.field), default=argparse.SUPPRESS,
                                         help=f"{docs[option.field]} (default: {shown})".replace("%", "%%"))
        if option.parse is bool:  # --flag and --no-flag, so a recipe's flag can be turned off
            kwargs.update(action=argparse.BooleanOptionalAction)
        elif isinstance(option.parse, tuple):
            kwargs.update(choices=option.parse)
        else:
            kwargs.update(type=option.parse, metavar=option.metavar)
        group.add_argument(_flag(prefix, option.field), *option.aliases, **kwargs)


def config_overrides(args: argparse.Namespace, options: Sequence[Option], prefix: str = "") -> dict:
    """The config fields the parsed ``args`` set (``{field: value}``), the others left out."""
    given = vars(args)
    return {option.field: given[_dest(prefix, option.field)] for option in options if _dest(prefix, option.field) in given}

