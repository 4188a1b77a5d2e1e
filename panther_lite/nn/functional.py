"""The sketched-linear operator: ``y = scale · ((x·S1)·U1 + (x·U2)·S2) + b``.

:func:`sketched_linear` picks one of three routes, all computing the same rank-``2Lk``
product (never a per-term ``L × batch × out`` temporary):

* **the custom op** ``panther_lite::sketched_linear`` when a gradient is needed or under
  ``torch.compile``/``torch.export``: a ``torch.library`` op with its own backward, which
  saves only what the requested gradients need (``x`` for ``S1``, ``x·U2`` for ``S2``) and
  computes no gradient for the fixed ``U`` buffers. ``torch.compile(fullgraph=True)`` sees
  one opaque op (no graph break) and ``torch.export`` keeps it. Two schedules, picked by
  the number of rows:

  - *stacked* (``rows >= 4·L·k``): ``h = x·[S1 | U2]`` then ``y = h·[U1; S2]``, two wide
    GEMMs that read ``x`` and write ``y`` once — what a memory-bound layer (small rank,
    many rows) needs; the factors are concatenated per call (they change every training
    step), which is cheap next to ``x``;
  - *split* (fewer rows): ``x·S1`` and ``x·U2`` accumulated into one output, with no
    per-call copy of the factors, which would dominate for a handful of rows;

* **plain GEMMs** when no gradient is needed (``torch.no_grad``/``torch.inference_mode``,
  or nothing requires grad), in eager mode: the stacked schedule for every row count,
  with the concatenated factors ``[S1 | U2]`` and ``scale·[U1; S2]`` cached per layer
  (:mod:`~panther_lite.nn.factor_cache`), so a call is two GEMM launches and little host
  time (operands cast per call, e.g. under autocast, take the op's two schedules uncached).
  In bfloat16 on CPU the cached factors are prepacked for oneDNN and the two products skip
  the per-call setup of ``torch.mm`` (:mod:`~panther_lite.nn.onednn_packing`), which at
  small widths costs more than the product itself.
  Layers whose factors take more than ``CACHE_MAX_BYTES`` are not cached and take the op's
  two schedules: a cached copy of every layer would double a large model's memory at
  inference, and at that size the GEMMs, not the host time, set the speed;
* **composable torch ops** under a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``,
  ``jacfwd``, ``jacrev``, ``hessian``) or forward-mode AD (``torch.autograd.forward_ad``):
  custom-op autograd does not compose with them, so these see ordinary matmuls, whose
  derivatives PyTorch knows. The op keeps a ``vmap`` batching rule for direct calls.

The scale never follows an unscaled product: it is ``addmm``'s ``alpha`` inside the GEMM,
or folded into the small right-hand factors first (cache, composable ops). With
``init="svd"`` the fixed sketch ``U1`` (and the trainable ``S2``) carry the factor ``2L``,
so an unscaled float16 product could overflow where the layer's output does not.

Autocast is applied by :func:`sketched_linear` before any route (custom ops are not cast
by autocast on their own), so every autocast dtype works and the casts are recorded by
autograd: fp32 master parameters receive fp32 gradients.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch._C._functorch import peek_interpreter_stack
from torch.autograd import forward_ad

from .factor_cache import clear_factor_cache, stacked_factors, stacked_product
from .onednn_packing import packable

__all__ = ["sketched_linear", "clear_factor_cache"]

_STACKED_ROWS_PER_RANK = 4
# the largest layer (bytes of its four factors) whose concatenated factors the no-grad route caches
CACHE_MAX_BYTES = 4 * 2**20


def _stacked(rows: int, rank: int) -> bool:
    """Whether ``rows`` input rows at rank ``L·k`` take the stacked schedule (measured on
    CPU: for ``L·k = 8`` it is 1.6–3.3× faster from 32 rows on, for ``L·k >= 32`` the two
    schedules tie from ``4·L·k`` rows and the split one wins below)."""
    return rows >= _STACKED_ROWS_PER_RANK * rank


def _scaled_product(bias: Optional[Tensor], a: Tensor, b: Tensor, scale: float, out: Optional[Tensor] = None) -> Tensor:
    """``scale · a·b (+ bias)`` with the scale applied inside the GEMM (no unscaled fp16
    product), into ``out`` when given."""
    if bias is None:
        # beta=0 ignores the zeros; they are expanded to the output's shape because inductor's
        # C++ GEMM template (max-autotune) cannot lower a 0-d input
        zeros = a.new_zeros(()).expand(a.shape[0], b.shape[1])
        return torch.addmm(zeros, a, b, beta=0, alpha=scale, out=out)
    return torch.addmm(bias, a, b, alpha=scale, out=out)


def _split_product(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tuple[Tensor, Tensor]:
    """The split schedule: ``(y, x·U2)`` with ``y`` of shape ``(rows, out)``."""
    x_U2 = x @ U2
    out = _scaled_product(bias, x @ S1, U1, scale)
    return out.addmm_(x_U2, S2, alpha=scale), x_U2


def stacked_rows_forward(
    x: Tensor,
    left: Tensor,
    right: Tensor,
    bias: Optional[Tensor],
    scale: float,
    out: Optional[Tensor] = None,
    hidden: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The stacked schedule: ``hidden = x·[S1 | U2]`` ``(rows, 2R)``, then
    ``out = scale·hidden·[U1; S2] (+ bias)``; written into ``out``/``hidden`` when given
    (the grouped experts op passes row slices of its outputs). Returns ``(out, hidden)``."""
    hidden = torch.mm(x, left, out=hidden)
    return _scaled_product(bias, hidden, right, scale, out), hidden


