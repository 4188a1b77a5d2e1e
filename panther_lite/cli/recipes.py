"""The ``compress`` command's recipes: ``--recipe NAME`` stands for a set of options measured to
work together, which options given on the command line override.

A recipe is expanded into its options placed before the user's own (:func:`expand_recipe`), so
argparse's rule that a later option wins gives every explicit option precedence wherever it
stands, and the parsed namespace is exactly what typing the options out would give.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["RECIPES", "add_recipe_option", "expand_recipe", "recipe_help"]

_OPTION = "--recipe"

RECIPES: Dict[str, Tuple[str, ...]] = {
    # chosen on validation text (benchmarks/bench_llm_ppl.py --split validation; docs/evaluation.rst)
    "causal-lm": (
        "--allocation", "global", "--sensitivity", "kl", "--sequential", "--random-tokens", "256",
        "--distill", "--distill-max-steps", "320", "--distill-max-minutes", "15", "--distill-lr", "4e-4",
        "--distill-generate", "512", "--calibrate-generated", "128", "--distill-train", "factors,biases,norms",
        "--distill-autocast", "auto", "--output-fisher",
    ),
}
"""``{name: its options}``, as they would be typed."""


def recipe_help() -> str:
    """The ``--recipe`` help: each recipe with the options it stands for."""
    listed = "; ".join(f"{name}: {' '.join(options)}" for name, options in RECIPES.items())
    return f"a preset of options measured to work together (options given here override it): {listed}"


def add_recipe_option(command: argparse.ArgumentParser) -> None:
    """Add ``--recipe NAME`` (the choices of :data:`RECIPES`) to ``command``; it is expanded
    before parsing by :func:`expand_recipe`, so the parsed value only records which was used."""
    command.add_argument(_OPTION, choices=list(RECIPES), metavar="{" + ",".join(RECIPES) + "}", help=recipe_help())


def _named(argv: Sequence[str]) -> Optional[str]:
    """The recipe ``argv`` names (the last ``--recipe NAME`` or ``--recipe=NAME`` before a ``--``), or None."""
    named = None
    for index, item in enumerate(argv):
        if item == "--":
            break
        if item == _OPTION and index + 1 < len(argv):
            named = argv[index + 1]
        elif item.startswith(_OPTION + "="):
            named = item.partition("=")[2]
    return named


def expand_recipe(argv: Sequence[str]) -> List[str]:
    """``argv`` of the ``compress`` command with the options of the recipe it names inserted
    after the command's name, before every option given (an unknown name is left for argparse
    to reject with the choices).

    Examples:
        >>> expand_recipe(["compress", "m", "--recipe", "causal-lm", "--random-tokens", "64"])[:4]
        ['compress', '--allocation', 'global', '--sensitivity']
        >>> expand_recipe(["compress", "m"])
        ['compress', 'm']
    """
    argv = list(argv)
    options = RECIPES.get(_named(argv) or "")
    if options is None or not argv or argv[0] != "compress":
        return argv
    return [argv[0], *options, *argv[1:]]
