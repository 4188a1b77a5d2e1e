"""When panther_lite's transformers plugin (:mod:`.hf_quantizer`) is registered: at once if
transformers' quantizer registry is already loaded, else right after transformers loads it (an
import hook), so ``import panther_lite`` never imports transformers itself.

Example::

    import panther_lite                  # installs the hook (transformers not imported)
    import transformers                  # loading transformers.quantizers.auto registers the plugin
    transformers.AutoModelForCausalLM.from_pretrained(out)
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

__all__ = ["install_transformers_plugin", "transformers_plugin", "REGISTRY_MODULE"]

REGISTRY_MODULE = "transformers.quantizers.auto"


def transformers_plugin():
    """:mod:`.hf_quantizer`, which registers the plugin as it is imported (it imports transformers;
    when it is what made transformers load its registry, it registers once it has run)."""
    return importlib.import_module(f"{__package__}.hf_quantizer")


class _RegisterAfterLoading(importlib.abc.MetaPathFinder):
    """Finds transformers' quantizer registry like the path finder does, and registers the
    plugin as soon as that module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != REGISTRY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def run_then_register(module) -> None:
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            transformers_plugin()

        spec.loader.exec_module = run_then_register
        return spec


def install_transformers_plugin() -> None:
    """Register the plugin now if transformers' quantizer registry is loaded, else once it is."""
    if REGISTRY_MODULE in sys.modules:
        transformers_plugin()
    elif not any(isinstance(finder, _RegisterAfterLoading) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLoading())
