"""The ``Examples:`` sections of the public docstrings run as written (doctest)."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "panther_lite.conversion.workflows.convert", "panther_lite.conversion.workflows.tune",
    "panther_lite.conversion.workflows.compress", "panther_lite.conversion.config",
    "panther_lite.conversion.distilling.config", "panther_lite.conversion.distilling.distillation",
    "panther_lite.conversion.distilling.objective", "panther_lite.conversion.distilling.teacher_cache",
    "panther_lite.conversion.deploy.freezing", "panther_lite.conversion.saving.loading",
    "panther_lite.conversion.kinds.registry", "panther_lite.conversion.kinds.strategy",
    "panther_lite.conversion.fitting.layer", "panther_lite.conversion.progress", "panther_lite.cli.config_options",
    "panther_lite.evaluation.perplexity", "panther_lite.conversion.distilling.teacher_samples",
]


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_run(name, one_thread):
    pytest.importorskip("transformers")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result