def stacked_rows_backward(
    grad_out: Tensor,
    x: Tensor,
    x_U2: Tensor,
    left: Tensor,
    right: Tensor,
    scale: float,
    needs: Tuple[bool, bool, bool, bool],
    grad_x: Optional[Tensor] = None,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients ``(x, S1, S2, bias)`` of :func:`stacked_rows_forward` (None where ``needs``
    says not needed), ``grad_x`` written into the given buffer; the scale stays inside the GEMMs."""
    need_x, need_S1, need_S2, need_bias = needs
    rank = left.shape[1] // 2
    grad_S1 = grad_S2 = grad_bias = None
    if need_x or need_S1:
        grad_hidden = _scaled_product(None, grad_out, right.t(), scale)  # [d/d(x·S1) | d/d(x·U2)]
        if need_x:
            grad_x = torch.mm(grad_hidden, left.t(), out=grad_x)
        if need_S1:
            grad_S1 = x.t() @ grad_hidden[:, :rank]
    if need_S2:
        grad_S2 = _scaled_product(None, x_U2.t(), grad_out, scale)
    if need_bias:
        grad_bias = grad_out.sum(0)
    return grad_x if need_x else None, grad_S1, grad_S2, grad_bias


def rows_forward(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tuple[Tensor, Tensor]:
    """The op's forward on ``(rows, in)``: ``(y, x·U2)``, by the stacked or split schedule."""
    rank = S1.shape[1]
    if _stacked(x.shape[0], rank):
        out, hidden = stacked_rows_forward(x, torch.cat((S1, U2), dim=1), torch.cat((U1, S2), dim=0), bias, scale)
        return out, hidden[:, rank:].clone()
    return _split_product(x, S1, U1, U2, S2, bias, scale)


@torch.library.custom_op("panther_lite::sketched_linear", mutates_args=())
def _sketched_linear_op(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tuple[Tensor, Tensor]:
    return rows_forward(x, S1, U1, U2, S2, bias, scale)


@_sketched_linear_op.register_fake
def _(x, S1, U1, U2, S2, bias, scale):
    return x.new_empty(x.shape[0], U1.shape[1]), x.new_empty(x.shape[0], U2.shape[1])


def _setup_context(ctx, inputs, output):
    x, S1, U1, U2, S2, bias, scale = inputs
    _, x_U2 = output
    ctx.scale = scale
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)  # x·U2 is internal: no zero-filled gradient for it
    need_S1, need_S2 = ctx.needs_input_grad[1], ctx.needs_input_grad[4]
    ctx.save_for_backward(x if need_S1 else None, x_U2 if need_S2 else None, S1, U1, U2, S2)


def rows_backward(
    grad_out: Optional[Tensor],
    grad_x_U2: Optional[Tensor],
    saved: Tuple[Optional[Tensor], ...],
    scale: float,
    needs: Tuple[bool, bool, bool, bool],
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients ``(x, S1, S2, bias)`` of :func:`rows_forward` (None where not needed).

    ``saved`` is ``(x, x·U2, S1, U1, U2, S2)`` (``x`` may be None unless ``S1`` needs a
    gradient, ``x·U2`` unless ``S2`` does); ``needs`` says which of ``x``, ``S1``, ``S2``
    and the bias need one."""
    x, x_U2, S1, U1, U2, S2 = saved
    need_x, need_S1, need_S2, need_bias = needs
    grad_x = grad_S1 = grad_S2 = grad_bias = None
    if grad_out is None:  # only the internal x·U2 output was used
        if need_x and grad_x_U2 is not None:
            grad_x = grad_x_U2 @ U2.t()
        return grad_x, None, None, None
    if need_x and grad_x_U2 is None and _stacked(grad_out.shape[0], S1.shape[1]):
        left, right = torch.cat((S1, U2), dim=1), torch.cat((U1, S2), dim=0)
        return stacked_rows_backward(grad_out, x, x_U2, left, right, scale, needs)
    g = grad_out * scale
    if need_x or need_S1:
        grad_x_S1 = g @ U1.t()
        if need_x:
            grad_wrt_x_U2 = g @ S2.t() if grad_x_U2 is None else torch.addmm(grad_x_U2, g, S2.t())
            grad_x = (grad_x_S1 @ S1.t()).addmm_(grad_wrt_x_U2, U2.t())
        if need_S1:
            grad_S1 = x.t() @ grad_x_S1
    if need_S2:
        grad_S2 = x_U2.t() @ g
    if need_bias:
        grad_bias = grad_out.sum(0)
    return grad_x, grad_S1, grad_S2, grad_bias


def _backward(ctx, grad_out: Optional[Tensor], grad_x_U2: Optional[Tensor]):
    need = ctx.needs_input_grad
    needs = (need[0], need[1], need[4], ctx.has_bias and need[5])
    grad_x, grad_S1, grad_S2, grad_bias = rows_backward(grad_out, grad_x_U2, ctx.saved_tensors, ctx.scale, needs)
    return grad_x, grad_S1, None, None, grad_S2, grad_bias, None


_sketched_linear_op.register_autograd(_backward, setup_context=_setup_context)


@_sketched_linear_op.register_vmap
def _(info, in_dims, x, S1, U1, U2, S2, bias, scale):
    """``torch.func.vmap``: a batch of inputs with shared factors (per-sample gradients)
    folds into the rows of one call; batched factors fall back to batched matmuls."""
    x_dim, factor_dims, bias_dim = in_dims[0], in_dims[1:5], in_dims[5]
    if x_dim is not None and all(d is None for d in factor_dims) and bias_dim is None:
        batch = x.movedim(x_dim, 0)
        out, x_U2 = _sketched_linear_op(batch.reshape(-1, batch.shape[-1]), S1, U1, U2, S2, bias, scale)
        return (out.view(*batch.shape[:2], -1), x_U2.view(*batch.shape[:2], -1)), (0, 0)
    x, S1, U1, U2, S2 = (t if d is None else t.movedim(d, 0) for t, d in zip((x, S1, U1, U2, S2), in_dims))
    x = x if x_dim is not None else x.expand(info.batch_size, *x.shape)
    x_U2 = x @ U2
    out = _composable_product(x, S1, U1, U2, S2, None, scale)
    if bias is not None:
        out = out + (bias if bias_dim is None else bias.movedim(bias_dim, 0).unsqueeze(1))
    return (out, x_U2), (0, 0)


def _composable_product(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tensor:
    """The product with out-of-place torch ops only, for functorch transforms and forward AD.
    The scale goes on the small ``U1``/``S2`` first so no unscaled product is formed."""
    out = (x @ S1) @ (U1 * scale) + (x @ U2) @ (S2 * scale)
    return out if bias is None else out + bias


def _onnx_product(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tensor:
    """The stacked schedule in standard ops for ONNX, which has no kernel for the custom op:
    two ``MatMul`` of width ``2Lk`` whose right-hand sides, ``[S1 | U2]`` and
    ``scale·[U1; S2]``, the exporters fold into initializers the size of the factors (the
    dense weight is never formed)."""
    hidden = x @ torch.cat((S1, U2), dim=1)
    out = hidden @ (torch.cat((U1, S2), dim=0) * scale)
    return out if bias is None else out + bias


def _under_transform() -> bool:
    """Whether a ``torch.func`` transform or a forward-AD dual level is active."""
    return peek_interpreter_stack() is not None or forward_ad._current_level >= 0


def eager_no_grad() -> bool:
    """Whether a call now runs eagerly with nothing recorded: grad mode off, no autocast,
    nothing capturing (compile, export, ``torch.jit.trace``) or transforming (``torch.func``,
    forward AD). Such a call of a layer whose factors are cached is two plain products."""
    return not (
        torch.is_grad_enabled() or torch._C._is_any_autocast_enabled() or torch.compiler.is_compiling()
        or torch.jit.is_tracing() or _under_transform()
    )


def _autocast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Autocast's rule: floating tensors other than float64 run in the autocast dtype."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def autocast_enabled_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``; False on devices autocast does not know,
    such as meta. Dynamo cannot trace ``is_autocast_available`` (torch 2.11), and every
    device it compiles for has autocast, so a compiled call asks only ``is_autocast_enabled``."""
    available = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)
    return available and torch.is_autocast_enabled(device_type)


def cast_operands(x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor]) -> tuple:
    """The sketches in the factors' dtype, then autocast's casts (none when it is off)."""
    if U1.dtype != S1.dtype or U2.dtype != S1.dtype:
        U1, U2 = U1.to(S1.dtype), U2.to(S1.dtype)
    # _is_any_autocast_enabled is one cheap call; the per-device query only runs under autocast
    if torch._C._is_any_autocast_enabled():
        device_type = x.device.type
        if autocast_enabled_on(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, S1, U1, U2, S2 = (_autocast(t, dtype) for t in (x, S1, U1, U2, S2))
            bias = None if bias is None else _autocast(bias, dtype)
    return x, S1, U1, U2, S2, bias


def check_operands(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], what: str = "sketched_linear"
) -> None:
    """TypeError/ValueError (prefixed by ``what``) unless every operand has the input's dtype and device."""
    named = [("S1", S1), ("U1", U1), ("U2", U2), ("S2", S2)] + ([("bias", bias)] if bias is not None else [])
    for name, t in named:
        if t.dtype != x.dtype:
            raise TypeError(
                f"{what}: {name} has dtype {t.dtype} but the input has {x.dtype}; "
                "cast one of them (autocast leaves float64 alone)"
            )
        if t.device != x.device:
            raise ValueError(f"{what}: {name} is on {t.device} but the input is on {x.device}")


