"""Optional dependencies: which extra of panther_lite installs each, the import that says so
when one is missing (``pip install "panther_lite[hf]"`` rather than "No module named ..."),
and quiet imports of them for panther_lite's own programs."""
from __future__ import annotations

import contextlib
import importlib
import logging
from types import ModuleType
from typing import Iterator

__all__ = ["EXTRAS", "require", "quiet_loggers", "quiet_optional_imports"]

# top-level module -> the extra that installs it (None: a dependency of panther_lite itself)
EXTRAS = {
    "transformers": "hf",
    "tokenizers": "hf",
    "safetensors": None,
    "matplotlib": "bench",
    "sklearn": "bench",
    "onnx": "deploy",
    "onnxscript": "deploy",
    "onnxruntime": "deploy",
    "torchao": "deploy",
}
_DISTRIBUTIONS = {"sklearn": "scikit-learn"}  # where pip's name differs from the module's


def _install_hint(top: str) -> str:
    extra = EXTRAS.get(top)
    if extra is None:
        return f"pip install {_DISTRIBUTIONS.get(top, top)} (a dependency of panther_lite: reinstall it)"
    return f'pip install "panther_lite[{extra}]"'


def require(module: str, purpose: str) -> ModuleType:
    """Import and return ``module`` (dotted names allowed); when it, or the package it is part
    of, is not installed, raise ModuleNotFoundError saying that ``purpose`` needs it and which
    extra to install. Any other import failure inside an installed package is left as it is."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in (top, *EXTRAS):  # a dependency of an installed package: its own problem
            raise
        message = f"{purpose} needs {missing!r}, which is not installed: {_install_hint(missing)}"
        raise ModuleNotFoundError(message, name=error.name) from None


# torchao logs each kernel library its build cannot load, and torch's pytree logs a deprecation
# for each Enum torchao registers, when transformers imports torchao while loading a model
_NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Within the block the loggers ``names`` log errors only; then their levels are put back
    as they were, so a library user's logging is never changed.

    Example::

        with quiet_loggers("torchao"):
            import torchao   # its load-time warnings are not logged
    """
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def quiet_optional_imports() -> contextlib.AbstractContextManager:
    """Within the block, optional packages' load-time warnings (listed above) are not logged;
    errors still are. For panther_lite's own programs (the command, scripts, tutorials)."""
    return quiet_loggers(*_NOISY_IMPORT_LOGGERS)
