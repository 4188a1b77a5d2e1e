"""The bookkeeping of a resumable run, kept in its staging directory: what the run is (a
fingerprint of the checkpoint, the options (a ``filter_fn`` by its code,
:func:`filter_fingerprint`), the calibration data and the versions, so that a
staging directory is only ever resumed by the same run), the plan, and per finished block its
report figures and the hidden states the next block receives (with the random generators'
state); the scratch space holds what is only worth keeping to save work (the captured calls).

A block counts as finished once ``progress.pt`` says so: its tensors and its record are
written first, each under a temporary name renamed into place, so a process killed at any
moment (SIGKILL included) leaves either the previous progress or the new one, never half of
one. A lock (``flock``, released by the kernel when the process dies) keeps two runs out of
one directory.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from .stream_shards import remove_shards, shard_streams
from .weight_files import read_json, writing

__all__ = ["RunFiles", "RunState", "RESUME_DIRECTORY", "filter_fingerprint"]

RESUME_DIRECTORY = ".panther_lite_resume"
_FORMAT, _VERSION = "panther_lite.resume", 1
_PLAIN = (str, int, float, bool, type(None), tuple, list, dict, set, frozenset, bytes)


def _value_digest(value, seen: set) -> str:
    """What a filter refers to, as text: plain data by its value, functions by their code,
    modules and classes by name; ValueError for anything else (its value cannot be told)."""
    if isinstance(value, types.FunctionType):
        return _function_digest(value, seen)
    if isinstance(value, (types.ModuleType, type, types.BuiltinFunctionType)):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value.__name__)}"
    if isinstance(value, _PLAIN) and " at 0x" not in repr(value):
        return repr(value)
    raise ValueError(f"it refers to a {type(value).__name__}, whose value cannot be fingerprinted")


def _code_digest(code: types.CodeType) -> str:
    nested = [_code_digest(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return hashlib.sha256(repr((code.co_code, nested, code.co_names, code.co_varnames)).encode()).hexdigest()


def _function_digest(function: types.FunctionType, seen: set) -> str:
    """A digest of ``function``: its code, defaults, closure and the globals it reads."""
    if id(function) in seen:
        return function.__qualname__
    seen.add(id(function))
    cells = [cell.cell_contents for cell in function.__closure__ or ()]
    read = [function.__globals__[name] for name in function.__code__.co_names if name in function.__globals__]
    parts = [_code_digest(function.__code__), *(_value_digest(value, seen) for value in
                                                [*(function.__defaults__ or ()), *cells, *read])]
    return f"{function.__module__}.{function.__qualname__}:" + hashlib.sha256(repr(parts).encode()).hexdigest()


def filter_fingerprint(filter_fn) -> Tuple[Optional[str], Optional[str]]:
    """``(fingerprint, None)`` of a ``filter_fn`` (a plain Python function: its code, defaults,
    closure and the globals it reads, so an edited lambda differs), or ``(None, why not)``."""
    if filter_fn is None:
        return None, None
    if not isinstance(filter_fn, types.FunctionType):
        return None, f"filter_fn is a {type(filter_fn).__name__}, not a plain Python function"
    try:
        return _function_digest(filter_fn, set()), None
    except ValueError as error:
        return None, f"filter_fn {filter_fn.__qualname__}: {error}"


def _write_json(path: Path, value: Any) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with writing(temporary):
        temporary.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(temporary, path)


def _differences(saved: dict, now: dict) -> List[str]:
    """What differs between the fingerprint a directory was made with and the run's, in words."""
    found = [words for key, words in (("checkpoint", "another checkpoint"), ("data", "other calibration data"))
             if saved.get(key) != now[key]]
    if saved.get("versions") != now["versions"]:
        found.append(f"other versions ({saved.get('versions')} then, {now['versions']} now)")
    old, new = saved.get("options", {}), now["options"]
    changed = [f"{key}: {old.get(key)!r} then, {new.get(key)!r} now" for key in sorted({*old, *new})
               if old.get(key) != new.get(key)]
    if changed:
        found.append(f"other options ({'; '.join(changed)})")
    return found


