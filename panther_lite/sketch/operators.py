"""Sketching operators ``S`` (``m × n``) with a dense form and a fast ``apply``; see the package docstring."""
from __future__ import annotations

import abc
import copy
import math
import numbers
import warnings
from typing import Dict, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import Tensor

from .dense import gaussian_matrix, random_signs, sign_matrix
from .hadamard import fwht, hadamard_entries, next_power_of_two
from .random import resolve_generator

__all__ = [
    "SketchOperator",
    "GaussianSketch",
    "SignSketch",
    "SRHTSketch",
    "SJLTSketch",
    "CountSketch",
    "make_sketch",
]


# Dtypes for which PyTorch multiplies a CPU sparse CSR matrix by a dense one.
_CPU_SPARSE_MATMUL_DTYPES = (torch.float32, torch.float64)


def _check_dim(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_dtype(dtype: Optional[torch.dtype]) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


class SketchOperator(abc.ABC):
    """Base class of the random linear maps ``S: R^n -> R^m`` (``m`` = sketch dimension).

    Subclasses hold their random state as tensors named in ``_tensor_names`` and
    implement ``_apply`` and ``to_dense``. Calling the operator is :meth:`apply`.

    Attributes:
        m: sketch (output) dimension.
        n: input dimension.
    """

    _tensor_names: Tuple[str, ...] = ()

    def __init__(self, m: int, n: int) -> None:
        self.m = _check_dim("m", m)
        self.n = _check_dim("n", n)

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the operator's entries (inputs to :meth:`apply` must match)."""
        return next(t.dtype for t in self._tensors() if t.is_floating_point())

    @property
    def device(self) -> torch.device:
        """Device the operator lives on."""
        return next(self._tensors()).device

    def _tensors(self):
        return (getattr(self, name) for name in self._tensor_names)

    def apply(self, x: Tensor) -> Tensor:
        """Sketch the last dimension of ``x``: ``x @ Sᵀ``.

        Args:
            x: ``(*, n)`` dense (strided) tensor of the operator's dtype and device (any
                leading dims, including none).

        Returns:
            ``(*, m)`` tensor. Differentiable in ``x``.
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"{type(self).__name__}.apply expects a Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:
            raise TypeError(
                f"{type(self).__name__}.apply expects a dense (strided) tensor, got layout {x.layout}; "
                "densify it first with x.to_dense()"
            )
        if x.dim() == 0 or x.shape[-1] != self.n:
            raise ValueError(
                f"{type(self).__name__} expects an input whose last dimension is n={self.n}, "
                f"got shape {tuple(x.shape)}"
            )
        if x.dtype != self.dtype:
            raise TypeError(
                f"{type(self).__name__} has dtype {self.dtype} but the input has dtype {x.dtype}; "
                "convert one of them (operator.to(dtype=...))"
            )
        return self._apply(x)

    def __call__(self, x: Tensor) -> Tensor:
        return self.apply(x)

    @abc.abstractmethod
    def _apply(self, x: Tensor) -> Tensor:
        """``x @ Sᵀ`` for a validated ``(*, n)`` input."""

    @abc.abstractmethod
    def to_dense(self) -> Tensor:
        """The operator as an ``(m, n)`` matrix of its dtype and device."""

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "SketchOperator":
        """A copy of the same operator on ``device`` and/or with floating entries of ``dtype``.

        Integer index tensors keep their dtype. ``self`` is not modified.
        """
        if dtype is not None:
            dtype = _check_dtype(dtype)
        moved = copy.copy(self)
        for name, tensor in zip(self._tensor_names, self._tensors()):
            target_dtype = dtype if tensor.is_floating_point() else None
            setattr(moved, name, tensor.to(device=device, dtype=target_dtype))
        return moved

    def extra_repr(self) -> str:
        """The arguments shown by ``repr``."""
        return f"m={self.m}, n={self.n}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()}, dtype={self.dtype}, device={self.device})"


class _DenseSketch(SketchOperator):
    """A sketch stored as its ``(m, n)`` matrix, drawn by ``_draw``; ``apply`` is one GEMM."""

    _tensor_names = ("matrix",)
    _draw = None

    def __init__(self, m: int, n: int, *, seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__(m, n)
        factory_kwargs = {"dtype": _check_dtype(dtype), "device": device}
        self.matrix = self._draw(m, n, seed=seed, generator=generator, **factory_kwargs)

    def _apply(self, x: Tensor) -> Tensor:
        return x @ self.matrix.t()

    def to_dense(self) -> Tensor:
        return self.matrix.clone()


class GaussianSketch(_DenseSketch):
    """Gaussian sketch: i.i.d. N(0, 1/m) entries (:func:`~panther_lite.sketch.gaussian_matrix`).

    Args:
        m: sketch dimension.
        n: input dimension.
        seed: integer seed (exclusive with ``generator``).
        generator: CPU ``torch.Generator`` to draw from (advanced by the draw).
        dtype: floating dtype of the entries (default: ``torch.get_default_dtype()``).
        device: device of the operator.
    """

    _draw = staticmethod(gaussian_matrix)


class SignSketch(_DenseSketch):
    """Scaled sign (Rademacher) sketch: i.i.d. ±1/√m entries (:func:`~panther_lite.sketch.sign_matrix`).

    Takes the same arguments as :class:`GaussianSketch`.
    """

    _draw = staticmethod(sign_matrix)


class SRHTSketch(SketchOperator):
    r"""Subsampled randomized Hadamard transform ``S = √(N/m) · R · (H_N/√N) · P · D``.

    ``D`` flips the signs of ``x``'s ``n`` entries at random, ``P`` zero-pads to ``N``
    (the next power of two), ``H_N`` is the Sylvester Hadamard matrix (applied by :func:`fwht` in
    ``O(N log N)``) and ``R`` keeps ``m`` of its ``N`` rows sampled uniformly without
    replacement. Every entry is ±1/√m and ``E[SᵀS] = I_n``.

    Args:
        m: sketch dimension, ``1 <= m <= N``.
        n: input dimension (any size; padded internally).
        seed, generator, dtype, device: as :class:`GaussianSketch`.

    Attributes:
        padded_n: ``N``.
        signs: ``(n,)`` diagonal of ``D``, ±1.
        rows: ``(m,)`` int64 indices of the kept rows of ``H_N``.
    """

    _tensor_names = ("signs", "rows")

    def __init__(self, m: int, n: int, *, seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__(m, n)
        dtype = _check_dtype(dtype)
        self.padded_n = next_power_of_two(n)
        if m > self.padded_n:
            raise ValueError(
                f"SRHTSketch needs m <= {self.padded_n} (n={n} padded to a power of two), got m={m}"
            )
        gen = resolve_generator(seed, generator)
        self.signs = random_signs((n,), generator=gen, dtype=dtype, device=device)
        self.rows = torch.randperm(self.padded_n, generator=gen)[:m].to(device)

    def _apply(self, x: Tensor) -> Tensor:
        padded = F.pad(x * self.signs, (0, self.padded_n - self.n))
        return fwht(padded).index_select(-1, self.rows) / math.sqrt(self.m)

    def to_dense(self) -> Tensor:
        cols = torch.arange(self.n, device=self.device)
        hadamard = hadamard_entries(self.rows, cols, self.padded_n).to(self.dtype)
        return hadamard * self.signs / math.sqrt(self.m)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, padded_n={self.padded_n}"


def _distinct_rows(m: int, n: int, s: int, generator: Optional[torch.Generator]) -> Tensor:
    """``(n, s)`` int64: per column, a uniformly random set of ``s`` distinct rows of ``[0, m)``.

    Robert Floyd's sampling algorithm, vectorised over the ``n`` columns: ``s`` steps,
    ``O(n·s²)`` work and ``O(n·s)`` memory (never an ``(n, m)`` table).
    """
    chosen = torch.empty(n, s, dtype=torch.int64)
    for step, top in enumerate(range(m - s, m)):
        candidate = torch.randint(0, top + 1, (n,), generator=generator)
        taken = (chosen[:, :step] == candidate[:, None]).any(dim=1)
        chosen[:, step] = torch.where(taken, torch.full_like(candidate, top), candidate)
    return chosen


class SJLTSketch(SketchOperator):
    r"""Sparse Johnson–Lindenstrauss transform: ``s`` nonzeros ±1/√s per column.

    Each column of ``S`` has ``s = nnz_per_column`` nonzeros in distinct rows chosen
    uniformly at random, with independent random signs, so ``E[SᵀS] = I_n`` (Kane and
    Nelson's "graph" construction). ``apply`` costs ``O(ns)`` per row of ``x`` and never
    forms the ``(m, n)`` matrix: a sparse CSR matrix product for float32/float64 on the
    CPU, a scatter-add (``index_add``) elsewhere.

    Args:
        m: sketch dimension.
        n: input dimension.
        nnz_per_column: ``s``, ``1 <= s <= m``.
        seed, generator, dtype, device: as :class:`GaussianSketch`.

    Attributes:
        rows: ``(n, s)`` int64, the rows of column ``j``'s nonzeros.
        values: ``(n, s)`` their values, ±1/√s.
    """

    _tensor_names = ("values", "rows")

    def __init__(self, m: int, n: int, nnz_per_column: int, *, seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__(m, n)
        if (isinstance(nnz_per_column, bool) or not isinstance(nnz_per_column, numbers.Integral)
                or not 1 <= nnz_per_column <= m):
            raise ValueError(f"nnz_per_column must be an integer between 1 and m={m}, got {nnz_per_column!r}")
        self.nnz_per_column = int(nnz_per_column)
        dtype = _check_dtype(dtype)
        gen = resolve_generator(seed, generator)
        self.rows = _distinct_rows(m, n, nnz_per_column, gen).to(device)
        signs = random_signs((n, nnz_per_column), generator=gen, dtype=torch.float64)
        self.values = (signs / math.sqrt(nnz_per_column)).to(dtype=dtype, device=device)

    def _apply(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.n)
        if flat.device.type == "cpu" and flat.dtype in _CPU_SPARSE_MATMUL_DTYPES:
            out = (self._csr() @ flat.t()).t()
        else:
            contributions = (flat.unsqueeze(-1) * self.values).reshape(flat.shape[0], self.n * self.nnz_per_column)
            out = flat.new_zeros(flat.shape[0], self.m).index_add(1, self.rows.reshape(-1), contributions)
        return out.reshape(*x.shape[:-1], self.m)

    def _csr(self) -> Tensor:
        """The operator as a sparse CSR matrix, cached for the current dtype and device."""
        cached = getattr(self, "_csr_cache", None)
        if cached is None or cached.dtype != self.dtype or cached.device != self.device:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
                cached = self.to_sparse().to_sparse_csr()
            self._csr_cache = cached
        return cached

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the CSR cache (``copy.deepcopy`` cannot copy a
        sparse CSR tensor; it is rebuilt on the next ``apply``)."""
        state = self.__dict__.copy()
        state.pop("_csr_cache", None)
        return state

    def _indices(self) -> Tensor:
        cols = torch.arange(self.n, device=self.device).repeat_interleave(self.nnz_per_column)
        return torch.stack((self.rows.reshape(-1), cols))

    def to_dense(self) -> Tensor:
        rows, cols = self._indices()
        dense = torch.zeros(self.m, self.n, dtype=self.dtype, device=self.device)
        return dense.index_put_((rows, cols), self.values.reshape(-1))

    def to_sparse(self) -> Tensor:
        """The operator as a coalesced sparse COO ``(m, n)`` tensor with ``n·s`` nonzeros."""
        return torch.sparse_coo_tensor(
            self._indices(), self.values.reshape(-1), (self.m, self.n), check_invariants=False
        ).coalesce()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nnz_per_column={self.nnz_per_column}"


class CountSketch(SJLTSketch):
    """CountSketch: each column has a single ±1 in a uniformly random row (SJLT with ``s = 1``).

    Takes the same arguments as :class:`GaussianSketch`.
    """

    def __init__(self, m: int, n: int, *, seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__(m, n, 1, seed=seed, generator=generator, dtype=dtype, device=device)

    def extra_repr(self) -> str:
        return SketchOperator.extra_repr(self)


_KINDS: Dict[str, Type[SketchOperator]] = {
    "gaussian": GaussianSketch,
    "sign": SignSketch,
    "srht": SRHTSketch,
    "countsketch": CountSketch,
    "sjlt": SJLTSketch,
}


def make_sketch(kind: str, m: int, n: int, *, seed: Optional[int] = None,
                generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
                device=None, **kwargs) -> SketchOperator:
    """Build a sketching operator ``S`` (``m × n``) by name.

    Args:
        kind: ``"gaussian"``, ``"sign"``, ``"srht"``, ``"countsketch"`` or ``"sjlt"``.
        m: sketch dimension.
        n: input dimension.
        seed, generator, dtype, device: as :class:`GaussianSketch`.
        **kwargs: options of that kind (``nnz_per_column`` for ``"sjlt"``).

    Returns:
        The :class:`SketchOperator`.

    Example::

        >>> S = make_sketch("sjlt", 64, 1000, nnz_per_column=4, seed=0)
        >>> S(torch.randn(8, 1000)).shape
        torch.Size([8, 64])
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown sketch kind {kind!r}; expected one of {tuple(_KINDS)}")
    return _KINDS[kind](m, n, seed=seed, generator=generator, dtype=dtype, device=device, **kwargs)
