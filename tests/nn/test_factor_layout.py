"""The decode layout of the linear factors: re-laid in place, same values and outputs on every
route (eager with and without grad, compile, export, torch.func, experts), contiguous state
dicts, kept by ``.to()``/deepcopy/``load_state_dict``, and reversible (FSDP2 needs row-major).

The layout changes only how a GEMM kernel reads the factors: bfloat16 (oneDNN) sums in the
same order, so outputs are equal bit for bit; float32 (MKL) picks another kernel (dot products
instead of column updates), so outputs agree to float32 rounding (``assert_close``'s defaults);
float64 gradients pass gradcheck.
"""
from __future__ import annotations

import copy

import pytest
import torch

from panther_lite.nn import SKLinear, SKStackedLinear, use_decode_layout
from panther_lite.nn.factor_layout import uses_decode_layout
from panther_lite.nn.grouped import grouped_sketched_linear

NAMES = ("S1", "U1", "U2", "S2")


def _layer(dtype=torch.float32, **kwargs) -> SKLinear:
    return SKLinear(48, 40, 2, 4, dtype=dtype, seed=0, **kwargs)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit in bfloat16, to rounding in float32 (see the module docstring)."""
    if a.dtype == torch.bfloat16:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b)


def _strides(layer) -> dict:
    return {name: getattr(layer, name).stride() for name in NAMES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relaid_in_place_with_the_dtype_rule(dtype):
    layer = _layer(dtype)
    objects = {name: getattr(layer, name) for name in NAMES}
    pointers = {name: t.data_ptr() for name, t in objects.items()}
    values = {name: t.detach().clone() for name, t in objects.items()}
    use_decode_layout(layer)
    assert uses_decode_layout(layer)
    for name in NAMES:
        tensor = getattr(layer, name)
        assert tensor is objects[name] and tensor.data_ptr() == pointers[name]  # same object, same storage
        assert torch.equal(tensor, values[name])
    right_transposed = dtype == torch.bfloat16  # right factors: transposed in bf16/fp16 only
    assert layer.S1.mT.is_contiguous() and layer.U2.mT.is_contiguous()
    assert layer.U1.mT.is_contiguous() == right_transposed and layer.S2.mT.is_contiguous() == right_transposed
    use_decode_layout(layer, False)
    assert not uses_decode_layout(layer) and all(getattr(layer, name).is_contiguous() for name in NAMES)
    assert all(torch.equal(getattr(layer, name), values[name]) for name in NAMES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_outputs_and_gradients_equal_the_row_major_layout(dtype, rows):
    row_major = _layer(dtype)
    decode = use_decode_layout(copy.deepcopy(row_major))
    x = torch.randn(rows, 48, dtype=dtype)
    with torch.no_grad():
        _same(decode(x), row_major(x))
    grads = []
    for layer in (row_major, decode):
        xg = x.clone().requires_grad_()
        out = layer(xg)
        out.float().square().sum().backward()
        grads.append((out, xg.grad, layer.S1.grad, layer.S2.grad, layer.bias.grad))
    for a, b in zip(*grads):
        _same(a, b)
    assert decode.S1.grad.stride() == decode.S1.stride()  # the gradient follows the parameter's layout


def test_gradcheck_float64_in_the_decode_layout():
    layer = use_decode_layout(_layer(torch.float64))
    x = torch.randn(3, 48, dtype=torch.float64, requires_grad=True)
    from panther_lite.nn.functional import sketched_linear

    def f(x, S1, S2, bias):
        return sketched_linear(x, S1, layer.U1, layer.U2, S2, bias, layer.scale)

    assert torch.autograd.gradcheck(f, (x, layer.S1, layer.S2, layer.bias))


def test_state_dict_is_contiguous_and_loads_into_either_layout():
    decode = use_decode_layout(_layer(torch.bfloat16))
    state = decode.state_dict()
    assert all(t.is_contiguous() for t in state.values())
    assert {k: tuple(t.shape) for k, t in state.items()} == {k: tuple(t.shape) for k, t in _layer().state_dict().items()}
    kept = decode.state_dict(keep_vars=True)
    assert kept["S1"] is decode.S1 and kept["U1"] is decode.U1
    for target in (SKLinear(48, 40, 2, 4, dtype=torch.bfloat16, seed=1),
                   use_decode_layout(SKLinear(48, 40, 2, 4, dtype=torch.bfloat16, seed=1))):
        layout = _strides(target)
        target.load_state_dict(state)
        assert _strides(target) == layout  # load_state_dict copies into the tensors: layout kept
        x = torch.randn(2, 48, dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(target(x), decode(x))


def test_to_applies_the_new_dtypes_rule_and_deepcopy_keeps_it():
    layer = use_decode_layout(_layer(torch.float32))
    half = copy.deepcopy(layer).to(torch.bfloat16)
    assert half.U1.mT.is_contiguous() and half.S2.mT.is_contiguous() and half.S1.mT.is_contiguous()
    back = copy.deepcopy(half).float()
    assert _strides(back) == _strides(layer)
    assert _strides(copy.deepcopy(layer)) == _strides(layer)
    assert not uses_decode_layout(copy.deepcopy(_layer()).to(torch.bfloat16))  # row-major stays row-major


def test_compile_export_and_torch_func_in_the_decode_layout():
    layer = use_decode_layout(_layer())
    x = torch.randn(5, 48)
    expected = layer(x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), expected)
    exported = torch.export.export(layer, (x,))
    torch.testing.assert_close(exported.module()(x), expected)
    params = dict(layer.named_parameters())
    per_sample = torch.func.vmap(lambda row: torch.func.functional_call(layer, params, (row,)))(x)
    torch.testing.assert_close(per_sample, expected)


def test_experts_in_the_decode_layout():
    row_major = SKStackedLinear(3, 32, 24, 1, 4, dtype=torch.bfloat16, seed=0)
    decode = use_decode_layout(copy.deepcopy(row_major))
    assert decode.S1.mT.is_contiguous() and decode.S1.shape == row_major.S1.shape
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    bounds = torch.tensor([0, 2, 2, 7])
    outs = []
    for layer in (row_major, decode):
        with torch.no_grad():
            _, left, right, bias = layer.stacked_operands(x)
            outs.append(torch.cat([(x[s:e] @ left[i]) @ right[i] + bias[i] for i, (s, e) in enumerate([(0, 2), (2, 2), (2, 7)])]))
        outs.append(grouped_sketched_linear(x, layer.S1, layer.U1, layer.U2, layer.S2, layer.bias, bounds, layer.scale))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
