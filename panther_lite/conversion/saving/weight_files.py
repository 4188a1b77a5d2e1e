"""Reading safetensors weight files (one file or a sharded set), with errors naming the file;
a shard index is trusted only with paths inside its own directory."""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

from ...extras import require

WEIGHTS_NAME = "model.safetensors"
SHARD_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_OTHER_SIZES = {"F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8}  # bytes per entry


def _entry_problem(name, entry, data_size: int):
    """What is wrong with one tensor entry of a safetensors header, or None."""
    if not isinstance(entry, dict):
        return f"tensor {name!r}: its entry is not a JSON object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    size = SAFETENSORS_DTYPES[dtype].itemsize if dtype in SAFETENSORS_DTYPES else _OTHER_SIZES.get(dtype)
    if not isinstance(dtype, str) or not dtype:
        return f"tensor {name!r}: dtype {dtype!r} is not a safetensors dtype name"
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return f"tensor {name!r}: shape {shape!r} is not a list of sizes"
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        return f"tensor {name!r}: data_offsets {offsets!r} is not a [begin, end] pair"
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        return f"tensor {name!r}: its data [{begin}, {end}) lies outside the file's {data_size} data bytes"
    if size is not None and end - begin != math.prod(shape) * size:  # sub-byte and newer dtypes: offsets only
        return f"tensor {name!r}: {end - begin} bytes of data for shape {shape} of {dtype}"
    return None


def read_header(path: Path) -> Tuple[dict, int]:
    """``(tensor entries, offset of the data)`` of a safetensors file, from its header alone
    (``{name: {"dtype", "shape", "data_offsets"}}``), each entry checked against the file's
    size; ValueError naming the file and the tensor when it is not one (truncated, or its
    header lies)."""
    try:
        file_size = os.stat(path).st_size
        with open(path, "rb") as file:
            size = struct.unpack("<Q", file.read(8))[0]
            if size > file_size - 8:
                raise ValueError(f"its header claims {size} bytes, the file has {file_size}")
            header = json.loads(file.read(size))
    except RecursionError:
        raise ValueError(f"{str(path)!r} is not a safetensors file: its header is nested too deeply") from None
    except (OSError, struct.error, ValueError, UnicodeDecodeError, MemoryError) as error:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file (truncated or corrupt?): {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{str(path)!r} is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    problem = next((p for name, entry in header.items() if (p := _entry_problem(name, entry, file_size - 8 - size))),
                   None)
    if problem is not None:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file (truncated or tampered?): {problem}")
    return header, 8 + size


_FULL = {errno.ENOSPC: "no space left on the device (or a file-size limit reached)",
         errno.EFBIG: "the file is over the size limit",
         errno.EDQUOT: "the disk quota is exceeded"}
# how torch's and safetensors' writers word a failed write (they may not keep the errno)
_FULL_WORDS = {"No space left": errno.ENOSPC, "os error 28": errno.ENOSPC, "File too large": errno.EFBIG,
               "os error 27": errno.EFBIG, "Disk quota": errno.EDQUOT, "os error 122": errno.EDQUOT,
               "unexpected pos": errno.ENOSPC, "file write failed": errno.ENOSPC}


_REMEDY = "free space there or write elsewhere"


def _write_errors() -> tuple:
    safetensors = sys.modules.get("safetensors")
    return (OSError, RuntimeError) + ((safetensors.SafetensorError,) if hasattr(safetensors, "SafetensorError") else ())


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Writes to ``path`` (a file or a directory) for the duration: a write that fails for want
    of space (``ENOSPC``, ``EFBIG``, ``EDQUOT``, or torch's and safetensors' wording of them) is
    an OSError with that errno naming ``path`` and what to do; other errors pass unchanged."""
    try:
        yield
    except _write_errors() as error:
        text = str(error)
        if _REMEDY in text:  # said already, by a writer inside
            raise
        number = getattr(error, "errno", None)
        number = number if number in _FULL else next((n for words, n in _FULL_WORDS.items() if words in text), None)
        if number is None:
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        raise OSError(number, f"writing {str(path)!r} failed: {_FULL[number]} ({first}); {_REMEDY}") from None


def read_json(path: Path, what: str = "a JSON file"):
    """The JSON value in ``path``; ValueError naming the file when it is not UTF-8 JSON, or is
    nested too deeply to read (a tampered file: Python's parser would hit its recursion limit)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(path)!r} is not valid JSON ({what} was expected): {error}") from None
    except RecursionError:
        raise ValueError(f"{str(path)!r} is not {what}: its JSON is nested too deeply to read") from None


def shard_paths(directory: Path) -> List[Path]:
    """The shard files the index ``directory/model.safetensors.index.json`` names, sorted, each
    checked to lie inside ``directory``: a name must be a relative path without ``..`` whose
    folder is ``directory`` or under it once links are followed (the file itself may be a link
    to elsewhere: a Hugging Face cache snapshot links each file to its blob). ValueError naming
    the index and the shard otherwise, or when the index is not one or a shard is missing."""
    index = Path(directory) / SHARD_INDEX_NAME
    record = read_json(index, "a shard index")
    weight_map = record.get("weight_map") if isinstance(record, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise ValueError(f"{str(index)!r} is not a shard index: expected a JSON object with a weight_map of file names")
    root = os.path.realpath(directory)
    paths = []
    for name in sorted(set(weight_map.values())):
        parts = Path(name).parts
        folder = os.path.realpath(Path(directory, name).parent)
        if not name or Path(name).is_absolute() or ".." in parts or os.path.commonpath([root, folder]) != root:
            raise ValueError(
                f"{str(index)!r} names the shard {name!r}, outside {str(directory)!r}: an index may only name files "
                "inside its own directory (a tampered or hand-edited index? fix its weight_map)"
            )
        paths.append(Path(directory, name))
    missing = [str(path.relative_to(directory)) for path in paths if not path.is_file()]
    if missing:
        raise ValueError(f"{str(index)!r} names shards that are missing: {missing[:5]}")
    return paths


def check_weight_files(directory: Path) -> None:
    """Before transformers' loader reads ``directory``: its shard index names only files inside
    it (:func:`~panther_lite.conversion.saving.weight_files.shard_paths`) and every safetensors
    header there is consistent with its file (ValueError naming the file otherwise)."""
    if (directory / WEIGHTS_NAME).is_file():
        read_header(directory / WEIGHTS_NAME)
    elif (directory / SHARD_INDEX_NAME).is_file():
        for shard in shard_paths(directory):
            read_header(shard)


def load_weights_file(path: Path) -> Dict[str, torch.Tensor]:
    """The tensors of one safetensors file; ValueError naming the file when it is truncated,
    corrupt or not a safetensors file at all."""
    load_file = require("safetensors.torch", "reading a safetensors weights file").load_file
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        message = f"{str(path)!r} is not a readable safetensors file (truncated or corrupt?): {error}"
        raise ValueError(message) from error


def read_weights(directory: Path) -> Dict[str, torch.Tensor]:
    """The tensors of a transformers-style weights file, or of all its shards."""
    if (directory / WEIGHTS_NAME).is_file():
        return load_weights_file(directory / WEIGHTS_NAME)
    index = directory / SHARD_INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"{str(directory)!r} has neither {WEIGHTS_NAME} nor {SHARD_INDEX_NAME}")
    tensors: Dict[str, torch.Tensor] = {}
    for shard in shard_paths(directory):
        tensors.update(load_weights_file(shard))
    return tensors
