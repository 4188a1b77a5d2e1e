"""An SKLinear keeps its factor-cache entry after an eager no-grad call and serves later such calls
through it, skipping the general route's checks, only while the entry still matches its factors,
the input's dtype and the mode; every other call takes the general route with its clear errors."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from panther_lite.nn import SKLinear, clear_factor_cache, sklinear
from panther_lite.nn.onednn_packing import packable

DTYPES = [torch.float32] + ([torch.bfloat16] if packable(torch.zeros(2, 2, dtype=torch.bfloat16)) else [])
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _layer(dtype=torch.float32, bias=True) -> SKLinear:
    torch.manual_seed(0)
    return SKLinear(24, 16, num_terms=2, low_rank=2, bias=bias, dtype=dtype)


def _reference(layer: SKLinear, x: torch.Tensor) -> torch.Tensor:
    weight = layer.effective_weight().detach().double()
    out = x.double() @ weight.T + (0 if layer.bias is None else layer.bias.detach().double())
    return out.to(x.dtype)


def _kept(layer: SKLinear, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = layer(x)
    assert layer.__dict__.get("_cached_factors") is not None
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(24,), (5, 24), (2, 3, 24), (0, 24), (1, 1, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_later_calls_skip_the_general_route_and_equal_it(dtype, shape, bias, monkeypatch):
    layer = _layer(dtype, bias)
    x = torch.randn(*shape, dtype=dtype)
    first = _kept(layer, x)
    monkeypatch.setattr(sklinear, "sketched_linear", lambda *args: pytest.fail("took the general route"))
    with torch.no_grad():
        again = layer(x)
    assert again.shape == (*shape[:-1], 16) and again.dtype == dtype
    assert torch.equal(again, first)
    torch.testing.assert_close(again, _reference(layer, x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("change", ["in-place write", "new parameter", "new .data", "optimizer step"])
def test_an_entry_never_serves_changed_factors(dtype, change):
    layer = _layer(dtype)
    x = torch.randn(4, 24, dtype=dtype)
    _kept(layer, x)
    with torch.no_grad():
        if change == "in-place write":
            layer.S2.mul_(3)
        elif change == "new parameter":
            layer.S1 = torch.nn.Parameter(torch.randn_like(layer.S1))
        elif change == "new .data":
            layer.S2.data = torch.randn_like(layer.S2)
    if change == "optimizer step":
        layer(x).square().sum().backward()
        torch.optim.SGD(layer.parameters(), lr=0.5).step()
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, _reference(layer, x), **TOLERANCE[dtype])


def test_clear_factor_cache_frees_the_kept_entry():
    layer = _layer()
    x = torch.randn(4, 24)
    _kept(layer, x)
    entry = layer.__dict__["_cached_factors"]
    clear_factor_cache()
    assert entry.left is None and entry.right is None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x))
    assert layer.__dict__["_cached_factors"] is not entry


def test_bad_inputs_after_an_entry_is_kept_get_the_clear_errors():
    layer = _layer()
    _kept(layer, torch.randn(4, 24))
    with torch.no_grad():
        with pytest.raises(ValueError, match="in_features=24"):
            layer(torch.randn(4, 23))
        with pytest.raises(TypeError, match="dtype"):
            layer(torch.randn(4, 24, dtype=torch.float64))
        with pytest.raises(TypeError, match="input"):
            layer([1.0] * 24)


def test_autocast_and_autograd_calls_take_the_general_route():
    layer = _layer()
    x = torch.randn(4, 24)
    _kept(layer, x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cast = layer(x)
    assert cast.dtype == torch.bfloat16
    out = layer(x)
    out.sum().backward()
    assert out.requires_grad and layer.S1.grad is not None


def test_copies_casts_and_pickles_drop_the_entry():
    layer = _layer()
    x = torch.randn(4, 24)
    _kept(layer, x)
    clone = copy.deepcopy(layer)
    unpickled = pickle.loads(pickle.dumps(layer))
    assert "_cached_factors" not in clone.__dict__ and "_cached_factors" not in unpickled.__dict__
    layer.double()
    assert "_cached_factors" not in layer.__dict__
    with torch.no_grad():
        torch.testing.assert_close(layer(x.double()), _reference(layer, x.double()))
        torch.testing.assert_close(clone(x), _reference(clone, x))


def test_a_weight_read_is_freed_by_the_next_call():
    layer = _layer()
    x = torch.randn(4, 24)
    _kept(layer, x)
    with torch.no_grad():
        layer.weight
    assert "_weight_cache" in layer.__dict__
    with torch.no_grad():
        layer(x)
    assert "_weight_cache" not in layer.__dict__


def test_compile_and_export_after_an_entry_is_kept_record_the_op():
    torch._dynamo.reset()
    layer = _layer()
    x = torch.randn(4, 24)
    _kept(layer, x)
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), _reference(layer, x))
        layer.S2.mul_(2)  # a graph that froze the cached factors would not see this
        torch.testing.assert_close(compiled(x), _reference(layer, x))
        exported = torch.export.export(layer, (x,))
    assert "panther_lite.sketched_linear" in str(exported.graph)
    torch.testing.assert_close(exported.module()(x), _reference(layer, x))


def test_a_trace_after_an_entry_is_kept_sees_later_weight_updates():
    layer = _layer()
    x = torch.randn(4, 24)
    _kept(layer, x)
    with torch.no_grad():
        traced = torch.jit.trace(layer, (x,), check_trace=False)
        layer.S2.mul_(2)  # a trace of the entry's products would hold the old factors as constants
        torch.testing.assert_close(traced(x), _reference(layer, x))


@pytest.mark.skipif(torch.bfloat16 not in DTYPES, reason="needs prepacked bfloat16 products (AVX-512 BF16 or AMX)")
def test_a_packed_entry_is_not_used_under_autocast():
    layer = _layer(torch.bfloat16)
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    _kept(layer, x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = layer(x)
    assert out.dtype == torch.float16  # autocast's dtype, as nn.Linear gives; the packed products would give bfloat16