def needs_grad(x: Tensor, S1: Tensor, S2: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether autograd records a product of these operands (grad mode on, one requires grad)."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or S1.requires_grad or S2.requires_grad or (bias is not None and bias.requires_grad)


def cache_fits(S1: Tensor, S2: Tensor) -> bool:
    """Whether a layer's factors are small enough for the factor cache (``CACHE_MAX_BYTES``)."""
    return 2 * (S1.numel() + S2.numel()) * S1.element_size() <= CACHE_MAX_BYTES


def packs(x: Tensor, S1: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether the cached factors of a call with these operands are prepacked for oneDNN."""
    return packable(S1) and x.dtype == S1.dtype and (bias is None or bias.dtype == S1.dtype)


def _no_grad_product(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float, cacheable: bool
) -> Tensor:
    """Plain GEMMs, no autograd: two with the cached stacked factors (layers up to
    ``CACHE_MAX_BYTES``; prepacked for oneDNN in bfloat16 on CPU), else either schedule."""
    if cacheable and cache_fits(S1, S2):
        left, right = stacked_factors(S1, U1, U2, S2, scale, packs(x, S1, bias))
        return stacked_product(x, left, right, bias)
    if _stacked(x.shape[0], S1.shape[1]):
        hidden = torch.mm(x, torch.cat((S1, U2), dim=1))
        return _scaled_product(bias, hidden, torch.cat((U1, S2), dim=0), scale)
    return _split_product(x, S1, U1, U2, S2, bias, scale)[0]


def _rows_product(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float, cacheable: bool
) -> Tensor:
    """``(rows, in) -> (rows, out)`` by the route this call needs (see the module docstring).
    Graph capture (compile, export, ``torch.jit.trace``) always records the op: a trace of
    the cached factors would freeze today's weights into the graph as constants. ONNX
    export (both exporters) records plain ops instead (:func:`_onnx_product`)."""
    capturing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    if not capturing:
        if _under_transform():
            check_operands(x, S1, U1, U2, S2, bias)
            return _composable_product(x, S1, U1, U2, S2, bias, scale)
        if not needs_grad(x, S1, S2, bias):
            try:
                return _no_grad_product(x, S1, U1, U2, S2, bias, scale, cacheable)
            except RuntimeError:
                check_operands(x, S1, U1, U2, S2, bias)  # checked lazily: the clear error for mismatched operands
                raise
    check_operands(x, S1, U1, U2, S2, bias)
    if capturing and torch.onnx.is_in_onnx_export():
        return _onnx_product(x, S1, U1, U2, S2, bias, scale)
    return _sketched_linear_op(x, S1, U1, U2, S2, bias, scale)[0]


def sketched_linear(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tensor:
    """Apply a sketched linear map to ``x`` of shape ``(*, in)``; returns ``(*, out)``.

    Args:
        x: input ``(*, in)``; any number of leading dims, or 1-D ``(in,)``.
        S1: ``(in, R)`` with ``R = L·k``, the concatenated trainable left factors.
        U1: ``(R, out)`` fixed sketch.
        U2: ``(in, R)`` fixed sketch.
        S2: ``(R, out)`` trainable right factors.
        bias: ``(out,)`` or None.
        scale: ``1 / (2L)``.

    The fixed sketches follow the trainable factors' dtype (so parameter-only casts such
    as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` work). Under autocast the
    floating inputs except float64 are cast to the autocast dtype, as for ``F.linear``;
    otherwise the input must have the parameters' dtype (TypeError) and device.
    """
    if U1.requires_grad or U2.requires_grad:
        raise ValueError("U1 and U2 are fixed sketches and get no gradient; train S1 and S2 instead")
    x, S1c, U1c, U2c, S2c, bias = cast_operands(x, S1, U1, U2, S2, bias)
    cacheable = S1c is S1 and U1c is U1 and U2c is U2 and S2c is S2  # no per-call copies to cache
    if x.dim() == 2:
        return _rows_product(x, S1c, U1c, U2c, S2c, bias, scale, cacheable)
    out = _rows_product(x.reshape(-1, x.shape[-1]), S1c, U1c, U2c, S2c, bias, scale, cacheable)
    return out.reshape(*x.shape[:-1], out.shape[-1])
