"""Shared test configuration: the ``cuda`` marker (skips cleanly without a CUDA device)
and fixtures several test packages use."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of many tiny fits: on a machine busier than its cores,
    OpenMP's spinning makes each tiny LAPACK call take up to a second with two threads (well
    under 1 ms with one). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def logits_error():
    """``error(model, reference, batches)``: relative Frobenius error of ``model``'s logits
    against ``reference``'s over ``model(**batch)`` calls."""

    def error(model, reference, batches) -> float:
        with torch.no_grad():
            squared = sum(float((model(**b).logits - reference(**b).logits).square().sum()) for b in batches)
            return (squared / sum(float(reference(**b).logits.square().sum()) for b in batches)) ** 0.5

    return error


@pytest.fixture
def repo_root() -> Path:
    """The checkout's root directory (scripts, tutorials and docs live under it)."""
    return ROOT