class RunFiles:
    """The files of the resume directory ``root`` as any process of a run reads them: the parts
    written, the scratch space, the plan, the committed progress and block records."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def part_path(self, name: str) -> Path:
        return self.root / "parts" / f"{name}.safetensors"

    def scratch(self, name: str) -> Path:
        return self.root / "scratch" / name

    def save_scratch(self, name: str, value) -> None:
        """``value`` (tensors in lists, tuples and dicts) saved as ``name`` in the scratch space,
        whole or not at all."""
        temporary = self.scratch(name + ".tmp")
        with writing(temporary):
            torch.save(value, temporary)
        os.replace(temporary, self.scratch(name))

    def load_scratch(self, name: str):
        """What :meth:`save_scratch` saved as ``name``; None when nothing was (or it cannot be
        read back: it is only ever worth recomputing)."""
        path = self.scratch(name)
        try:
            return torch.load(path, weights_only=True) if path.is_file() else None
        except Exception:  # pickle / torch's own errors: recompute it
            return None

    def plan(self) -> Optional[dict]:
        path = self.root / "plan.json"
        return read_json(path, "a saved plan") if path.is_file() else None

    def progress(self, rank: int = 0, world: int = 1) -> Dict[str, Any]:
        """``{"finished", "outside", "streams"}`` of the last commit (0 blocks, nothing, when
        none), ``streams`` those of rank ``rank``'s batches out of ``world`` processes
        (:func:`~.stream_shards.shard_streams`, whatever number of processes committed), the
        random generators set back to their state at that commit."""
        path = self.root / "progress.pt"
        if not path.is_file():
            return dict(finished=0, outside=False, streams=None)
        try:
            state = torch.load(path, weights_only=True)
        except Exception as error:  # pickle / torch's own errors: an unreadable file whatever the cause
            raise ValueError(f"cannot resume: {str(path)!r} is unreadable ({error}); delete the staging directory") from None
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return dict(state, streams=shard_streams(self.root, state, rank, world))

    def record(self, name) -> dict:
        """The report entry committed for block ``name`` (an index, or ``"outside"``)."""
        return read_json(self.root / "blocks" / f"{name}.json", "a block's record")


class RunState(RunFiles):
    """The resume bookkeeping in ``staging/.panther_lite_resume`` for the run ``fingerprint``
    (a JSON-able dict with ``checkpoint``, ``options``, ``data`` and ``versions``). A directory
    left by another run (other checkpoint, options, data or versions), or in use by a live run,
    is a ValueError naming the difference; call :meth:`close` when done (it releases the lock)."""

    def __init__(self, staging: Path, fingerprint: dict) -> None:
        super().__init__(staging / RESUME_DIRECTORY)
        self.root.mkdir(parents=True, exist_ok=True)
        for folder in ("parts", "blocks", "scratch", "streams"):
            (self.root / folder).mkdir(exist_ok=True)
        self._lock = open(self.root / "lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(f"{str(staging)!r} is in use by another run (it holds the lock of {str(self.root)!r})") from None
        manifest = self.root / "manifest.json"
        if manifest.is_file():
            try:
                saved = read_json(manifest, "a resume manifest")
            except ValueError:
                self.close()
                raise
            known = isinstance(saved, dict) and saved.get("format") == _FORMAT
            problems = _differences(saved.get("fingerprint", {}), fingerprint) if known else ["an unknown format"]
            if problems:
                self.close()
                raise ValueError(
                    f"cannot resume from {str(staging)!r}: it was made from {'; '.join(problems)}; delete it to start "
                    "again, or resume with what made it"
                )
        elif any(entry.name != RESUME_DIRECTORY for entry in staging.iterdir()):
            self.close()
            raise ValueError(
                f"cannot resume from {str(staging)!r}: it holds files but no record of the run that wrote them "
                "(stopped while finishing?), so they cannot be checked against this run; delete it to start again"
            )
        else:
            _write_json(manifest, dict(format=_FORMAT, version=_VERSION, fingerprint=fingerprint))

    def close(self) -> None:
        self._lock.close()

    @property
    def holds_work(self) -> bool:
        """Whether a plan (global allocation's, from a pass over the blocks) or a finished block
        is saved: the directory is worth keeping."""
        return (self.root / "plan.json").is_file() or (self.root / "progress.pt").is_file()

    def save_plan(self, plan: dict) -> None:
        _write_json(self.root / "plan.json", plan)

    writes = True  # this process writes the output (across processes: rank 0 alone)

    def commit(self, finished: int, record: dict, streams, outside: bool = False, shards: int = 0) -> None:
        """Record that blocks ``0 .. finished - 1`` (and, with ``outside``, everything outside
        the blocks) are written: ``record`` (JSON) is the last one's report entry, ``streams``
        the hidden states the next block receives (None: not needed, or held by ``shards``
        processes in files of their own, :mod:`.stream_shards`, already written)."""
        _write_json(self.root / "blocks" / f"{'outside' if outside else finished - 1}.json", record)
        state = dict(finished=finished, outside=outside, streams=streams, shards=shards, rng=torch.get_rng_state(),
                     cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])
        temporary = self.root / "progress.pt.tmp"
        with writing(temporary):
            torch.save(state, temporary)
        os.replace(temporary, self.root / "progress.pt")
        remove_shards(self.root, finished if shards else None)  # an earlier commit's, or another world size's

    def remove(self) -> None:
        """Delete the bookkeeping (the run is complete; the lock goes with it)."""
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)
